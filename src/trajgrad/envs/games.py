r"""Task source ``"higher_lower"``: a number-guessing text game, a ``gymnasium.Env`` run through
trajgrad's gymnasium adapter (:class:`~trajgrad.envs.adapters.gym.GymSource`).

The game: a secret integer lies in a range of ``width`` numbers (``low .. low + width - 1``,
``low`` in ``1 .. lows``); the player replies with a number and hears whether the secret is
higher or lower, until it guesses right or ``max_turns`` guesses are used::

    user:      I picked a secret integer from 41 to 60. Guess it: reply with one number, ...
    assistant: 50
    user:      50 is too high. The secret is lower. Guess again.
    assistant: 45
    user:      Correct! The secret was 45.

The first integer in a reply is its guess; a reply without one, or with a number outside
the range, is answered with the rule and costs a guess. Reward ``1.0`` for the correct
guess (``terminated``, ``info["success"] = True``), 0 otherwise; out of guesses, the
episode is truncated with ``info["success"] = False``. With the defaults (width 20, 5
guesses) binary search always wins; guessing without using the replies wins 5/20 of the
time at best.

Games and seeds: the adapter's tasks are seeds; seed ``s`` plays game
``g = (s * 7919) mod G`` of the ``G = lows * width`` games (a bijection on any ``G``
consecutive seeds), game ``g`` being ``low = 1 + g // width``, ``secret = low + g mod width``.
:meth:`HigherLowerSource.tasks` keeps the seeds whose game falls in the split (a hash of
the game, ``heldout_fraction`` of them held out), so train and held-out games never
coincide and the tasks of one call are distinct games as long as the split has enough
(``G * heldout_fraction`` held-out games: 320 with the defaults).

``gymnasium`` is imported when the first environment is made (the ``byo`` extra).
"""
from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .._optional import require
from .adapters.gym import GymEnvironment, GymSource
from .base import Message, Task, register_task_source
from .splits import check_task_request, hash_split

__all__ = ["GameConfig", "HigherLowerSource", "game_of_seed", "make_higher_lower_env"]

_MULT = 7919  # prime: seed -> game is a bijection on G consecutive seeds when G is not a multiple of it
_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class GameConfig:
    """Options of ``get_task_source("higher_lower", ...)``.

    Attributes:
      width: numbers in a game's range (>= 2).
      lows: the range starts at 1 .. lows (>= 1).
      max_turns: guesses per game (>= 1).
      heldout_fraction: fraction of the games held out.
      example: describe a short example game inside the first message.
      example_turns: play a whole example game (range 1 to 20) as chat turns before the
        first message. Greedy SmolLM2-135M-Instruct with the inline example only replies
        in prose without a number (0/64 held-out).
      system_prompt: an optional system message.
    """

    width: int = 20
    lows: int = 80
    max_turns: int = 5
    heldout_fraction: float = 0.2
    example: bool = True
    example_turns: bool = False
    system_prompt: Optional[str] = None

    def __post_init__(self) -> None:
        for name, least in (("width", 2), ("lows", 1), ("max_turns", 1)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                raise ValueError(f"{name}: expected an integer >= {least}, got {value!r}")
        if (self.lows * self.width) % _MULT == 0:
            raise ValueError(f"lows: lows * width must not be a multiple of {_MULT}")
        if not 0.0 < float(self.heldout_fraction) < 1.0:
            raise ValueError(f"heldout_fraction: expected a number in (0, 1), got {self.heldout_fraction}")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"system_prompt: expected a string or None, got {type(self.system_prompt).__name__}")


def game_of_seed(seed: int, width: int, lows: int) -> Tuple[int, int]:
    """``(low, secret)`` of the game that ``seed`` plays."""
    g = (int(seed) * _MULT) % (lows * width)
    low = 1 + g // width
    return low, low + g % width


def _feedback(guess: Optional[int], low: int, high: int, secret: int) -> str:
    if guess == secret:
        return f"Correct! The secret was {secret}."
    if guess is None:
        return f"Reply with one number from {low} to {high}."
    if not low <= guess <= high:
        return f"{guess} is not between {low} and {high}. Guess again."
    if guess < secret:
        return f"{guess} is too low. The secret is higher. Guess again."
    return f"{guess} is too high. The secret is lower. Guess again."


def _example_turns() -> List[Message]:
    """A whole example game as chat turns: range 1 to 20, secret 7, guesses 10, 5, 7."""
    out: List[Message] = [{"role": "user", "content": _opening(1, 20, False)}]
    for guess in (10, 5, 7):
        out += [{"role": "assistant", "content": str(guess)}, {"role": "user", "content": _feedback(guess, 1, 20, 7)}]
    return out


def _opening(low: int, high: int, example: bool) -> str:
    text = (f"I picked a secret integer from {low} to {high}. Guess it: reply with one number, and I will tell "
            "you if the secret is higher or lower.")
    if example:
        text += (" Example with a secret from 1 to 10: you say 5, I say higher; you say 8, I say lower; "
                 "you say 7, I say correct.")
    return text


