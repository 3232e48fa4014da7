"""Held-out tasks counted by what the model is shown: distinct prompts after rendering.

A task source draws ``n`` held-out tasks; a small dataset cycles through its rows to give
``n`` (and rows may repeat a prompt), so ``n`` tasks can hold far fewer distinct ones. A
success rate and its Wilson interval over repeated items overstate what was measured:
evaluation runs each distinct task once, and the count is always reported.

Two tasks are the same when their *rendering* and their ``answer`` are. The rendering is
the conversation the environment starts with (``source.make_env().reset(task)``: system
prompt, few-shot turns, the question); for a source without ``make_env`` (a proxy agent's
task list) it is the task's ``prompt`` (its id when the prompt is empty), and for a source
whose ``reset`` runs on a server (``renders_remotely``, e.g. OpenEnv) its id, i.e. its seed.
The answer keeps apart tasks that show the same question about different hidden values
(``guess``: the number to find).

When more held-out tasks are asked for (``eval.n``, else ``task.n_heldout``) than are
distinct, ``eval.distinct`` decides: ``refuse`` (the default) raises at config load with
the distinct count; ``warn`` evaluates the distinct ones and prints how many.
"""
from __future__ import annotations

import json
from typing import Any, List, Optional, Sequence, Tuple

__all__ = ["distinct_tasks", "heldout_key", "heldout_problem", "select_heldout"]


def _renderer(source: Any, render: bool):
    if render and not getattr(source, "renders_remotely", False) and callable(getattr(source, "make_env", None)):
        env = source.make_env()

        def render(task) -> str:
            try:
                return json.dumps([env.reset(task), task.answer], sort_keys=True, default=str)
            finally:  # an episode begun only to be read: end it (an MCP tool's server, say)
                if callable(getattr(env, "close", None)):
                    env.close()
        return render
    return lambda task: json.dumps([task.prompt or task.id, task.answer], sort_keys=True, default=str)


def distinct_tasks(source: Any, tasks: Sequence[Any], *, render: bool = True) -> List[Any]:
    """The first task of each distinct rendering, in order (see the module docstring)."""
    key = _renderer(source, render)
    seen, out = set(), []
    for t in tasks:
        k = key(t)
        if k not in seen:
            seen.add(k)
            out.append(t)
    return out


def heldout_key(cfg) -> Tuple[str, int]:
    """(the dotted key that sets the held-out count, the count)."""
    return ("eval.n", cfg.eval.n) if cfg.eval.n else ("task.n_heldout", cfg.task.n_heldout)


def heldout_problem(cfg, asked: int, distinct: int) -> Optional[str]:
    """The refusal of ``eval.distinct: refuse`` when ``asked > distinct`` and the run evaluates
    (``eval.before``, ``eval.after`` or ``eval.every``), else None."""
    evaluates = cfg.eval.before or cfg.eval.after or cfg.eval.every > 0
    if distinct >= asked or cfg.eval.distinct != "refuse" or not evaluates:
        return None
    many = f"{distinct} distinct held-out task" + ("s" if distinct != 1 else "")
    return (f"asks for {asked} held-out tasks; task {cfg.task.name!r} has {many} (prompt and answer after "
            f"rendering): set it to {distinct}, or eval.distinct: warn to evaluate the {many}")


def select_heldout(cfg, source: Any, tasks: Sequence[Any]) -> Tuple[List[Any], str]:
    """(the distinct held-out tasks to evaluate, the line that reports their count)."""
    key, asked = heldout_key(cfg)
    out = distinct_tasks(source, tasks, render=cfg.rollout.backend != "proxy")
    problem = heldout_problem(cfg, asked, len(out))
    if problem is not None:  # config_checks refuses this at load; a source that changed since
        raise ValueError(f"{key}: {problem}")
    if len(out) < asked:
        return out, (f"held-out: {len(out)} distinct tasks of the {asked} asked for ({key}); evaluating the "
                     f"{len(out)} distinct ones (eval.distinct: warn)")
    return out, f"held-out: {len(out)} distinct tasks ({key})"
