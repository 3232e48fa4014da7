"""trajectories.jsonl: ``Trajectory.to_json`` (fields encoded in place) writes the bytes of
``json.dumps(to_dict(), default=_json_default)``, the formulation with a copy per trajectory."""
import json
import random

import numpy as np
import pytest

from trajgrad.rollout import Trajectory, TrajectoryLog, Turn
from trajgrad.rollout.trajectory import _json_default

TEXT = ["", "plain", "é ü ß", "中文 答案", "emoji 😀🚀", 'quote " and \\ backslash', "tab\tnl\ncr\r", "\u0000\u001f\u2028",
        "\ud83d"]  # a lone surrogate, escaped as \ud83d either way


def _old(t: Trajectory) -> str:
    return json.dumps(t.to_dict(), default=_json_default, separators=(",", ":"), ensure_ascii=True)


def _value(rng, depth=0, exotic=False):
    kinds = ["int", "float", "str", "bool", "none", "list", "dict", "tuple", "special"]
    if exotic:
        kinds += ["np", "set"]
    k = rng.choice(kinds if depth < 3 else kinds[:5])
    if k == "int":
        return rng.randint(-10 ** 20, 10 ** 20)
    if k == "float":
        return rng.uniform(-1e6, 1e6) * 10.0 ** rng.randint(-30, 30)
    if k == "special":
        return rng.choice([float("nan"), float("inf"), -float("inf"), -0.0, np.float64(0.1)])
    if k == "str":
        return rng.choice(TEXT)
    if k == "bool":
        return rng.random() < 0.5
    if k == "none":
        return None
    if k == "list":
        return [_value(rng, depth + 1, exotic) for _ in range(rng.randint(0, 4))]
    if k == "tuple":
        return tuple(_value(rng, depth + 1, exotic) for _ in range(rng.randint(0, 3)))
    if k == "np":
        return rng.choice([np.int64(7), np.float32(0.25), np.array([1, 2]), np.bool_(True)])
    if k == "set":
        return {rng.choice(TEXT) for _ in range(3)}
    return {rng.choice(TEXT) + str(i): _value(rng, depth + 1, exotic) for i in range(rng.randint(0, 4))}


def _trajectory(rng, exotic):
    turns = []
    for _ in range(rng.randint(1, 4)):
        n = rng.randint(1, 8)
        turns.append(Turn(action_ids=[rng.randint(0, 50000) for _ in range(n)],
                          observation_ids=[rng.randint(0, 50000) for _ in range(rng.randint(0, 6))],
                          behaviour_logp=[-rng.random() * 10 ** rng.uniform(-8, 2) for _ in range(n)],
                          policy_version=rng.randint(0, 9), reward=rng.uniform(-1, 1),
                          info={"success": rng.random() < 0.5, "text": rng.choice(TEXT), "x": _value(rng, 1, exotic)},
                          action_text=rng.choice(TEXT), cut=rng.random() < 0.3, gen_seconds=rng.random()))
    return Trajectory(task_id=rng.choice(TEXT) + "-task", episode_id="ep-" + rng.choice(TEXT),
                      prompt_ids=[rng.randint(0, 50000) for _ in range(rng.randint(1, 9))], turns=turns,
                      segment=rng.randint(0, 3), terminated=rng.random() < 0.5, truncated=rng.random() < 0.5,
                      sampling={"temperature": 1.0, "top_p": rng.choice([None, 0.9]), "model": rng.choice(TEXT)},
                      success=rng.choice([None, True, False]),
                      metadata={"group": rng.randint(0, 7), "v": _value(rng, 0, exotic), "nested": {"k": [1, 2.5]}})


@pytest.mark.parametrize("exotic", [False, True])
def test_to_json_equals_the_copying_formulation(exotic):
    rng = random.Random(int(exotic))
    for _ in range(300):
        t = _trajectory(rng, exotic)
        assert t.to_json() == _old(t)
        back = Trajectory.from_json(t.to_json())
        assert back.token_ids() == t.token_ids() and back.episode_id == t.episode_id


def test_to_json_falls_back_for_values_json_does_not_know():
    t = _trajectory(random.Random(3), False)
    t.metadata["np"] = np.int64(5)
    t.turns[0].info["s"] = {"only"}
    line = t.to_json()
    assert line == _old(t)
    assert json.loads(line)["metadata"]["np"] == 5 and json.loads(line)["turns"][0]["info"]["s"] == ["only"]
    t.metadata["bad"] = {(1, 2): 3}  # a key JSON cannot have: the same error as before
    with pytest.raises(TypeError):
        _old(t)
    with pytest.raises(TypeError):
        t.to_json()


def test_log_bytes_equal_the_copying_formulation(tmp_path):
    rng = random.Random(5)
    trajs = [_trajectory(rng, True) for _ in range(40)]
    with TrajectoryLog(tmp_path / "t.jsonl") as log:
        log.extend(trajs[:25])
        log.append(trajs[25])
        log.extend(trajs[26:])
    assert (tmp_path / "t.jsonl").read_bytes() == b"".join(_old(t).encode("ascii") + b"\n" for t in trajs)


@pytest.mark.parametrize("values", [[], [0], [1, 2, 3], list(range(300)), [5, -1, 2], [-7], [1, True], [False],
                                    [1, np.int64(4)], [2.0, 3], [1.5], [1, None], [3, "4"], (1, 2), [10 ** 30, 0]])
def test_check_int_list_equals_the_per_value_check(values):
    from trajgrad.rollout.trajectory import _check_int_list

    try:  # a tuple takes the per-value path
        want = _check_int_list("ids", tuple(values))
    except ValueError as exc:
        with pytest.raises(ValueError, match=str(exc).replace("(", r"\(").replace(")", r"\)")):
            _check_int_list("ids", values)
        return
    got = _check_int_list("ids", values)
    assert got == want and [type(x) for x in got] == [type(x) for x in want]
    assert got is not values