@functools.lru_cache(maxsize=1)
def _env_class():
    gym = require("gymnasium", "task 'higher_lower'")
    spaces = gym.spaces

    charset = string.printable

    class HigherLowerEnv(gym.Env):
        """The game as a ``gymnasium.Env`` with text observations and text actions."""

        metadata = {"render_modes": []}

        def __init__(self, width: int = 20, lows: int = 80, max_turns: int = 5, example: bool = True):
            self.width, self.lows, self.max_turns, self.example = width, lows, max_turns, example
            self.observation_space = spaces.Text(max_length=1000, min_length=1, charset=charset)
            self.action_space = spaces.Text(max_length=4000, min_length=0, charset=charset)
            self.low = self.high = self.secret = None
            self.turns = 0

        def reset(self, *, seed: Optional[int] = None, options: Optional[Dict[str, Any]] = None):
            super().reset(seed=seed)
            if seed is None:
                seed = int(self.np_random.integers(0, 2**31 - 1))
            self.low, self.secret = game_of_seed(seed, self.width, self.lows)
            self.high = self.low + self.width - 1
            self.turns = 0
            return _opening(self.low, self.high, self.example), {"low": self.low, "high": self.high}

        def step(self, action: str):
            if self.secret is None:
                raise RuntimeError("step() before reset()")
            self.turns += 1
            match = _INT.search(action)
            guess = int(match.group()) if match else None
            info: Dict[str, Any] = {"guess": guess}
            obs = _feedback(guess, self.low, self.high, self.secret)
            if guess == self.secret:
                info["success"] = True
                return obs, 1.0, True, False, info
            truncated = self.turns >= self.max_turns
            if truncated:
                info["success"] = False
            return obs, 0.0, False, truncated, info

    return HigherLowerEnv


def make_higher_lower_env(**kwargs: Any):
    """A new ``HigherLowerEnv`` (``gymnasium.Env``); keyword arguments: width, lows, max_turns, example."""
    return _env_class()(**kwargs)


class _WithExampleGame(GymEnvironment):
    """The adapter's environment with an example game as chat turns before the first observation."""

    def reset(self, task: Task) -> List[Message]:
        msgs = super().reset(task)
        return msgs[:-1] + _example_turns() + msgs[-1:]


@register_task_source("higher_lower")
class HigherLowerSource(GymSource):
    """The game through the gymnasium adapter; tasks are the seeds of the split's games.

    Keyword arguments are the fields of :class:`GameConfig`.
    """

    name = "higher_lower"

    def __init__(self, **kwargs: Any) -> None:
        self.config = cfg = GameConfig(**kwargs)
        super().__init__(lambda: make_higher_lower_env(width=cfg.width, lows=cfg.lows, max_turns=cfg.max_turns,
                                                       example=cfg.example),
                         max_turns=cfg.max_turns, system_prompt=cfg.system_prompt)
        self.env_name = "higher_lower"

    def make_env(self, **kwargs: Any) -> GymEnvironment:
        env = super().make_env(**kwargs)
        if not self.config.example_turns:
            return env
        return _WithExampleGame(env.env, max_turns=env.max_turns, system_prompt=env.system_prompt, name=env.name)

    def split_of(self, seed: int) -> str:
        low, secret = game_of_seed(seed, self.config.width, self.config.lows)
        return hash_split(f"higher_lower|{self.config.width}|{low}|{secret}", self.config.heldout_fraction)

    def tasks(self, split: str, n: int, seed: int) -> List[Task]:
        """``n`` seeds whose games are in ``split`` (distinct games while the split has enough)."""
        check_task_request(split, n, seed)
        cfg = self.config
        start = self.heldout_seed_offset if split == "heldout" else (int(seed) * 104729) % self.heldout_seed_offset
        out: List[Task] = []
        s = start
        while len(out) < n:
            if self.split_of(s) == split:
                low, secret = game_of_seed(s, cfg.width, cfg.lows)
                out.append(Task(id=f"higher_lower-{split}-{s}", split=split,
                                prompt=_opening(low, low + cfg.width - 1, cfg.example), answer=secret,
                                metadata={"seed": s, "low": low}))
            s += 1
        return out

    def demonstration(self, task: Task) -> List[Message]:
        """Binary search over the game's range."""
        low, secret = int(task.metadata["low"]), int(task.answer)
        lo, hi, out = low, low + self.config.width - 1, []
        while True:
            k = (lo + hi) // 2
            out.append({"role": "assistant", "content": str(k)})
            if k == secret:
                return out
            out.append({"role": "user", "content": _feedback(k, low, low + self.config.width - 1, secret)})
            lo, hi = (k + 1, hi) if k < secret else (lo, k - 1)
