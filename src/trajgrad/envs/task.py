r"""The types of the environment contract: :class:`Task`, :class:`StepResult`, the
:class:`Environment` and :class:`TaskSource` protocols, ``Message`` and :class:`TaskError`.

:mod:`trajgrad.envs.base` documents the contract (the episode, the chat format, the
``StepResult.info`` keys) and holds the registry of task sources; it re-exports these names.
They live here, below both the registry and the adapters of :mod:`trajgrad.envs.adapters`
that produce them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, NamedTuple, Protocol, runtime_checkable

__all__ = ["Message", "Task", "StepResult", "TaskError", "Environment", "TaskSource"]

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


class TaskError(RuntimeError):
    """A user's task code (e.g. a reward function) failed during a run. The message is one
    line naming the code and the task; ``trajgrad train`` prints it without a traceback."""


@dataclass(frozen=True)
class Task:
    """One problem instance.

    Attributes:
      id: unique identifier, e.g. ``"calc-train-000123"``.
      split: ``"train"`` or ``"heldout"``.
      prompt: the user question.
      answer: the ground truth the verifier compares against.
      metadata: anything else the environment needs (operands, hidden value, ...).
    """

    id: str
    split: str
    prompt: str
    answer: Any
    metadata: dict = field(default_factory=dict)


class StepResult(NamedTuple):
    """What :meth:`Environment.step` returns.

    Attributes:
      messages: messages to append after the assistant action (e.g. one user turn with
        a tool result); ``[]`` when the episode is over.
      reward: the reward of this step.
      terminated: true termination (the answer was given or the task was solved).
      truncated: cut by the turn limit or the collector; the episode could validly have
        continued.
      info: see the module docstring for the keys the trainer reads.
    """

    messages: List[Message]
    reward: float
    terminated: bool
    truncated: bool
    info: dict


@runtime_checkable
class Environment(Protocol):
    """A multi-turn text environment (one instance per concurrent episode).

    An optional ``close()`` method is called once by the rollout collector when the episode
    ends (or the rollout fails): :class:`~trajgrad.envs.toolenv.ToolEnv` stops its episode's
    MCP servers there.
    """

    name: str
    max_turns: int

    def reset(self, task: Task) -> List[Message]:
        """The initial conversation: system prompt, few-shot turns, user question."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Judge one decoded assistant reply (without the end-of-turn token)."""
        ...

    def potential(self) -> float:
        r"""\Phi of the current state (§21); 0.0 if the environment defines no shaping."""
        ...


@runtime_checkable
class TaskSource(Protocol):
    """A named family of tasks, with its environment and demonstrations."""

    name: str

    def tasks(self, split: str, n: int, seed: int) -> List[Task]:
        """``n`` tasks of ``split``; deterministic in ``seed``; splits never overlap."""
        ...

    def make_env(self, **kwargs) -> Environment:
        """A fresh environment instance (one per concurrent episode)."""
        ...

    def demonstration(self, task: Task) -> List[Message]:
        """A correct exchange (assistant turns and tool-result user turns) for SFT."""
        ...
