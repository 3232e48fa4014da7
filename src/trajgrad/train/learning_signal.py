r"""Whether a batch of episodes carries a learning signal for the recipe.

The test is the recipe's own:

* group recipes (``group_size > 1`` without a critic: GRPO, RLOO, DAPO, ...): a group whose
  rewards are all equal has advantages exactly 0 (no relative signal, §11), so a batch
  whose every group is such a group gives no policy gradient;
* single-rollout and critic recipes (``group_size == 1``, PPO, SAO): the reward variance over
  the batch (all equal rewards: nothing tells one episode from another);
* distillation and preference recipes take no reward signal: no test.

:func:`signal_facts` measures it on trajectories (the trainer every step, ``trajgrad doctor``
once, on the base policy); :class:`NoSignalWatch` counts consecutive steps without it,
warns after ``train.no_signal_steps`` and, with ``train.stop_on_no_signal``, ends the run.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from ..objective import Objective


def signal_kind(obj: Objective) -> Optional[str]:
    """``"group"``, ``"batch"`` or None (a recipe without a reward signal)."""
    if obj.kind != "token":
        return None
    return "group" if obj.group_size > 1 and not obj.critic else "batch"


def episode_rewards(trajs: Sequence) -> Dict[str, List[float]]:
    """Task id -> the total reward of each of its episodes (first sub-trace of each)."""
    groups: Dict[str, List[float]] = {}
    for t in trajs:
        if getattr(t, "segment", 0) == 0:
            groups.setdefault(t.task_id, []).append(float(t.metadata.get("episode_reward", t.total_reward)))
    return groups


def signal_facts(obj: Objective, trajs: Sequence) -> Dict[str, float]:
    """``signal/present`` (1.0 or 0.0) and what it was decided on: ``signal/zero_variance_groups``
    and ``signal/groups`` (group recipes) or ``signal/reward_var`` (population variance of the
    episode rewards); ``{}`` for a recipe without a reward signal."""
    kind = signal_kind(obj)
    if kind is None:
        return {}
    groups = episode_rewards(trajs)
    if kind == "group":
        zero = sum(1 for g in groups.values() if max(g) == min(g))
        return {"signal/present": float(zero < len(groups)), "signal/zero_variance_groups": float(zero),
                "signal/groups": float(len(groups))}
    rewards = [r for g in groups.values() for r in g]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards) if rewards else 0.0
    return {"signal/present": float(var > 0), "signal/reward_var": var}


def describe(metrics: Dict[str, float], obj: Objective) -> str:
    """What the last step measured, in words."""
    if "signal/groups" in metrics:
        return (f"{metrics['signal/zero_variance_groups']:.0f} of {metrics['signal/groups']:.0f} groups of "
                f"{obj.group_size} had equal rewards (their advantages are 0)")
    if "signal/reward_var" in metrics:
        return f"every episode of the batch had the same reward (variance {metrics['signal/reward_var']:.3g})"
    return "no episodes were trained"


class NoSignalWatch:
    """Consecutive steps without a learning signal (``train.no_signal_steps``, ``train.stop_on_no_signal``).

    :meth:`update` adds ``signal/no_signal_run`` (the current streak) and
    ``signal/no_signal_warning`` (1.0 once the streak reaches ``steps``) to a step's metrics
    and returns the warning the step that reaches it prints (else None).
    """

    def __init__(self, obj: Objective, steps: int = 3, stop: bool = False) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"train.no_signal_steps: must be an integer >= 1, got {steps!r}")
        self.obj, self.steps, self.stop, self.run = obj, steps, bool(stop), 0

    def update(self, metrics: Dict[str, float]) -> Optional[str]:
        present = metrics.get("signal/present")
        if present is None:
            return None
        self.run = 0 if present else self.run + 1
        metrics["signal/no_signal_run"] = float(self.run)
        metrics["signal/no_signal_warning"] = float(self.run >= self.steps)
        if self.run != self.steps:
            return None
        what = "ending the run (train.stop_on_no_signal)" if self.stop else \
            "set train.stop_on_no_signal: true to end such a run"
        return (f"warning: no learning signal for {self.run} consecutive steps: {describe(metrics, self.obj)}, so "
                f"recipe {self.obj.name!r} makes no policy gradient from them; `trajgrad doctor` measures why and "
                f"what to change; {what}")
