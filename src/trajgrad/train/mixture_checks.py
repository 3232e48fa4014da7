"""Load-time rules of a config with several environments (``tasks:``; :mod:`trajgrad.train.mixture`).

Called by :func:`trajgrad.train.config_checks.check_config` after each ``tasks[i]`` has been
checked as a ``task:`` would be. Every error names its dotted key (``tasks[1].name``,
``tasks[0].advantage.std_eps``, ``train.prompts_per_step``).
"""
from __future__ import annotations

from typing import Callable

from .mixture import environment_objective

__all__ = ["check_mixture"]


def check_mixture(cfg, obj, add: Callable[[str, str], None]) -> None:
    """Names unique, enough prompts for every environment, each environment's objective valid,
    and the modes a run with several environments does not run refused (``obj``: the run's
    objective, None when the recipe itself is invalid)."""
    tasks = cfg.tasks
    seen = {}
    for i, e in enumerate(tasks):
        if e.name in seen:
            add(f"tasks[{i}].name", f"{e.name!r} is also the name of tasks[{seen[e.name]}]; names must be unique")
        seen.setdefault(e.name, i)
        if e.shaping:
            add(f"tasks[{i}].shaping", "potential shaping is not supported with several environments")
    P = cfg.train.prompts_per_step
    if P < len(tasks):
        add("train.prompts_per_step", f"is {P}, fewer than the {len(tasks)} environments of tasks; every environment "
            "needs at least one prompt per step")
    if cfg.asynchronous.enabled:
        add("asynchronous.enabled", "several environments (tasks) run in the synchronous trainer only")
    if cfg.rollout.backend == "proxy":
        add("rollout.backend", "'proxy' runs one agent on one task; several environments (tasks) need 'hf' or 'openai'")
    if cfg.sft.steps > 0:
        add("sft.steps", "the SFT warm start takes the demonstrations of one task and is not supported with "
            "several environments (tasks); set sft.steps: 0")
    if obj is None:
        return
    if obj.critic or obj.kind == "pairwise":
        add("recipe.name", f"{obj.name!r} ({'a critic' if obj.critic else 'preference pairs'}) is not supported with "
            "several environments (tasks); use a group-baseline, REINFORCE or distillation recipe")
        return
    for i, e in enumerate(tasks):
        try:
            environment_objective(obj, e.group_size, e.advantage)
        except (ValueError, TypeError) as exc:
            head, sep, rest = str(exc).partition(":")
            head = head.strip() if sep else ""
            if head in e.advantage:
                key = f"tasks[{i}].advantage.{head}"
            elif head == "group_size":
                key = f"tasks[{i}].group_size"
            else:
                key, rest = (f"tasks[{i}].advantage", rest) if head else (f"tasks[{i}]", str(exc))
            add(key, " ".join(rest.split()))
