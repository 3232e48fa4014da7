"""gymnasium environments with text observations and text actions, as a task source.

An episode is one ``gymnasium.Env``: ``reset(seed=...)`` gives the first observation (the
first user message), each assistant reply is one ``step(action_text)``, each later
observation is the next user message; the environment's reward, ``terminated`` and
``truncated`` are the step's. ``info["success"]`` is the environment's own
``info["success"]`` when it reports one, else whether the episode's last reward is
positive. A reply the action space does not contain (``action_space.contains``, e.g. too
long for a ``Text`` space or with characters outside its charset) is not sent to the
environment: it gets an error observation and costs a turn.

Tasks are seeds: ``train`` seeds are ``n`` consecutive integers below
``heldout_seed_offset`` (default 10**6; where they start depends on the run's seed) and
``heldout`` seeds count up from ``heldout_seed_offset``, so the splits never share a seed.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

from ..base import Message, StepResult, Task

__all__ = ["GymEnvironment", "GymSource"]

_SPLITS = ("train", "heldout")


def _text(obs: Any) -> str:
    return obs if isinstance(obs, str) else str(obs)


class GymEnvironment:
    """One trajgrad environment over one ``gymnasium.Env`` instance."""

    def __init__(self, env: Any, *, max_turns: int, system_prompt: Optional[str], name: str) -> None:
        self.env, self.max_turns, self.system_prompt, self.name = env, max_turns, system_prompt, name
        self._turns = 0

    def reset(self, task: Task) -> List[Message]:
        obs, _info = self.env.reset(seed=int(task.metadata["seed"]))
        self._turns = 0
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": _text(obs)}]

    def potential(self) -> float:
        return 0.0

    def step(self, action_text: str) -> StepResult:
        self._turns += 1
        space = getattr(self.env, "action_space", None)
        out_of_turns = self._turns >= self.max_turns
        if space is not None and not space.contains(action_text):
            info = {"tool_error": "action outside the action space", "success": False} if out_of_turns else \
                {"tool_error": "action outside the action space"}
            msg = [] if out_of_turns else [{"role": "user", "content": "error: that action is not valid here"}]
            return StepResult(msg, 0.0, False, out_of_turns, info)
        obs, reward, terminated, truncated, env_info = self.env.step(action_text)
        truncated = bool(truncated) or (out_of_turns and not terminated)
        info = {}
        if terminated or truncated:
            info["success"] = bool(env_info.get("success", float(reward) > 0)) if isinstance(env_info, dict) \
                else float(reward) > 0
        msgs = [] if (terminated or truncated) else [{"role": "user", "content": _text(obs)}]
        return StepResult(msgs, float(reward), bool(terminated), truncated, info)


class GymSource:
    """Task source over a factory of ``gymnasium.Env`` objects (one env per episode).

    Args:
      make: returns a fresh ``gymnasium.Env``.
      first: an instance already made (used by the first episode, then ``make``).
      max_turns: assistant turns before the episode is truncated (default: the env's
        ``spec.max_episode_steps`` if set, else 8).
      system_prompt: an optional system message before the first observation.
      heldout_seed_offset: the first held-out seed.
    """

    name = "gymnasium"

    def __init__(self, make: Callable[[], Any], *, first: Any = None, max_turns: Optional[int] = None,
                 system_prompt: Optional[str] = None, heldout_seed_offset: int = 10**6) -> None:
        if not callable(make):
            raise ValueError(f"make: expected a callable, got {type(make).__name__}")
        if max_turns is not None and not (isinstance(max_turns, int) and max_turns >= 1):
            raise ValueError(f"max_turns: expected an integer >= 1, got {max_turns!r}")
        if not (isinstance(heldout_seed_offset, int) and heldout_seed_offset >= 1):
            raise ValueError(f"heldout_seed_offset: expected an integer >= 1, got {heldout_seed_offset!r}")
        self._make, self._spare = make, first
        probe = first if first is not None else make()
        self._spare = probe
        spec = getattr(probe, "spec", None)
        self.max_turns = max_turns or getattr(spec, "max_episode_steps", None) or 8
        self.system_prompt = system_prompt
        self.heldout_seed_offset = heldout_seed_offset
        self.env_name = getattr(spec, "id", None) or type(getattr(probe, "unwrapped", probe)).__name__

    def tasks(self, split: str, n: int, seed: int) -> List[Task]:
        if split not in _SPLITS:
            raise ValueError(f"split: expected one of {_SPLITS}, got {split!r}")
        if split == "heldout":
            base = self.heldout_seed_offset  # the same held-out seeds for every run seed
        else:
            if n > self.heldout_seed_offset:
                raise ValueError(f"n: at most {self.heldout_seed_offset} training seeds, got {n}")
            base = (int(seed) * 7919) % (self.heldout_seed_offset - n + 1)
        return [Task(id=f"{self.env_name}-{split}-{base + i}", split=split, prompt="", answer=None,
                     metadata={"seed": base + i}) for i in range(n)]

    def make_env(self, **kwargs: Any) -> GymEnvironment:
        env, self._spare = (self._spare, None) if self._spare is not None else (self._make(), None)
        return GymEnvironment(env, max_turns=kwargs.get("max_turns", self.max_turns),
                              system_prompt=self.system_prompt, name=self.env_name)

    def demonstration(self, task: Task) -> List[Message]:
        raise ValueError("sft.steps: a gymnasium environment has no demonstrations; set sft.steps to 0")
