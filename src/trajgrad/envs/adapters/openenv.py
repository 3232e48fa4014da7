"""OpenEnv environments served over HTTP, as the task source ``"openenv"``.

The environment runs in its own server (``openenv.core.env_server.create_app``, e.g.
under uvicorn on ``127.0.0.1``); trajgrad talks to it with OpenEnv's own client
(``GenericEnvClient``: one WebSocket session on ``{base_url}/ws`` per episode, so the
server's ``max_concurrent_envs`` must allow ``train.prompts_per_step * group_size``
sessions). ``reset(seed=...)`` gives the first observation, each assistant reply is sent
as the action ``{action_field: reply}``, and the server's ``reward`` and ``done`` are the
step's reward and termination. ``info["success"]`` is the observation's
``metadata["success"]`` when the server reports it, else whether the last reward is
positive. Running out of ``max_turns`` truncates the episode (and closes the session).

Observations are rendered as text: ``observation[observation_field]`` when given, else
the observation's only string field, else its JSON. Tasks are seeds as in the gymnasium
adapter (train below ``heldout_seed_offset``, held-out from it).

Options (``task.options``): ``base_url`` (required), ``action_field`` ("message"),
``observation_field`` (None), ``max_turns`` (8), ``system_prompt`` (None),
``heldout_seed_offset`` (10**6), ``timeout_s`` (30). Nothing connects before the first
episode, so the config is validated without a running server.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, List, Optional

from ..base import Message, StepResult, Task, register_task_source

__all__ = ["OpenEnvConfig", "OpenEnvEnvironment", "OpenEnvSource"]

_PLUMBING = ("done", "reward", "metadata")


@dataclass(frozen=True)
class OpenEnvConfig:
    """Options of the ``"openenv"`` task source (see the module docstring)."""

    base_url: str = ""
    action_field: str = "message"
    observation_field: Optional[str] = None
    max_turns: int = 8
    system_prompt: Optional[str] = None
    heldout_seed_offset: int = 10**6
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.base_url and not self.base_url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"base_url: expected an http:// or ws:// URL, got {self.base_url!r}")
        if not self.action_field:
            raise ValueError("action_field: expected a non-empty field name")
        if not (isinstance(self.max_turns, int) and self.max_turns >= 1):
            raise ValueError(f"max_turns: expected an integer >= 1, got {self.max_turns!r}")
        if not (isinstance(self.heldout_seed_offset, int) and self.heldout_seed_offset >= 1):
            raise ValueError(f"heldout_seed_offset: expected an integer >= 1, got {self.heldout_seed_offset!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: expected a number > 0, got {self.timeout_s!r}")


def observation_text(obs: Any, field: Optional[str] = None) -> str:
    """The text of an OpenEnv observation (a dict from ``GenericEnvClient``)."""
    if not isinstance(obs, dict):
        return str(obs)
    if field is not None:
        if field not in obs:
            raise ValueError(f"observation_field: the observation has no field {field!r}; it has {sorted(obs)}")
        return str(obs[field])
    texts = [v for k, v in obs.items() if k not in _PLUMBING and isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps({k: v for k, v in obs.items() if k not in _PLUMBING}, default=str)


class OpenEnvEnvironment:
    """One episode: one WebSocket session with the OpenEnv server."""

    def __init__(self, config: OpenEnvConfig) -> None:
        self.config, self.name, self.max_turns = config, "openenv", config.max_turns
        self._client = None
        self._turns = 0

    def _close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            finally:
                self._client = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self._close()
        except Exception:
            pass

    def reset(self, task: Task) -> List[Message]:
        from openenv.core.generic_client import GenericEnvClient

        self._close()
        c = self.config
        if not c.base_url:
            raise ValueError("task.options.base_url: required for task 'openenv' (the server's URL)")
        self._client = GenericEnvClient(base_url=c.base_url, connect_timeout_s=c.timeout_s,
                                        message_timeout_s=c.timeout_s).sync()
        self._client.connect()
        res = self._client.reset(seed=int(task.metadata["seed"]))
        self._turns = 0
        msgs = [{"role": "system", "content": c.system_prompt}] if c.system_prompt else []
        return msgs + [{"role": "user", "content": observation_text(res.observation, c.observation_field)}]

    def potential(self) -> float:
        return 0.0

    def step(self, action_text: str) -> StepResult:
        if self._client is None:
            raise ValueError("step: call reset(task) first")
        self._turns += 1
        res = self._client.step({self.config.action_field: action_text})
        reward = float(res.reward or 0.0)
        done = bool(res.done)
        truncated = not done and self._turns >= self.max_turns
        info = {}
        if done or truncated:
            meta = res.observation.get("metadata", {}) if isinstance(res.observation, dict) else {}
            info["success"] = bool(meta.get("success", reward > 0)) if isinstance(meta, dict) else reward > 0
            self._close()
            return StepResult([], reward, done, truncated, info)
        text = observation_text(res.observation, self.config.observation_field)
        return StepResult([{"role": "user", "content": text}], reward, False, False, info)


@register_task_source("openenv")
class OpenEnvSource:
    """Task source ``"openenv"``: seeds of an OpenEnv server's environment."""

    name = "openenv"
    options_class = OpenEnvConfig
    renders_remotely = True  # reset() opens a server session: held-out tasks are told apart by seed

    def __init__(self, **kwargs: Any) -> None:
        self.config = OpenEnvConfig(**kwargs)

    def tasks(self, split: str, n: int, seed: int) -> List[Task]:
        if split not in ("train", "heldout"):
            raise ValueError(f"split: expected 'train' or 'heldout', got {split!r}")
        off = self.config.heldout_seed_offset
        if split == "heldout":
            base = off
        else:
            if n > off:
                raise ValueError(f"n: at most {off} training seeds, got {n}")
            base = (int(seed) * 7919) % (off - n + 1)
        return [Task(id=f"openenv-{split}-{base + i}", split=split, prompt="", answer=None,
                     metadata={"seed": base + i}) for i in range(n)]

    def make_env(self, **kwargs: Any) -> OpenEnvEnvironment:
        from dataclasses import replace

        return OpenEnvEnvironment(replace(self.config, **kwargs) if kwargs else self.config)

    def demonstration(self, task: Task) -> List[Message]:
        raise ValueError("sft.steps: an OpenEnv environment has no demonstrations; set sft.steps to 0")
