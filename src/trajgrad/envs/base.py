r"""The contract between environments and the rollout collector.

An episode is a conversation. :meth:`Environment.reset` returns the initial messages
(system prompt, optional few-shot turns, the user question); the policy writes one
assistant turn (``action_text``, decoded without the end-of-turn token); then
:meth:`Environment.step` judges it and returns the messages to append (usually one user
turn carrying the tool result, i.e. the observation, which the collector masks out of
the loss, §4), a reward, and the ``terminated`` / ``truncated`` flags.

Chat format shared with ``rollout/`` (ChatML, as in SmolLM2)::

    <|im_start|>{role}\n{content}<|im_end|>\n          one message
    <|im_start|>assistant\n                            the generation prompt

An assistant action ends with the ``<|im_end|>`` token (its EOS).

``StepResult.info`` keys read by the trainer when present:

* ``"success"`` (bool): set on the last step of an episode.
* ``"cost"`` (float): the constraint cost of this step, :math:`C` in §22.
* ``"potential"`` (float): :math:`\Phi(s_{t+1})` of the new state, §21; the trainer
  shapes rewards with ``trajgrad.advantages.shape_rewards`` (the environment never adds
  the shaping term to ``reward`` itself).
* ``"tool"`` (str) and ``"tool_error"`` (str or None): the tool called at this step.
* ``"compact"`` (str): a summary of the state; the collector starts a new sub-trace
  whose context is this summary (compaction-aware sub-traces, §19).

Task sources register under a name with :func:`register_task_source` and are built with
:func:`get_task_source`. A name of the form ``"package.module:factory"`` is imported
instead (:func:`resolve_import`); the factory, called with the task's options, returns a
task source, or an environment of another library that an adapter of
:mod:`trajgrad.envs.adapters` wraps (gymnasium, ``verifiers``, OpenEnv).
"""
from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Dict, List, Optional

from .adapters import as_task_source
from .task import Environment, Message, StepResult, Task, TaskError, TaskSource

__all__ = [
    "Message",
    "Task",
    "StepResult",
    "TaskError",
    "Environment",
    "TaskSource",
    "register_task_source",
    "get_task_source",
    "available_task_sources",
    "registered_task_source",
    "extract_tag",
    "resolve_import",
]

_REGISTRY: Dict[str, Callable[..., TaskSource]] = {}
# Built-in sources, imported on first lookup so that importing ``base`` stays light.
_BUILTIN_MODULES: Dict[str, str] = {
    "calculator": "trajgrad.envs.calculator",
    "guess": "trajgrad.envs.guess",
    "chain": "trajgrad.envs.chain",
    "higher_lower": "trajgrad.envs.games",
    "dataset": "trajgrad.envs.dataset",
    "openenv": "trajgrad.envs.adapters.openenv",
}
_IMPORT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def resolve_import(spec: str, *, key: str = "name") -> Any:
    """The object named by ``"package.module:attribute"`` (the attribute may be dotted).

    Raises ``ValueError`` starting with ``key`` for a malformed string, a module that cannot
    be imported (with the import error) or a missing attribute.
    """
    if not isinstance(spec, str) or not _IMPORT.match(spec.strip()):
        raise ValueError(f"{key}: expected an import string 'package.module:attribute', got {spec!r}")
    module_name, _, attr = spec.strip().partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{key}: cannot import module {module_name!r} of {spec!r} "
                         f"({type(exc).__name__}: {exc})") from None
    except Exception as exc:
        raise ValueError(f"{key}: importing module {module_name!r} of {spec!r} failed "
                         f"({type(exc).__name__}: {exc})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: module {module_name!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    return obj


def register_task_source(name: str) -> Callable[[Callable[..., TaskSource]], Callable[..., TaskSource]]:
    """Class decorator: register a task source factory under ``name``.

    Usage::

        @register_task_source("calculator")
        class CalculatorSource: ...

    The decorated callable is called with the keyword arguments of
    :func:`get_task_source`. Registering a second, different factory under the same
    name raises ``ValueError``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")

    def decorator(factory: Callable[..., TaskSource]) -> Callable[..., TaskSource]:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not factory and (
            getattr(existing, "__qualname__", None) != getattr(factory, "__qualname__", None)
            or getattr(existing, "__module__", None) != getattr(factory, "__module__", None)
        ):
            raise ValueError(f"name: a task source named {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorator


def _load_builtin(name: str) -> None:
    module = _BUILTIN_MODULES.get(name)
    if module is not None and name not in _REGISTRY:
        importlib.import_module(module)


def available_task_sources() -> List[str]:
    """Names accepted by :func:`get_task_source` (built-ins included)."""
    for builtin in _BUILTIN_MODULES:
        try:
            _load_builtin(builtin)
        except ImportError:  # pragma: no cover - a built-in that fails to import
            pass
    return sorted(_REGISTRY)


def registered_task_source(name: str) -> Optional[Callable[..., TaskSource]]:
    """The factory registered under ``name``, or None (a built-in not yet looked up is not loaded:
    :func:`available_task_sources` and :func:`get_task_source` load them)."""
    return _REGISTRY.get(name)


def get_task_source(name: str, **kwargs) -> TaskSource:
    """Build the task source registered under ``name`` (``"calculator"``, ``"guess"``, ...),
    or made by the factory ``name = "package.module:factory"``.

    Keyword arguments go to the source's constructor (e.g. ``ops_per_call=1``) and, for
    the built-ins, become the defaults of the environments made by ``make_env``. For an
    import string they go to the factory, except ``adapter`` (a dict of the adapter's own
    options such as ``max_turns``, used when the factory returns another library's
    environment; see :func:`trajgrad.envs.adapters.as_task_source`).
    """
    if not isinstance(name, str):
        raise ValueError(f"name: expected a string, got {type(name).__name__}")
    if ":" in name:
        adapter = kwargs.pop("adapter", None) or {}
        if not isinstance(adapter, dict):
            raise ValueError(f"adapter: expected a mapping of adapter options, got {adapter!r}")
        factory = resolve_import(name)
        if not callable(factory):
            raise ValueError(f"name: {name!r} is a {type(factory).__name__}, not a callable factory")
        return as_task_source(factory(**kwargs), remake=lambda: factory(**kwargs), **adapter)
    _load_builtin(name)
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"name: unknown task source {name!r}; available: {available_task_sources()}")
    return factory(**kwargs)


def extract_tag(text: str, tag: str) -> Optional[str]:
    """The stripped content of the first ``<tag>...</tag>`` in ``text``, or None.

    Matching is case-sensitive and non-greedy; an unclosed tag gives None.
    """
    match = re.search(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return None if match is None else match.group(1).strip()
