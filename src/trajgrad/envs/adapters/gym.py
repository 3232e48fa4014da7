"""gymnasium environments with text observations and text actions, as a task source.

An episode is one ``gymnasium.Env``: ``reset(seed=...)`` gives the first observation (the
first user message), each assistant reply is one ``step(action_text)``, each later
observation is the next user message; the environment's reward, ``terminated`` and
``truncated`` are the step's. ``info["success"]`` is the environment's own
``info["success"]`` when it reports one, else whether the episode's last reward is
positive.

The environment decides what it accepts: every reply is passed to ``step`` as it is (the
``action_space`` is not consulted; gymnasium's default ``Text`` charset, for one, holds no
punctuation). A reply is an *invalid action* when

* ``step`` raises: the turn is spent with reward 0, the episode goes on, and the agent is
  shown ``error: <the exception's message>``; the reason is the exception's class name;
* or the environment says so in ``info``: ``info["invalid_action"]`` true (reason
  ``invalid_action``), or ``info["action_is_valid"]`` false, at the top level or inside
  ``info["metrics"]`` (reason ``action_is_valid``); everything else of that step
  (observation, reward, flags) is the environment's own.

The step's ``info["invalid_action"]`` then holds the reason, and the trainer logs
``env/invalid_action_frac`` (invalid turns / turns) and ``env/invalid_action/<reason>``
(counts) for every update.

Turn limit: the env spec's ``max_episode_steps`` when it has one (``gymnasium.make(id,
max_episode_steps=N)`` sets it), else the adapter option ``max_turns``
(``task.options.adapter.max_turns``), else 8; giving ``max_turns`` that differs from the
spec's limit is refused. The limit and where it came from are printed when a run starts
(:attr:`GymSource.notes`).

Observations must be strings; any other raises ValueError naming the environment and the
type (when the source is built, from a probe ``reset``): wrap such an environment in a
``gymnasium.ObservationWrapper`` whose ``observation()`` returns the text the model reads.

Tasks are seeds: ``train`` seeds are ``n`` consecutive integers below
``heldout_seed_offset`` (default 10**6; where they start depends on the run's seed) and
``heldout`` seeds count up from ``heldout_seed_offset``, so the splits never share a seed.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from ..task import Message, StepResult, Task

__all__ = ["GymEnvironment", "GymSource", "DEFAULT_MAX_TURNS"]

_SPLITS = ("train", "heldout")
DEFAULT_MAX_TURNS = 8


def _text(obs: Any, env_name: str, where: str) -> str:
    if not isinstance(obs, str):
        raise ValueError(f"name: the gymnasium environment {env_name!r} returned an observation of type "
                         f"{type(obs).__name__} from {where}; the model reads text: wrap the environment in a "
                         "gymnasium.ObservationWrapper whose observation() returns a str")
    return obs


def _flagged(info: Any) -> Optional[str]:
    """The reason an environment's ``info`` marks the action invalid, or None."""
    if not isinstance(info, dict):
        return None
    if info.get("invalid_action"):
        return "invalid_action"
    for d in (info, info.get("metrics")):
        if isinstance(d, dict) and d.get("action_is_valid", True) is False:
            return "action_is_valid"
    return None


class GymEnvironment:
    """One trajgrad environment over one ``gymnasium.Env`` instance."""

    def __init__(self, env: Any, *, max_turns: int, system_prompt: Optional[str], name: str) -> None:
        self.env, self.max_turns, self.system_prompt, self.name = env, max_turns, system_prompt, name
        self._turns = 0

    def reset(self, task: Task) -> List[Message]:
        obs, _info = self.env.reset(seed=int(task.metadata["seed"]))
        self._turns = 0
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": _text(obs, self.name, "reset()")}]

    def potential(self) -> float:
        return 0.0

    def step(self, action_text: str) -> StepResult:
        self._turns += 1
        out_of_turns = self._turns >= self.max_turns
        try:
            obs, reward, terminated, truncated, env_info = self.env.step(action_text)
        except Exception as exc:  # the environment refuses the action in its own words
            info: Dict[str, Any] = {"invalid_action": type(exc).__name__}
            if out_of_turns:
                return StepResult([], 0.0, False, True, {**info, "success": False})
            text = str(exc) or type(exc).__name__
            return StepResult([{"role": "user", "content": f"error: {text}"}], 0.0, False, False, info)
        truncated = bool(truncated) or (out_of_turns and not terminated)
        info = {}
        reason = _flagged(env_info)
        if reason is not None:
            info["invalid_action"] = reason
        if terminated or truncated:
            info["success"] = bool(env_info.get("success", float(reward) > 0)) if isinstance(env_info, dict) \
                else float(reward) > 0
        msgs = [] if (terminated or truncated) else [{"role": "user", "content": _text(obs, self.name, "step()")}]
        return StepResult(msgs, float(reward), bool(terminated), truncated, info)


class GymSource:
    """Task source over a factory of ``gymnasium.Env`` objects (one env per episode).

    Args:
      make: returns a fresh ``gymnasium.Env``.
      first: an instance already made (used by the first episode, then ``make``).
      max_turns: assistant turns before the episode is truncated when the env spec has no
        ``max_episode_steps`` (then default 8); refused when it differs from the spec's.
      system_prompt: an optional system message before the first observation.
      heldout_seed_offset: the first held-out seed.
    """

    name = "gymnasium"

    def __init__(self, make: Callable[[], Any], *, first: Any = None, max_turns: Optional[int] = None,
                 system_prompt: Optional[str] = None, heldout_seed_offset: int = 10**6) -> None:
        if not callable(make):
            raise ValueError(f"make: expected a callable, got {type(make).__name__}")
        if max_turns is not None and not (isinstance(max_turns, int) and not isinstance(max_turns, bool)
                                          and max_turns >= 1):
            raise ValueError(f"max_turns: expected an integer >= 1, got {max_turns!r}")
        if not (isinstance(heldout_seed_offset, int) and heldout_seed_offset >= 1):
            raise ValueError(f"heldout_seed_offset: expected an integer >= 1, got {heldout_seed_offset!r}")
        self._make, self._spare = make, first
        probe = first if first is not None else make()
        self._spare = probe
        spec = getattr(probe, "spec", None)
        self.env_name = getattr(spec, "id", None) or type(getattr(probe, "unwrapped", probe)).__name__
        spec_steps = getattr(spec, "max_episode_steps", None)
        if spec_steps is not None and max_turns is not None and max_turns != spec_steps:
            raise ValueError(f"adapter.max_turns: the spec of {self.env_name!r} sets max_episode_steps={spec_steps}, the "
                             f"turn limit; drop adapter.max_turns ({max_turns}) or make the environment with "
                             f"gymnasium.make(id, max_episode_steps={max_turns})")
        if spec_steps is not None:
            self.max_turns, origin = int(spec_steps), "the env spec's max_episode_steps"
        elif max_turns is not None:
            self.max_turns, origin = max_turns, "task.options.adapter.max_turns"
        else:
            self.max_turns, origin = DEFAULT_MAX_TURNS, ("the default: the env has no spec.max_episode_steps; "
                                                         "set task.options.adapter.max_turns")
        self.notes = [f"task: gymnasium environment {self.env_name!r}, turn limit {self.max_turns} ({origin})"]
        self.system_prompt = system_prompt
        self.heldout_seed_offset = heldout_seed_offset
        obs, _info = probe.reset(seed=heldout_seed_offset)  # a non-text observation is refused now, not mid-run
        _text(obs, self.env_name, "reset()")

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
