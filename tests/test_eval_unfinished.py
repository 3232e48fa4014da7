"""An external agent's held-out episode that ends without a reward is a failure of its task:
counted in ``n`` and ``unfinished``, and the outcomes stay paired with the held-out tasks."""
from __future__ import annotations

from types import SimpleNamespace

from trajgrad.train.evaluation import _by_task, _result, format_eval


def _traj(task_id, success, reward):
    return SimpleNamespace(task_id=task_id, success=success, total_reward=reward)


def test_unfinished_episodes_are_failures_in_task_order():
    tasks = [SimpleNamespace(id=f"t{i}") for i in range(5)]
    # the agent ended t3, t0 and t4 (in that order); t1 and t2 never ended
    done = _by_task(tasks, [_traj("t3", True, 1.0), _traj("t0", False, 0.5), _traj("t4", True, 1.0)])
    assert [None if t is None else t.task_id for t in done] == ["t0", None, None, "t3", "t4"]
    res = _result(done)
    assert (res.n, res.successes, res.unfinished) == (5, 2, 2)
    assert res.outcomes == (0, 0, 0, 1, 1)
    assert abs(res.reward - 2.5 / 5) < 1e-12
    assert "2 of the 5 episodes ended without a reward (counted as failures)" in format_eval("after", res)
    assert res.to_dict()["unfinished"] == 2


def test_finished_runs_keep_their_summary():
    res = _result([_traj("a", True, 1.0), _traj("b", False, 0.0)])
    assert res.unfinished == 0 and "unfinished" not in res.to_dict() and "ended without" not in format_eval("x", res)
