r"""Heavy-tailed environment latency: a lognormal sleep added to every ``env.step``.

Real agent environments (tool calls, sandboxes, web requests) take a random and
heavy-tailed time per step. :class:`LatencyEnv` reproduces that on top of any
environment: before returning, each :meth:`~LatencyEnv.step` sleeps

.. math::

   D = e^{Z},\qquad Z\sim\mathcal N(\mu, \sigma^2),

seconds, with :math:`\mu` and :math:`\sigma` given in *log-seconds* (``mu=log(0.05)``,
``sigma=1.0``: median 50 ms, mean :math:`e^{\mu+\sigma^2/2}\approx 82` ms, 1% of the steps
longer than ~0.5 s). Group methods wait for the slowest member of every group (§20.1);
this wrapper is how the asynchronous benchmark makes that wait visible.

:class:`LatencyTaskSource` wraps a task source so that every environment it makes is a
:class:`LatencyEnv` with its own random stream (seed ``seed`` mixed with a counter);
:func:`with_latency` builds one from the ``asynchronous.env_latency`` setting
(``{"mu": ..., "sigma": ...}``, optional ``"seed"``).

The draws never touch the global random state, so the rollout itself (token sampling)
is unaffected; the reward, messages and flags of the wrapped step are returned
unchanged, with the slept time added as ``info["latency_seconds"]``.
"""
from __future__ import annotations

import math
import random
import time
from typing import Any, Dict, List, Mapping, Optional

from .base import StepResult

__all__ = ["LatencyEnv", "LatencyTaskSource", "with_latency", "lognormal_mean"]


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a finite number, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return x


def _check_params(mu: Any, sigma: Any, seed: Any) -> tuple:
    mu = _finite("mu", mu)
    sigma = _finite("sigma", sigma)
    if sigma < 0:
        raise ValueError(f"sigma: must be >= 0 (log-seconds), got {sigma}")
    if mu > math.log(3600.0):
        raise ValueError(f"mu: log-seconds; exp(mu) = {math.exp(mu):.3g} s per step is not a latency, got {mu}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed: expected an integer or None, got {seed!r}")
    return mu, sigma, seed


def lognormal_mean(mu: float, sigma: float) -> float:
    r"""Mean step latency in seconds, :math:`e^{\mu+\sigma^2/2}`."""
    mu, sigma, _ = _check_params(mu, sigma, None)
    return math.exp(mu + 0.5 * sigma * sigma)


class LatencyEnv:
    """An environment whose every ``step`` also sleeps a lognormal time.

    Args:
      env: the wrapped environment (any object with ``reset``/``step``; ``name``,
        ``max_turns``, ``potential`` and every other attribute are forwarded).
      mu: mean of the log-latency, in log-seconds.
      sigma: standard deviation of the log-latency (>= 0); 0 gives a constant
        ``exp(mu)`` seconds.
      seed: seeds this environment's own random stream (``None``: from the OS).
    """

    def __init__(self, env: Any, mu: float, sigma: float, seed: Optional[int] = None):
        if env is None or not hasattr(env, "step") or not hasattr(env, "reset"):
            raise ValueError(f"env: expected an environment with reset() and step(), got {type(env).__name__}")
        self.mu, self.sigma, self.seed = _check_params(mu, sigma, seed)
        self.env = env
        self._rng = random.Random(seed)
        self.total_sleep = 0.0
        self.steps = 0

    # the Environment protocol ------------------------------------------------
    @property
    def name(self) -> str:
        return getattr(self.env, "name", type(self.env).__name__)

    @property
    def max_turns(self):
        return getattr(self.env, "max_turns", None)

    def reset(self, task) -> List[dict]:
        return self.env.reset(task)

    def draw(self) -> float:
        """One latency in seconds (advances this environment's stream)."""
        return math.exp(self._rng.gauss(self.mu, self.sigma)) if self.sigma > 0 else math.exp(self.mu)

    def step(self, action_text: str) -> StepResult:
        delay = self.draw()
        res = self.env.step(action_text)
        time.sleep(delay)
        self.total_sleep += delay
        self.steps += 1
        messages, reward, terminated, truncated, info = res
        info = dict(info or {})
        info["latency_seconds"] = delay
        return StepResult(messages, reward, terminated, truncated, info)

    def potential(self) -> float:
        fn = getattr(self.env, "potential", None)
        return 0.0 if fn is None else float(fn())

    def __getattr__(self, item: str) -> Any:
        # only called for attributes not found on the wrapper: forward to the environment
        if item == "env":
            raise AttributeError(item)
        return getattr(self.env, item)


class LatencyTaskSource:
    """A task source whose environments are :class:`LatencyEnv` wrappers.

    ``tasks``, ``demonstration`` and every other attribute are forwarded to ``source``;
    the ``k``-th environment made gets the seed ``seed * 1_000_003 + k`` (``None``: from
    the OS), so two sources with the same seed produce the same latency sequence.
    """

    def __init__(self, source: Any, mu: float, sigma: float, seed: Optional[int] = None):
        if source is None or not hasattr(source, "make_env"):
            raise ValueError(f"source: expected a task source with make_env(), got {type(source).__name__}")
        self.mu, self.sigma, self.seed = _check_params(mu, sigma, seed)
        self.source = source
        self._made = 0

    @property
    def name(self) -> str:
        return getattr(self.source, "name", type(self.source).__name__)

    def tasks(self, split: str, n: int, seed: int):
        return self.source.tasks(split, n, seed)

    def demonstration(self, task):
        return self.source.demonstration(task)

    def make_env(self, **kwargs) -> LatencyEnv:
        seed = None if self.seed is None else self.seed * 1_000_003 + self._made
        self._made += 1
        return LatencyEnv(self.source.make_env(**kwargs), self.mu, self.sigma, seed=seed)

    def __getattr__(self, item: str) -> Any:
        if item == "source":
            raise AttributeError(item)
        return getattr(self.source, item)


def with_latency(source: Any, spec: Optional[Mapping[str, Any]], seed: Optional[int] = None) -> Any:
    """``source`` wrapped per ``spec`` (``{"mu", "sigma"}`` and optional ``"seed"``);
    ``source`` itself when ``spec`` is None."""
    if spec is None:
        return source
    if not isinstance(spec, Mapping):
        raise ValueError(f"spec: expected a mapping {{'mu': ..., 'sigma': ...}} or None, got {type(spec).__name__}")
    unknown = set(spec) - {"mu", "sigma", "seed"}
    if unknown:
        raise ValueError(f"spec: unknown keys {sorted(unknown)}; expected 'mu', 'sigma' and optionally 'seed'")
    missing = {"mu", "sigma"} - set(spec)
    if missing:
        raise ValueError(f"spec: missing {sorted(missing)} (log-seconds of the lognormal step latency)")
    s: Dict[str, Any] = dict(spec)
    if "seed" in s:
        seed_v = s["seed"]
        if isinstance(seed_v, float) and seed_v.is_integer():
            seed_v = int(seed_v)
        seed = seed_v
    return LatencyTaskSource(source, s["mu"], s["sigma"], seed=seed)
