r"""Task source ``"guess"``: find a hidden integer in ``[1, N]`` from higher/lower replies.

Each assistant turn writes ``<guess>K</guess>``; the environment answers with a user
turn ``higher`` (the number is greater than K) or ``lower``, or ends the episode on the
correct guess. A malformed or out-of-range guess gets an ``error: ...`` observation and
costs a turn. ``N`` defaults to 32 and ``max_turns`` to 6, exactly what binary search
needs in the worst case (:math:`\lfloor\log_2 32\rfloor + 1 = 6`).

Reward: ``1.0`` on the correct guess (``terminated``), minus ``turn_cost`` (default 0)
on every turn. Running out of turns truncates the episode.

Potential (§21): with :math:`[lo, hi]` the interval still consistent with the replies,

.. math::
    \Phi(s) = -\frac{\log_2(hi - lo + 1)}{\log_2 N}\ \in [-1, 0],

so :math:`\Phi(s_0) = -1` and :math:`\Phi = 0` once one candidate is left (and in the
terminal state). Each informative reply raises it; with shaping through
``trajgrad.advantages.shape_rewards`` the per-turn bonus rewards halving the interval,
and the telescoping sum keeps the optimal policy unchanged.

Compaction (§19): with ``compact_every=k``, every ``k``-th turn of an unfinished
episode carries ``info["compact"]``, a one-line summary of the whole information state
(the consistent interval and the number of guesses so far, the reply of that turn
included). The collector closes the current sub-trace there and starts a new one whose
context carries the summary instead of the transcript (trajgrad's sampler uses the
system prompt, a user turn with the summary, then that step's observation;
:meth:`GuessEnv.compacted_messages` offers a fuller context: system prompt, example,
question and summary). The environment state is unchanged by compaction. The interval
is a sufficient statistic here, so a critic conditioned on the compacted state sees
everything that matters.

Splits: the hidden values are partitioned by a hash of ``(N, value)``: a fixed
``heldout_fraction`` of the values (at least one) is heldout, the rest train, so the
two splits never share a hidden value.
"""
from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional

from .base import Message, StepResult, Task, extract_tag, register_task_source

__all__ = ["GuessConfig", "GuessEnv", "GuessSource"]

_SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class GuessConfig:
    """Options of the guessing tasks (keyword arguments of ``get_task_source("guess", ...)``).

    Attributes:
      upper: ``N``, the hidden number is in ``[1, N]`` (N >= 2).
      max_turns: guesses before truncation.
      turn_cost: subtracted from the reward of every turn.
      compact_every: ``None``, or emit ``info["compact"]`` every this many turns.
      few_shot: include a one-shot example in ``reset``.
      heldout_fraction: fraction of the hidden values reserved for ``heldout``.
    """

    upper: int = 32
    max_turns: int = 6
    turn_cost: float = 0.0
    compact_every: Optional[int] = None
    few_shot: bool = True
    heldout_fraction: float = 0.2

    def __post_init__(self) -> None:
        if not (isinstance(self.upper, int) and 2 <= self.upper <= 10**9):
            raise ValueError(f"upper: expected an integer in [2, 10**9], got {self.upper!r}")
        if not (isinstance(self.max_turns, int) and self.max_turns >= 1):
            raise ValueError(f"max_turns: expected an integer >= 1, got {self.max_turns!r}")
        if not isinstance(self.turn_cost, (int, float)) or not math.isfinite(self.turn_cost) or self.turn_cost < 0:
            raise ValueError(f"turn_cost: expected a finite number >= 0, got {self.turn_cost!r}")
        if self.compact_every is not None and not (isinstance(self.compact_every, int) and self.compact_every >= 1):
            raise ValueError(f"compact_every: expected None or an integer >= 1, got {self.compact_every!r}")
        if not 0.0 < float(self.heldout_fraction) < 1.0:
            raise ValueError(f"heldout_fraction: expected a number in (0, 1), got {self.heldout_fraction}")


