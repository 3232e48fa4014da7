"""What an asynchronous learner's checkpoint keeps besides the weights (train/async_state.py):
the index set of trained episodes, episode keys, the file's round trip and checks, the re-run
plan, and an AsyncTrainer restoring a checkpoint's buffer (no Ray: the learner is built and
restored in-process; the Ray kill-and-resume runs are in test_async_resume.py)."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.envs.base import Task
from trajgrad.rollout import read_trajectories
from trajgrad.train.async_state import (
    ASYNC_STATE_FILE,
    AsyncState,
    InFlight,
    IndexSet,
    dump_async_state,
    episode_index,
    episode_key,
    load_async_state,
    plan_rerun,
)
from trajgrad.train.asynchronous import AsyncTrainer, GroupedRayTrainer
from trajgrad.train.config import build_config


# ============================================================================ pure parts
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=80))
def test_index_set_is_a_set_of_ranges(values):
    s = IndexSet()
    for v in values:
        s.add(v)
    assert len(s) == len(set(values))
    assert all((i in s) == (i in set(values)) for i in range(-1, 63))
    r = s.ranges()
    assert all(a < b for a, b in r) and all(r[k][1] < r[k + 1][0] for k in range(len(r) - 1))  # disjoint, not adjacent
    assert IndexSet(r).ranges() == r


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 6)), max_size=20))
def test_index_set_from_ranges_in_any_order(pairs):
    s = IndexSet([[a, a + n] for a, n in pairs])
    want = {i for a, n in pairs for i in range(a, a + n)}
    assert len(s) == len(want) and all((i in s) == (i in want) for i in range(60))
    r = s.ranges()
    assert all(r[k][1] < r[k + 1][0] for k in range(len(r) - 1))


def test_index_set_bad_input():
    for bad in ([[3, 3]], [[-1, 2]], [[1]], [["a", 2]]):
        with pytest.raises(ValueError, match="ranges"):
            IndexSet(bad)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="index"):
            IndexSet().add(bad)


def test_episode_keys_round_trip():
    assert episode_key(7) == "e7" and episode_key(7, "g") == "g7" and episode_key(7, "g", 2) == "g7#2"
    assert [episode_index(k) for k in ("e7", "g7", "g7#2")] == [7, 7, 7]
    for bad in ("x7", "e", "e-1", "7", None, "e7x"):
        with pytest.raises(ValueError, match="key"):
            episode_index(bad)
    with pytest.raises(ValueError, match="index"):
        episode_key(-1)


def test_plan_rerun_needs_the_same_task_at_the_data_position():
    tasks = {0: Task("t0", "train", "p", 1), 1: Task("t1", "train", "p", 1)}
    fl = [InFlight("e0", 0, 5, "t0"), InFlight("e1", 1, 6, "other")]
    rerun, lost = plan_rerun(fl, tasks.__getitem__)
    assert [(f.key, t.id) for f, t in rerun] == [("e0", "t0")] and [f.key for f in lost] == ["e1"]


# ============================================================================ an AsyncTrainer's restore (no Ray)
def _config(recipe="sao", **async_over):
    return build_config({
        "name": "async-state-test",
        "model": {"name": "tiny", "dtype": "float32", "lora": None, "tiny": {"hidden_size": 32, "layers": 1, "heads": 2}},
        "task": {"name": "guess", "n_train": 16, "n_heldout": 2, "options": {"upper": 8, "max_turns": 2, "few_shot": False}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 6},
        "recipe": {"name": recipe},
        "train": {"steps": 4, "prompts_per_step": 1, "micro_batch_size": 4, **({"group_size": 2} if recipe == "grpo" else {})},
        "critic": {"warmup_steps": 0}, "sft": {"steps": 0},
        "eval": {"before": False, "after": False, "every": 0},
        "checkpoint": {"every": 1}, "log": {"tensorboard": False, "progress": False},
        "asynchronous": {"enabled": True, "workers": 1, "max_lag": 1, "batch_trajectories": 2, "queue_size": 2,
                         **async_over},
    })


def _episode(at, index, version):
    """A real episode of the run's task at data position ``index``, sampled by ``version``."""
    tr = at.trainer
    tr.sampler.set_policy_version(version)
    return tr.sampler.rollout(tr.source, [tr.task_at(index)], group_size=1, seed=index)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A learner at policy version 3 whose checkpoint buffers e0 (sampled by version 0: lag 3)
    and e1, e2 (version 3), has e3 in flight and e4, e5 trained."""
    run_dir = tmp_path_factory.mktemp("state") / "run"
    at = AsyncTrainer(_config(), run_dir, console=lambda *a: None)
    tr = at.trainer
    tr.next_tasks(6)
    tr.policy_version = 3
    buffer = [("e0", _episode(at, 0, 0)), ("e1", _episode(at, 1, 3)), ("e2", _episode(at, 2, 3))]
    for key, raw in buffer:
        at._admit(key, raw, 0)
    at._rerun = [(InFlight("e3", 3, 33, tr.task_at(3).id), tr.task_at(3))]
    at._mark_trained(["e4", "e5"])
    with pytest.raises(RuntimeError, match="trained twice"):
        at._mark_trained(["e5"])
    at.counters["episodes_finished"] = 5
    path = at.save()
    return run_dir, path, buffer


def test_checkpoint_holds_the_buffer_in_flight_and_ledger(saved):
    run_dir, path, buffer = saved
    assert ASYNC_STATE_FILE in json.loads((path / "manifest.json").read_text())["files"]  # checksummed with the weights
    st = load_async_state(path)
    assert st.step == 0 and [k for k, _ in st.buffer] == ["e0", "e1", "e2"]
    assert [t.to_json() for _, raw in st.buffer for t in raw] == [t.to_json() for _, raw in buffer for t in raw]
    assert [(f.key, f.index, f.seed) for f in st.in_flight] == [("e3", 3, 33)]
    assert st.trained.ranges() == [[4, 6]] and st.counters["episodes_finished"] == 5
    assert st.gate["admitted"] == 3


def _copy(saved, tmp_path):
    """A copy of the saved run (each test resumes its own)."""
    import shutil

    shutil.copytree(saved[0], tmp_path / "run")
    return tmp_path / "run"


def test_resume_admits_the_buffer_drops_stale_and_reruns_in_flight(saved, tmp_path):
    _, _, buffer = saved
    run_dir = _copy(saved, tmp_path)
    at = AsyncTrainer(_config(), run_dir, resume=True, console=lambda *a: None)
    assert at.trainer.policy_version == 3
    # e0 was sampled by version 0: lag 3 > max_lag 1 against the restored version, dropped with its reason
    assert [i.key for i in at.gate.pending] == ["e1", "e2"]
    assert all(at.gate.lag(i, 3) <= 1 for i in at.gate.pending)
    assert at.counters["dropped_lag_on_resume"] == len(buffer[0][1]) and at.gate.dropped_lag_trajectories == len(buffer[0][1])
    assert at.gate.admitted == at.gate.trained + at.gate.dropped_lag + len(at.gate.pending)
    logged = read_trajectories(run_dir / "trajectories.jsonl")
    assert [(t.metadata["async"]["key"], t.metadata["async"]["status"], t.metadata["async"]["at_resume"],
             t.metadata["async"]["lag"]) for t in logged] == [("e0", "dropped_lag", True, 3)] * len(buffer[0][1])
    assert [(f.key, f.seed, task.id) for f, task in at._rerun] == [("e3", 33, at.trainer.task_at(3).id)]
    assert at.counters["rerun_on_resume"] == 1 and at.counters["lost_on_resume"] == 0
    assert at.counters["episodes_finished"] == 5  # restored, the buffer not counted twice
    with pytest.raises(RuntimeError, match="trained twice"):
        at._mark_trained(["e4"])
    # the next checkpoint keeps what is still pending and still to run
    st = load_async_state(at.save())
    assert [k for k, _ in st.buffer] == ["e1", "e2"] and [f.key for f in st.in_flight] == ["e3"]


def test_in_flight_episode_whose_task_changed_counts_as_lost(saved, tmp_path):
    path = saved[1]
    copy = _copy(saved, tmp_path)
    # the data order changes with task.seed: e3's position now holds another task
    cfg = _config()
    cfg.task.seed += 1
    at = AsyncTrainer(cfg, copy, resume=True, console=lambda *a: None)
    # the order is fixed by the seeds: the precondition holds, or the test must pick another task.seed
    assert at.trainer.task_at(3).id != load_async_state(path).in_flight[0].task_id
    assert at.counters["rerun_on_resume"] == 0 and at.counters["lost_on_resume"] == 1 and not at._rerun


def test_state_that_would_train_twice_is_refused(saved, tmp_path):
    run_dir, path, _ = saved
    st = load_async_state(path)
    st.trained.add(1)  # e1 is buffered
    with pytest.raises(ValueError, match="recorded as trained"):
        dump_async_state(st)
    data = json.loads((path / ASYNC_STATE_FILE).read_text())
    data["trained"] = [[1, 2]]
    (tmp_path / ASYNC_STATE_FILE).write_text(json.dumps(data))
    with pytest.raises(ValueError, match="recorded as trained"):
        load_async_state(tmp_path)
    (tmp_path / ASYNC_STATE_FILE).write_text(json.dumps({**data, "format": 99}))
    with pytest.raises(ValueError, match="async_state.json"):
        load_async_state(tmp_path)
    with pytest.raises(ValueError, match="twice"):
        AsyncState(step=0, buffer=[("e1", [])], in_flight=[InFlight("e1", 1, 0, "t")]).check()


def test_checkpoint_without_async_state_counts_its_in_flight_as_lost(tmp_path):
    """A checkpoint written before checkpoints held the state: the counters come from the
    run directory's async_state.json, whose in-flight episodes were not recorded (lost)."""
    run_dir = tmp_path / "run"
    at = AsyncTrainer(_config(), run_dir, console=lambda *a: None)
    at.trainer.save()
    (run_dir / ASYNC_STATE_FILE).write_text(json.dumps(
        {"step": 0, "counters": {"lost_episodes": 2, "episodes_finished": 9}, "gate": {"trained": 4}, "in_flight": 3}))
    lines = []
    at2 = AsyncTrainer(_config(), run_dir, resume=True, console=lines.append)
    assert at2.counters["lost_on_resume"] == 3 and at2.counters["episodes_finished"] == 9
    assert at2.gate.trained == 4 and at2.counters["rerun_on_resume"] == 0
    assert any("3 episode(s) in flight then are lost" in ln for ln in lines)
    assert math.isfinite(at2.counters["lost_episodes"])


def test_grouped_resume_restores_counters_and_ledger(tmp_path):
    """The grouped baseline checkpoints behind its barrier: counters and the trained groups."""
    gt = GroupedRayTrainer(_config("grpo", enabled=False), tmp_path / "g", console=lambda *a: None)
    gt.counters.update({"incomplete_groups": 1, "group_wait_W": 0.5, "rollouts": 6, "lost_episodes": 1})
    gt._mark_trained(["g0", "g1"])
    gt.trainer.snapshot_reference()  # as the preamble does before the first checkpoint
    st = load_async_state(gt.save())
    assert st.buffer == [] and st.in_flight == [] and st.trained.ranges() == [[0, 2]]
    gt2 = GroupedRayTrainer(_config("grpo", enabled=False), tmp_path / "g", resume=True, console=lambda *a: None)
    assert {k: gt2.counters[k] for k in ("incomplete_groups", "group_wait_W", "rollouts", "lost_episodes")} == \
        {"incomplete_groups": 1, "group_wait_W": 0.5, "rollouts": 6, "lost_episodes": 1}
    with pytest.raises(RuntimeError, match="trained twice"):
        gt2._mark_trained(["g2", "g1"])
