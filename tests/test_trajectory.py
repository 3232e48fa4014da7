"""Trajectory token views (§4 alignment), JSONL durability, and collate()."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.rollout import RolloutBatch, Trajectory, TrajectoryLog, Turn, collate, read_trajectories
from trajgrad.rollout.collate import position_ids_from_attention_mask

EOS = 2


def hand_trajectory(**kw) -> Trajectory:
    """prompt [11, 12, 13]; turn 0 = action [21, 22, EOS] + obs [31, 32] (version 3);
    turn 1 = action [23, EOS] + no observation (version 4)."""
    turns = [
        Turn(action_ids=[21, 22, EOS], observation_ids=[31, 32], behaviour_logp=[-0.5, -1.25, -0.125],
             policy_version=3, reward=0.25, info={"cost": 0.5, "potential": 1.0}),
        Turn(action_ids=[23, EOS], observation_ids=[], behaviour_logp=[-2.0, -0.0625], policy_version=4,
             reward=1.0, info={"success": True}),
    ]
    args = dict(task_id="task-a", episode_id="ep-1", prompt_ids=[11, 12, 13], turns=turns, terminated=True,
                success=True, sampling={"temperature": 1.0}, metadata={"initial_potential": 0.5})
    args.update(kw)
    return Trajectory(**args)


# ----------------------------------------------------------------------------- token views
def test_hand_derived_views():
    tr = hand_trajectory()
    ids = tr.token_ids()
    assert ids == [11, 12, 13, 21, 22, EOS, 31, 32, 23, EOS]
    assert len(tr) == 10
    # targets = ids[1:] = [12, 13, 21, 22, EOS, 31, 32, 23, EOS]
    assert tr.action_mask() == [0, 0, 1, 1, 1, 0, 0, 1, 1]
    nan = float("nan")
    got = tr.behaviour_logp_aligned()
    want = [nan, nan, -0.5, -1.25, -0.125, nan, nan, -2.0, -0.0625]
    assert len(got) == 9
    for g, w in zip(got, want):
        assert (math.isnan(g) and math.isnan(w)) or g == w
    assert tr.policy_versions_aligned() == [-1, -1, 3, 3, 3, -1, -1, 4, 4]
    assert tr.turn_ids_aligned() == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert tr.rewards_per_turn() == [0.25, 1.0]
    assert tr.total_reward == 1.25
    assert tr.num_action_tokens == 5


turn_strategy = st.builds(
    lambda a, o, lp, v, r: Turn(action_ids=a, observation_ids=o, behaviour_logp=lp[: len(a)] + [-1.0] * (len(a) - len(lp)),
                                policy_version=v, reward=r),
    st.lists(st.integers(0, 200), min_size=1, max_size=6),
    st.lists(st.integers(0, 200), max_size=5),
    st.lists(st.floats(-30.0, 0.0, allow_nan=False), max_size=6),
    st.integers(0, 9),
    st.floats(-5, 5, allow_nan=False),
)
traj_strategy = st.builds(
    lambda p, turns: Trajectory(task_id="t", episode_id="e", prompt_ids=p, turns=turns),
    st.lists(st.integers(0, 200), min_size=1, max_size=6),
    st.lists(turn_strategy, min_size=1, max_size=4),
)


@settings(max_examples=40, deadline=None)
@given(traj_strategy)
def test_views_property(tr):
    ids = tr.token_ids()
    targets = ids[1:]
    mask = tr.action_mask()
    logp = tr.behaviour_logp_aligned()
    vers = tr.policy_versions_aligned()
    tids = tr.turn_ids_aligned()
    assert len(mask) == len(logp) == len(vers) == len(tids) == len(ids) - 1
    # the masked targets, in order, are exactly the sampled action tokens
    assert [t for t, m in zip(targets, mask) if m] == [x for turn in tr.turns for x in turn.action_ids]
    assert [x for x, m in zip(logp, mask) if m] == [x for turn in tr.turns for x in turn.behaviour_logp]
    assert all(math.isnan(x) for x, m in zip(logp, mask) if not m)
    assert [v for v, m in zip(vers, mask) if m] == [turn.policy_version for turn in tr.turns for _ in turn.action_ids]
    assert all(v == -1 for v, m in zip(vers, mask) if not m)
    # turn ids are non-decreasing and each turn's tokens carry its index
    assert tids == sorted(tids) and max(tids) == len(tr.turns) - 1
    assert ids == tr.prompt_ids + [x for turn in tr.turns for x in turn.action_ids + turn.observation_ids]


@settings(max_examples=40, deadline=None)
@given(traj_strategy)
def test_json_round_trip_property(tr):
    line = tr.to_json()
    assert "\n" not in line
    back = Trajectory.from_json(line)
    assert back == tr
    # floats round-trip bit for bit
    for a, b in zip(back.turns, tr.turns):
        assert a.behaviour_logp == b.behaviour_logp


def test_json_round_trip_hand():
    tr = hand_trajectory(metadata={"x": (1, 2), "t": torch.tensor(3.5)})
    back = Trajectory.from_json(tr.to_json())
    assert back.token_ids() == tr.token_ids()
    assert back.metadata == {"x": [1, 2], "t": 3.5}
    assert back.turns[1].info == {"success": True}
    assert back.success is True and back.terminated is True


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(action_ids=[1, 2], behaviour_logp=[-1.0]), "behaviour_logp"),
        (dict(action_ids=[1], behaviour_logp=[0.5]), "behaviour_logp"),
        (dict(action_ids=[1], behaviour_logp=[float("nan")]), "behaviour_logp"),
        (dict(action_ids=[1], behaviour_logp=[-float("inf")]), "behaviour_logp"),
        (dict(action_ids=[], behaviour_logp=[]), "action_ids"),
        (dict(action_ids=[-3], behaviour_logp=[-1.0]), "action_ids"),
        (dict(action_ids=[1.5], behaviour_logp=[-1.0]), "action_ids"),
        (dict(action_ids=[1], behaviour_logp=[-1.0], observation_ids="abc"), "observation_ids"),
        (dict(action_ids=[1], behaviour_logp=[-1.0], policy_version=1.5), "policy_version"),
        (dict(action_ids=[1], behaviour_logp=[-1.0], reward=float("inf")), "reward"),
    ],
)
def test_turn_bad_input(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Turn(**kwargs)


def test_trajectory_bad_input():
    with pytest.raises(ValueError, match="prompt_ids"):
        hand_trajectory(prompt_ids=[])
    with pytest.raises(ValueError, match="turns"):
        hand_trajectory(turns=["not a turn"])
    with pytest.raises(ValueError, match="segment"):
        hand_trajectory(segment=-1)
    with pytest.raises(ValueError, match="line"):
        Trajectory.from_json("{not json")
    with pytest.raises(ValueError, match="d"):
        Trajectory.from_dict({"task_id": "x"})


# ----------------------------------------------------------------------------- JSONL log
def test_log_round_trip(tmp_path):
    path = tmp_path / "sub" / "log.jsonl"
    trs = [hand_trajectory(episode_id=f"ep-{i}") for i in range(5)]
    with TrajectoryLog(path) as log:
        assert len(log) == 0 and log.offset == 0
        assert log.append(trs[0]) == 1
        assert log.extend(trs[1:]) == 5
        assert [t.episode_id for t in log] == [f"ep-{i}" for i in range(5)]
    back = TrajectoryLog.read(path)
    assert back == trs
    assert read_trajectories(path, start=3) == trs[3:]
    with TrajectoryLog(path) as log:  # reopening counts the existing lines
        assert log.offset == 5
        log.append(trs[0])
        assert log.offset == 6
    assert len(path.read_text().splitlines()) == 6


def test_log_fsync_per_append(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    with TrajectoryLog(tmp_path / "log.jsonl") as log:
        for i in range(3):
            log.append(hand_trajectory(episode_id=str(i)))
        assert len(calls) == 3
        log.extend([hand_trajectory(), hand_trajectory()])
        assert len(calls) == 4  # one fsync per extend


def test_log_torn_last_line(tmp_path):
    path = tmp_path / "log.jsonl"
    trs = [hand_trajectory(episode_id=f"ep-{i}") for i in range(3)]
    with TrajectoryLog(path) as log:
        log.extend(trs)
    full = path.read_bytes()
    line = trs[0].to_json().encode()
    with open(path, "ab") as f:  # a write interrupted half way
        f.write(line[: len(line) // 2])
    assert TrajectoryLog.read(path) == trs  # ignored when reading
    assert path.read_bytes() != full  # ... without touching the file
    with TrajectoryLog(path) as log:  # reopening cuts it off
        assert log.offset == 3
        assert path.read_bytes() == full
        log.append(trs[0])
    assert TrajectoryLog.read(path) == trs + [trs[0]]


def test_log_truncate_to(tmp_path):
    path = tmp_path / "log.jsonl"
    trs = [hand_trajectory(episode_id=f"ep-{i}") for i in range(4)]
    with TrajectoryLog(path) as log:
        log.extend(trs)
        log.truncate_to(2)
        assert log.offset == 2
        assert TrajectoryLog.read(path) == trs[:2]
        log.append(trs[3])
        assert TrajectoryLog.read(path) == [trs[0], trs[1], trs[3]]
        with pytest.raises(ValueError, match="n"):
            log.truncate_to(7)
        with pytest.raises(ValueError, match="n"):
            log.truncate_to(-1)
        log.truncate_to(0)
        assert log.offset == 0 and path.read_bytes() == b""


def test_log_rejects_non_trajectory(tmp_path):
    with TrajectoryLog(tmp_path / "log.jsonl") as log:
        with pytest.raises(ValueError, match="trajectories"):
            log.append({"task_id": "x"})
        log.close()
        with pytest.raises(ValueError, match="log"):
            log.append(hand_trajectory())


def test_log_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text(hand_trajectory().to_json() + "\n{garbage}\n")
    with pytest.raises(ValueError, match="path"):
        TrajectoryLog.read(path)


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from trajgrad.rollout import Trajectory, Turn, TrajectoryLog
    path, n, torn = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    log = TrajectoryLog(path)
    for i in range(n):
        log.append(Trajectory(task_id="t", episode_id=str(i), prompt_ids=[1, 2],
                              turns=[Turn(action_ids=[3, 2], behaviour_logp=[-0.5, -0.25])]))
    if torn:  # die in the middle of writing the next line
        log._file.write(b'{"task_id": "t", "episode_id": "half')
        log._file.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("torn", [False, True])
def test_log_survives_sigkill(tmp_path, torn):
    path = tmp_path / "log.jsonl"
    n = 7
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(n), "1" if torn else "0"],
                          capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    got = TrajectoryLog.read(path)
    assert [t.episode_id for t in got] == [str(i) for i in range(n)]
    with TrajectoryLog(path) as log:
        assert log.offset == n


# ----------------------------------------------------------------------------- collate
def short_trajectory(task_id="task-b") -> Trajectory:
    return Trajectory(task_id=task_id, episode_id="ep-2", prompt_ids=[11], segment=1,
                      turns=[Turn(action_ids=[24, 25], behaviour_logp=[-0.75, -3.0], policy_version=7, reward=-1.0)],
                      truncated=True)


def test_collate_hand_derived():
    a, b, c = hand_trajectory(), short_trajectory(), hand_trajectory(episode_id="ep-3")
    batch = collate([a, b, c], pad_id=0)
    assert isinstance(batch, RolloutBatch) and len(batch) == 3
    assert batch.input_ids.tolist()[:2] == [[11, 12, 13, 21, 22, EOS, 31, 32, 23, EOS], [11, 24, 25, 0, 0, 0, 0, 0, 0, 0]]
    assert batch.attention_mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert batch.position_ids[1].tolist() == [0, 1, 2, 0, 0, 0, 0, 0, 0, 0]
    assert batch.position_ids[0].tolist() == list(range(10))
    assert batch.action_mask.dtype == torch.bool
    assert batch.action_mask.int().tolist()[:2] == [[0, 0, 1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0, 0]]
    old = batch.old_logp
    assert old.shape == (3, 9) and old.dtype == torch.float32
    assert torch.isnan(old[~batch.action_mask]).all()
    assert old[0][batch.action_mask[0]].tolist() == [-0.5, -1.25, -0.125, -2.0, -0.0625]
    assert old[1][batch.action_mask[1]].tolist() == [-0.75, -3.0]
    assert batch.policy_version.tolist()[1] == [7, 7, -1, -1, -1, -1, -1, -1, -1]
    assert batch.turn_ids.tolist()[0] == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert batch.turn_rewards.tolist() == [[0.25, 1.0], [-1.0, 0.0], [0.25, 1.0]]
    assert batch.turn_mask.tolist() == [[True, True], [True, False], [True, True]]
    assert batch.turn_costs.tolist()[0] == [0.5, 0.0]
    assert batch.turn_potentials.tolist()[0] == [1.0, 0.0]
    assert batch.initial_potential.tolist() == [0.5, 0.0, 0.5]
    assert batch.rewards.tolist() == [1.25, -1.0, 1.25]
    assert batch.success.tolist() == [True, False, True]
    assert batch.terminated.tolist() == [True, False, True]
    assert batch.truncated.tolist() == [False, True, False]
    assert batch.segments.tolist() == [0, 1, 0]
    assert batch.group_ids.tolist() == [0, 1, 0]  # a and c share task-a
    assert batch.task_ids == ["task-a", "task-b", "task-a"]
    assert torch.equal(batch.targets, batch.input_ids[:, 1:])
    sub = batch.select([2, 1])
    assert sub.episode_ids == ["ep-3", "ep-2"] and torch.equal(sub.input_ids, batch.input_ids[[2, 1]])
    assert torch.equal(batch.to("cpu").input_ids, batch.input_ids)


def test_collate_pad_multiple_and_dtype():
    batch = collate([short_trajectory()], pad_id=5, dtype=torch.float64, pad_to_multiple_of=8)
    assert batch.input_ids.shape == (1, 8) and batch.input_ids[0, 3:].tolist() == [5] * 5
    assert batch.old_logp.dtype == torch.float64


@settings(max_examples=30, deadline=None)
@given(st.lists(traj_strategy, min_size=1, max_size=4))
def test_collate_rows_are_the_trajectories(trs):
    batch = collate(trs, pad_id=0)
    for b, tr in enumerate(trs):
        n = len(tr)
        assert batch.input_ids[b, :n].tolist() == tr.token_ids()
        assert batch.attention_mask[b].sum().item() == n
        assert batch.action_mask[b, : n - 1].int().tolist() == tr.action_mask()
        assert not batch.action_mask[b, n - 1:].any()
        assert batch.old_logp[b][batch.action_mask[b]].tolist() == pytest.approx(
            [x for t in tr.turns for x in t.behaviour_logp], abs=1e-5)


def test_collate_nan_in_masked_old_logp_never_reaches_a_loss():
    """The NaN that collate() puts in masked slots leaves loss and gradient finite and
    equal to a run with those slots cleaned (selection, not multiplication)."""
    from trajgrad.logprobs.ratios import token_log_ratio

    batch = collate([hand_trajectory(), short_trajectory()], pad_id=0, dtype=torch.float64)
    torch.manual_seed(0)
    logp = (-torch.rand(batch.old_logp.shape, dtype=torch.float64)).requires_grad_(True)

    def loss_of(old):
        ratio = token_log_ratio(logp, old, batch.action_mask).exp()
        return -(torch.where(batch.action_mask, ratio, torch.zeros_like(ratio))).sum() / batch.action_mask.sum()

    loss = loss_of(batch.old_logp)
    (g,) = torch.autograd.grad(loss, logp)
    clean = torch.where(batch.action_mask, batch.old_logp, torch.zeros_like(batch.old_logp))
    loss_clean = loss_of(clean)
    (g_clean,) = torch.autograd.grad(loss_clean, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert loss.item() == loss_clean.item() and torch.equal(g, g_clean)
    assert (g[~batch.action_mask] == 0).all() and (g[batch.action_mask] != 0).all()


def test_collate_bad_input():
    with pytest.raises(ValueError, match="trajectories"):
        collate([], pad_id=0)
    with pytest.raises(ValueError, match="trajectories"):
        collate([{"task_id": "x"}], pad_id=0)
    with pytest.raises(ValueError, match="trajectories"):
        collate([Trajectory(task_id="t", episode_id="e", prompt_ids=[1])], pad_id=0)
    with pytest.raises(ValueError, match="pad_id"):
        collate([hand_trajectory()], pad_id=-1)
    with pytest.raises(ValueError, match="dtype"):
        collate([hand_trajectory()], pad_id=0, dtype=torch.long)
    bad = hand_trajectory()
    bad.turns[0].info["cost"] = "expensive"
    with pytest.raises(ValueError, match="trajectories"):
        collate([bad], pad_id=0)


def test_position_ids_left_and_right_padding():
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert position_ids_from_attention_mask(am).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 0, 0], [0, 1, 2, 3, 4]]
    with pytest.raises(ValueError, match="attention_mask"):
        position_ids_from_attention_mask(am[0])