def _split_values(upper: int, heldout_fraction: float) -> Dict[str, List[int]]:
    """Partition ``1..upper`` by hash rank: the first ``ceil(f * upper)`` are heldout."""
    if upper > 100_000:
        # Large ranges: a per-value hash threshold (no sorting of the whole range).
        raise ValueError(f"upper: splits are enumerated; use upper <= 100000, got {upper}")
    ranked = sorted(range(1, upper + 1), key=lambda v: hashlib.sha256(f"guess|{upper}|{v}".encode()).digest())
    k = min(upper - 1, max(1, math.ceil(heldout_fraction * upper)))
    return {"heldout": sorted(ranked[:k]), "train": sorted(ranked[k:])}


def _system_prompt(upper: int) -> str:
    return (
        f"You play a guessing game. A secret integer between 1 and {upper} is chosen. Each turn, write your "
        "guess as <guess>K</guess> and nothing else. The reply is 'higher' if the secret is greater than K, "
        "'lower' if it is smaller. Find it in as few guesses as possible."
    )


def _question(upper: int) -> str:
    return f"I am thinking of an integer between 1 and {upper}. Guess it."


def _binary_search(upper: int, target: int) -> List[int]:
    lo, hi, guesses = 1, upper, []
    while True:
        k = (lo + hi) // 2
        guesses.append(k)
        if k == target:
            return guesses
        if target > k:
            lo = k + 1
        else:
            hi = k - 1


def _exchange(upper: int, target: int) -> List[Message]:
    messages: List[Message] = []
    for k in _binary_search(upper, target):
        messages.append({"role": "assistant", "content": f"<guess>{k}</guess>"})
        if k != target:
            messages.append({"role": "user", "content": "higher" if target > k else "lower"})
    return messages


_EXAMPLE = (8, 5)  # example game: N = 8, secret 5 -> guesses 4, 6, 5


class GuessEnv:
    """One guessing episode at a time (see the module docstring for the rules)."""

    name = "guess"

    def __init__(self, config: Optional[GuessConfig] = None, **overrides: Any) -> None:
        cfg = config or GuessConfig()
        self.config = replace(cfg, **overrides) if overrides else cfg
        self.max_turns = self.config.max_turns
        self._task: Optional[Task] = None
        self._done = True
        self._terminated = False

    def reset(self, task: Task) -> List[Message]:
        if not isinstance(task, Task):
            raise ValueError(f"task: expected a Task, got {type(task).__name__}")
        upper = int(task.metadata.get("upper", self.config.upper))
        if not (isinstance(task.answer, int) and 1 <= task.answer <= upper):
            raise ValueError(f"task: answer must be an integer in [1, {upper}], got {task.answer!r}")
        self._task = task
        self._upper = upper
        self._lo, self._hi = 1, upper
        self._turns = 0
        self._done = False
        self._terminated = False
        return self._context(task.prompt)

    def _context(self, question: str) -> List[Message]:
        messages: List[Message] = [{"role": "system", "content": _system_prompt(self._upper)}]
        if self.config.few_shot:
            upper, secret = _EXAMPLE
            messages.append({"role": "user", "content": _question(upper)})
            messages += _exchange(upper, secret)
        messages.append({"role": "user", "content": question})
        return messages

    def potential(self) -> float:
        r"""\Phi = -log2(hi - lo + 1) / log2(N); 0 in the terminal state."""
        if self._task is None or self._terminated:
            return 0.0
        size = max(1, self._hi - self._lo + 1)
        return -math.log2(size) / math.log2(self._upper)

    @property
    def interval(self) -> tuple:
        """The interval ``(lo, hi)`` consistent with the replies so far."""
        return (self._lo, self._hi)

    def summary(self) -> str:
        """The compaction summary of the current state (§19)."""
        return (
            f"Summary of the game so far: after {self._turns} guess{'es' if self._turns != 1 else ''}, "
            f"the secret is between {self._lo} and {self._hi}."
        )

    def compacted_messages(self, summary: Optional[str] = None) -> List[Message]:
        """The context of a new sub-trace after compaction: prompt + question + summary."""
        if self._task is None:
            raise RuntimeError("compacted_messages() needs an episode; call reset(task) first")
        return self._context(f"{self._task.prompt}\n{summary if summary is not None else self.summary()}")

    def step(self, action_text: str) -> StepResult:
        if self._task is None or self._done:
            raise RuntimeError("step() called on a finished episode; call reset(task) first")
        if not isinstance(action_text, str):
            raise ValueError(f"action_text: expected a string, got {type(action_text).__name__}")
        self._turns += 1
        reward = 0.0 - float(self.config.turn_cost)
        info: Dict[str, Any] = {}
        guess = _parse_guess(action_text)
        target = self._task.answer
        if guess is None or not 1 <= guess <= self._upper:
            what = "no <guess>K</guess> found" if guess is None else f"{guess} is out of range"
            info["tool_error"] = what
            observation = f"error: {what}; write <guess>K</guess> with an integer K from 1 to {self._upper}"
        elif guess == target:
            self._lo = self._hi = target
            self._done = self._terminated = True
            info.update(success=True, guess=guess, potential=0.0)
            return StepResult([], reward + 1.0, True, False, info)
        else:
            info["guess"] = guess
            if target > guess:
                self._lo = max(self._lo, guess + 1)
                observation = "higher"
            else:
                self._hi = min(self._hi, guess - 1)
                observation = "lower"

        if self._turns >= self.max_turns:
            self._done = True
            info.update(success=False, potential=self.potential())
            return StepResult([], reward, False, True, info)
        info["potential"] = self.potential()
        every = self.config.compact_every
        if every is not None and self._turns % every == 0:
            info["compact"] = self.summary()
        return StepResult([{"role": "user", "content": observation}], reward, False, False, info)


