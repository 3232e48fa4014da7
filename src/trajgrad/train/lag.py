r"""Admission and lag bookkeeping of the asynchronous learner (§20.1, §16): no Ray, no model.

* :func:`group_wait`: the within-group waiting work :math:`W` a grouped method pays;
* :func:`lag_histogram`: counts of policy lags per update;
* :class:`LagGate`: finished episodes in, batches of fresh ones out; stale ones dropped and
  counted, every episode trained at most once.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence

import numpy as np

__all__ = ["group_wait", "lag_histogram", "Admitted", "LagGate"]


def group_wait(finish_times: Sequence[float]) -> float:
    r"""Within-group waiting work :math:`W=\sum_i (T_{ready}-T_i)`, :math:`T_{ready}=\max_i T_i` (§20.1).

    Args:
      finish_times: the finish times :math:`T_1..T_G` of one group's rollouts (seconds,
        any common origin), at least one, all finite.
    """
    try:
        ts = [float(t) for t in finish_times]
    except (TypeError, ValueError):
        raise ValueError(f"finish_times: expected a sequence of numbers, got {finish_times!r}") from None
    if not ts:
        raise ValueError("finish_times: empty group")
    if not all(math.isfinite(t) for t in ts):
        raise ValueError(f"finish_times: must be finite, got {ts}")
    ready = max(ts)
    return float(sum(ready - t for t in ts))


def lag_histogram(lags: Sequence[int], max_lag: int) -> Dict[str, int]:
    """Counts ``lag/hist_0 .. lag/hist_{max_lag}`` (lags above ``max_lag`` in ``lag/hist_over``)."""
    out = {f"lag/hist_{k}": 0 for k in range(max_lag + 1)}
    out["lag/hist_over"] = 0
    for lag in lags:
        if lag < 0:
            raise ValueError(f"lags: negative lag {lag}")
        out[f"lag/hist_{lag}" if lag <= max_lag else "lag/hist_over"] += 1
    return out


@dataclass
class Admitted:
    """One finished episode waiting for an update.

    Attributes:
      key: unique id of the episode.
      oldest_version: oldest policy version that sampled a token to be trained.
      size: number of trajectories (sub-traces) it contributes.
      payload: anything (the trainer stores the trajectories).
    """

    key: str
    oldest_version: int
    size: int = 1
    payload: Any = None


class LagGate:
    r"""Admission and lag bookkeeping of the asynchronous learner (no Ray, no model).

    Finished episodes are :meth:`admit`-ted in completion order. :meth:`next_batch`,
    called with the learner's current version :math:`v`, first drops every pending
    episode whose lag :math:`v-v_{oldest}` exceeds ``max_lag`` (counted, never
    returned), then, once at least ``batch_trajectories`` trajectories are pending,
    returns whole episodes in admission order until that many are reached. An episode
    key is accepted once: a second :meth:`admit` of the same key is refused and counted,
    so no trajectory is trained twice.

    Invariant (tested): every episode returned by ``next_batch(v)`` has
    ``0 <= v - oldest_version <= max_lag``, and
    ``admitted == trained + dropped_lag + pending``.
    """

    def __init__(self, batch_trajectories: int, max_lag: int):
        if isinstance(batch_trajectories, bool) or not isinstance(batch_trajectories, int) or batch_trajectories < 1:
            raise ValueError(f"batch_trajectories: expected a positive integer, got {batch_trajectories!r}")
        if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
            raise ValueError(f"max_lag: expected a non-negative integer, got {max_lag!r}")
        self.batch_trajectories = batch_trajectories
        self.max_lag = max_lag
        self.pending: Deque[Admitted] = deque()
        self._seen: set = set()
        self.admitted = 0
        self.trained = 0
        self.trained_trajectories = 0
        self.dropped_lag = 0
        self.dropped_lag_trajectories = 0
        self.duplicates = 0
        self.last_dropped: List[Admitted] = []

    @property
    def pending_trajectories(self) -> int:
        return sum(a.size for a in self.pending)

    def admit(self, key: str, oldest_version: int, size: int = 1, payload: Any = None) -> bool:
        """Queue a finished episode; False (and counted) if ``key`` was admitted before."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key: expected a non-empty string, got {key!r}")
        if isinstance(oldest_version, bool) or not isinstance(oldest_version, (int, np.integer)) or oldest_version < 0:
            raise ValueError(f"oldest_version: expected a non-negative integer, got {oldest_version!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size: expected a positive integer, got {size!r}")
        if key in self._seen:
            self.duplicates += 1
            return False
        self._seen.add(key)
        self.pending.append(Admitted(key, int(oldest_version), size, payload))
        self.admitted += 1
        return True

    def lag(self, item: Admitted, learner_version: int) -> int:
        lag = int(learner_version) - item.oldest_version
        if lag < 0:
            raise ValueError(
                f"learner_version: {learner_version} is older than version {item.oldest_version} that sampled {item.key!r}"
            )
        return lag

    def drop_stale(self, learner_version: int) -> List[Admitted]:
        """Remove (and count) the pending episodes whose lag exceeds ``max_lag``."""
        keep: Deque[Admitted] = deque()
        dropped: List[Admitted] = []
        for item in self.pending:
            (dropped if self.lag(item, learner_version) > self.max_lag else keep).append(item)
        self.pending = keep
        self.dropped_lag += len(dropped)
        self.dropped_lag_trajectories += sum(a.size for a in dropped)
        return dropped

    def next_batch(self, learner_version: int) -> Optional[List[Admitted]]:
        """The next update's episodes (FIFO), or None while fewer than ``batch_trajectories``
        fresh trajectories are pending. Stale episodes are dropped first
        (:attr:`last_dropped`)."""
        if isinstance(learner_version, bool) or not isinstance(learner_version, (int, np.integer)) or learner_version < 0:
            raise ValueError(f"learner_version: expected a non-negative integer, got {learner_version!r}")
        self.last_dropped = self.drop_stale(int(learner_version))
        if self.pending_trajectories < self.batch_trajectories:
            return None
        batch: List[Admitted] = []
        n = 0
        while n < self.batch_trajectories:
            item = self.pending.popleft()
            batch.append(item)
            n += item.size
        self.trained += len(batch)
        self.trained_trajectories += n
        return batch

    def state(self) -> Dict[str, int]:
        return {"admitted": self.admitted, "trained": self.trained, "trained_trajectories": self.trained_trajectories,
                "dropped_lag": self.dropped_lag, "dropped_lag_trajectories": self.dropped_lag_trajectories,
                "duplicates": self.duplicates}

    def load_counters(self, state: Mapping[str, int]) -> None:
        for k in ("admitted", "trained", "trained_trajectories", "dropped_lag", "dropped_lag_trajectories", "duplicates"):
            if k in state:
                setattr(self, k, int(state[k]))
