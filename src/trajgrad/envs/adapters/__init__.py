"""Environments written for other libraries, as trajgrad task sources (unchanged).

* :mod:`.gym` - a ``gymnasium.Env`` with text observations and text actions.
* :mod:`.verifiers` - a ``verifiers`` environment (``load_environment``'s ``Env``, or a
  ``Taskset``): its tasks' prompts, scored by its rubric (the tasks' ``@vf.reward`` functions).
* :mod:`.openenv` - an OpenEnv environment served over HTTP (a WebSocket session per episode).

:func:`as_task_source` picks the adapter for an object a ``task.name`` factory returned (an
object with ``tasks(split, n, seed)`` alone is a task list: enough for ``rollout.backend:
proxy``, where the agent is the environment);
each adapter module imports its library only when used (its functions import it).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from .gym import GymSource
from .verifiers import VerifiersSource

__all__ = ["as_task_source", "is_task_source"]


def is_task_source(obj: Any) -> bool:
    """Whether ``obj`` is a trajgrad task source as it is: it has callable ``tasks`` and ``make_env``
    (:class:`~trajgrad.envs.base.TaskSource`; :func:`as_task_source` returns such an object unchanged)."""
    return all(callable(getattr(obj, a, None)) for a in ("tasks", "make_env"))


def _module_root(obj: Any) -> str:
    return (type(obj).__module__ or "").split(".")[0]


def _has_base(obj: Any, module: str, name: str) -> bool:
    return any(c.__name__ == name and (c.__module__ or "").startswith(module) for c in type(obj).__mro__)


def as_task_source(obj: Any, *, remake: Optional[Callable[[], Any]] = None, **options: Any):
    """A task source for ``obj``: a trajgrad task source as is, else the adapter's.

    Args:
      obj: what a ``task.name`` factory returned.
      remake: calls the factory again (the gymnasium adapter makes one environment per
        concurrent episode with it).
      **options: the adapter's options (``task.options.adapter``), e.g. ``max_turns``.

    Raises:
      ValueError: starting with ``name:`` when nothing can adapt ``obj``.
    """
    if is_task_source(obj):
        if options:
            raise ValueError(f"adapter: {type(obj).__name__} is a task source; adapter options "
                             f"{sorted(options)} have no effect")
        return obj
    if _has_base(obj, "gymnasium", "Env"):
        return GymSource(remake if remake is not None else (lambda: obj), first=obj, **options)
    if _has_base(obj, "verifiers", "Env") or _has_base(obj, "verifiers", "Taskset"):
        return VerifiersSource(obj, **options)
    if callable(getattr(obj, "tasks", None)):  # tasks only: enough where the agent is the environment (proxy)
        if options:
            raise ValueError(f"adapter: {type(obj).__name__} is a task list; adapter options {sorted(options)} "
                             "have no effect")
        return obj
    raise ValueError(f"name: the factory returned a {type(obj).__name__} (module {type(obj).__module__}); "
                     "expected a task source (with tasks(), and make_env() unless rollout.backend is 'proxy'), "
                     "a gymnasium.Env, a verifiers Env or Taskset")