def _parse_guess(text: str) -> Optional[int]:
    content = extract_tag(text, "guess")
    if content is None or not re.fullmatch(r"[+-]?\d{1,12}", content):
        return None
    return int(content)


@register_task_source("guess")
class GuessSource:
    """Generates guessing tasks; builds :class:`GuessEnv`; demonstrates binary search.

    Keyword arguments are the fields of :class:`GuessConfig`.
    """

    name = "guess"

    def __init__(self, **kwargs: Any) -> None:
        self.config = GuessConfig(**kwargs)
        self._values = _split_values(self.config.upper, self.config.heldout_fraction)

    def split_values(self, split: str) -> List[int]:
        """The hidden values that ``split`` draws from (disjoint across splits)."""
        if split not in _SPLITS:
            raise ValueError(f"split: expected one of {_SPLITS}, got {split!r}")
        return list(self._values[split])

    def tasks(self, split: str, n: int, seed: int) -> List[Task]:
        """``n`` tasks of ``split`` (values drawn with replacement), deterministic in ``seed``."""
        values = self.split_values(split)
        if not (isinstance(n, int) and n >= 0):
            raise ValueError(f"n: expected a non-negative integer, got {n!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed: expected an integer, got {seed!r}")
        upper = self.config.upper
        rng = random.Random(f"guess|{upper}|{seed}|{split}")
        return [
            Task(
                id=f"guess-{split}-n{upper}-s{seed}-{i:06d}",
                split=split,
                prompt=_question(upper),
                answer=rng.choice(values),
                metadata={"upper": upper},
            )
            for i in range(n)
        ]

    def make_env(self, **kwargs: Any) -> GuessEnv:
        return GuessEnv(self.config, **kwargs)

    def demonstration(self, task: Task) -> List[Message]:
        """Binary search: guesses at the midpoint of the consistent interval."""
        if not isinstance(task, Task) or not isinstance(task.answer, int):
            raise ValueError("task: expected a guess Task with an integer answer")
        upper = int(task.metadata.get("upper", self.config.upper))
        if not 1 <= task.answer <= upper:
            raise ValueError(f"task: answer must be in [1, {upper}], got {task.answer}")
        return _exchange(upper, task.answer)
