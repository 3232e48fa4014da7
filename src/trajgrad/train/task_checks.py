"""Load-time checks of a built task source: what the run will ask of it, asked now.

* Demonstrations: the SFT warm start (``sft.steps > 0``) and DPO's offline pairs call
  ``source.demonstration(task)``; a source without demonstrations (a gymnasium
  environment, a dataset without an answer column) is refused here, before any model is
  built or evaluated and before a run directory exists. With ``rollout.backend: proxy`` the
  source must also give the agent's first request (``first_request(task)``,
  :mod:`trajgrad.serve.demonstrations`), which the demonstration continues.
* Held-out tasks: more asked for than are distinct (:mod:`trajgrad.train.heldout`) is
  refused under ``eval.distinct: refuse``.

Each returns ``[(dotted key, message)]``; :func:`trajgrad.train.config_checks.check_config`
reports them with the config's other errors.
"""
from __future__ import annotations

from typing import Any, List, Tuple

from ..serve.demonstrations import first_request
from .heldout import distinct_tasks, heldout_key, heldout_problem

__all__ = ["check_demonstrations", "check_heldout"]


def check_demonstrations(cfg, source: Any) -> List[Tuple[str, str]]:
    try:
        pairwise = cfg.objective().kind == "pairwise"
    except ValueError:  # a bad recipe is reported by the recipe checks
        pairwise = False
    if cfg.sft.steps == 0 and not pairwise:
        return []
    key, why = ("sft.steps", f"{cfg.sft.steps} SFT steps train on demonstrations") if cfg.sft.steps else \
        ("recipe.name", "DPO pairs each task's demonstration with a failed sample")
    if not callable(getattr(source, "demonstration", None)):
        return [(key, f"{why}; task {cfg.task.name!r} has none (its source has no demonstration()); set sft.steps: 0")]
    tasks = source.tasks("train", 1, cfg.task.seed)
    try:
        if tasks:
            source.demonstration(tasks[0])
            if cfg.rollout.backend == "proxy":
                first_request(source, tasks[0])
    except ValueError as exc:
        msg = str(exc).split(": ", 1)[-1] if str(exc).startswith(("sft.steps:", "demonstration:")) else str(exc)
        return [(key, f"{why}; task {cfg.task.name!r}: {msg}")]
    return []


def check_heldout(cfg, source: Any) -> List[Tuple[str, str]]:
    key, asked = heldout_key(cfg)
    tasks = source.tasks("heldout", asked, cfg.task.seed)
    problem = heldout_problem(cfg, asked, len(distinct_tasks(source, tasks, render=cfg.rollout.backend != "proxy")))
    return [] if problem is None else [(key, problem)]
