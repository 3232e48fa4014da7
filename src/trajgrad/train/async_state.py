r"""What an asynchronous learner's checkpoint keeps besides the weights (§20, §16).

A Ray learner (:class:`~trajgrad.train.async_trainer.AsyncTrainer`,
:class:`~trajgrad.train.grouped.GroupedRayTrainer`) writes one more file into every
checkpoint directory, :data:`ASYNC_STATE_FILE`, through ``Trainer.save(files=...)``: it is
written, checksummed and listed in the manifest with the weights, so a checkpoint holds it
or is not used at all (a kill while the checkpoint is written leaves ``latest`` naming the
previous one, buffer included; :mod:`trajgrad.train.checkpoint`). It holds

* ``buffer``: the finished episodes not yet trained (their sub-traces, with the policy
  version of every turn), in admission order;
* ``in_flight``: the episodes submitted to the workers and not finished, each as its data
  position, key, seed and task id: a resumed run submits them again from their task
  (``faults/rerun_on_resume``);
* ``trained``: the data positions of every episode trained so far (:class:`IndexSet`), so a
  resumed run can check that it trains none of them again;
* ``counters`` and ``gate``: the learner's and the lag gate's counters.

Episode keys are the data position: ``e<index>`` for a single rollout, ``g<index>`` for a
group and ``g<index>#<member>`` for its members (:func:`episode_key`,
:func:`episode_index`); a run resumed from a checkpoint draws the same positions again, so
an episode keeps its key across a resume.

On resume (:func:`plan_rerun`), an in-flight episode whose data position no longer holds
its task (the task set changed under ``--allow-config-change``) cannot be re-run: it is
counted in ``faults/lost_on_resume``, the only episodes a resume loses.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ..rollout import Trajectory

__all__ = [
    "ASYNC_STATE_FILE", "IndexSet", "InFlight", "AsyncState", "episode_key", "episode_index",
    "dump_async_state", "load_async_state", "plan_rerun",
]

ASYNC_STATE_FILE = "async_state.json"
FORMAT = 1


def episode_key(index: int, kind: str = "e", member: Optional[int] = None) -> str:
    """``e<index>`` (a single rollout), ``g<index>`` (a group), ``g<index>#<member>``."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index: expected a non-negative int, got {index!r}")
    if kind not in ("e", "g"):
        raise ValueError(f"kind: expected 'e' or 'g', got {kind!r}")
    return f"{kind}{index}" + ("" if member is None else f"#{int(member)}")


def episode_index(key: str) -> int:
    """The data position of an :func:`episode_key`."""
    head = key.split("#", 1)[0] if isinstance(key, str) else ""
    if len(head) < 2 or head[0] not in "eg" or not head[1:].isdigit():
        raise ValueError(f"key: {key!r} is not an episode key (e<index>, g<index> or g<index>#<member>)")
    return int(head[1:])


class IndexSet:
    """A set of non-negative ints kept as sorted, disjoint, non-adjacent ranges ``[a, b)``.

    The trained data positions of a run are nearly contiguous, so the checkpoint stores a
    few ranges instead of one number per episode.
    """

    def __init__(self, ranges: Iterable[Sequence[int]] = ()):
        self._r: List[List[int]] = []
        for r in ranges:
            if not isinstance(r, (list, tuple)) or len(r) != 2 or not all(isinstance(x, int) for x in r) \
                    or not 0 <= r[0] < r[1]:
                raise ValueError(f"ranges: expected [start, stop) pairs of ints with 0 <= start < stop, got {r!r}")
            self._add_range(r[0], r[1])

    def _add_range(self, a: int, b: int) -> None:
        r = self._r
        if not r or a > r[-1][1]:  # past the end (the usual case: positions are drawn in order)
            r.append([a, b])
            return
        lo = bisect.bisect_left(r, [a, -1])  # first range starting at or after a
        if lo > 0 and r[lo - 1][1] >= a:  # the range before touches [a, b)
            lo -= 1
        hi = lo
        while hi < len(r) and r[hi][0] <= b:  # every range touching [a, b) merges into one
            a, b = min(a, r[hi][0]), max(b, r[hi][1])
            hi += 1
        r[lo:hi] = [[a, b]]

    def add(self, index: int) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index: expected a non-negative int, got {index!r}")
        self._add_range(index, index + 1)

    def __contains__(self, index: int) -> bool:
        k = bisect.bisect_right(self._r, [index, float("inf")]) - 1
        return k >= 0 and self._r[k][0] <= index < self._r[k][1]

    def __len__(self) -> int:
        return sum(b - a for a, b in self._r)

    def ranges(self) -> List[List[int]]:
        return [list(r) for r in self._r]


@dataclass
class InFlight:
    """An episode submitted and not finished when the checkpoint was written."""

    key: str
    index: int
    seed: int
    task_id: str


@dataclass
class AsyncState:
    """The contents of :data:`ASYNC_STATE_FILE` (see the module docstring).

    ``buffer`` holds ``(key, sub-traces)`` per finished, untrained episode.
    """

    step: int
    counters: Dict[str, float] = field(default_factory=dict)
    gate: Dict[str, int] = field(default_factory=dict)
    buffer: List[Tuple[str, List[Trajectory]]] = field(default_factory=list)
    in_flight: List[InFlight] = field(default_factory=list)
    trained: IndexSet = field(default_factory=IndexSet)

    def check(self) -> None:
        """Refuse a state that would train an episode twice: a buffered or in-flight episode
        that is also recorded as trained, or one listed twice."""
        keys = [k for k, _ in self.buffer] + [f.key for f in self.in_flight]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{ASYNC_STATE_FILE}: an episode is listed twice in buffer/in_flight")
        both = [k for k in keys if episode_index(k) in self.trained]
        if both:
            raise ValueError(f"{ASYNC_STATE_FILE}: episodes {both[:4]} are buffered or in flight and recorded as trained")


def dump_async_state(state: AsyncState) -> bytes:
    """The file's bytes (JSON; each sub-trace as :meth:`Trajectory.to_json` writes it)."""
    state.check()
    data = {
        "format": FORMAT, "step": int(state.step), "counters": state.counters, "gate": state.gate,
        "trained": state.trained.ranges(),
        "in_flight": [f.__dict__ for f in state.in_flight],
        "buffer": [{"key": k, "trajectories": [json.loads(t.to_json()) for t in trajs]} for k, trajs in state.buffer],
    }
    return json.dumps(data, default=float, separators=(",", ":")).encode()


def load_async_state(path) -> AsyncState:
    """Read :data:`ASYNC_STATE_FILE` from the checkpoint directory ``path``; ValueError naming
    the file when it is not one."""
    p = Path(path) / ASYNC_STATE_FILE
    try:
        data = json.loads(p.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"unknown format {data.get('format')!r}")
        st = AsyncState(
            step=int(data["step"]), counters=dict(data.get("counters", {})), gate=dict(data.get("gate", {})),
            buffer=[(str(b["key"]), [Trajectory.from_dict(t) for t in b["trajectories"]]) for b in data["buffer"]],
            in_flight=[InFlight(str(f["key"]), int(f["index"]), int(f["seed"]), str(f["task_id"]))
                       for f in data["in_flight"]],
            trained=IndexSet(data["trained"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"checkpoint: {p} is not an asynchronous learner's state ({exc})") from None
    st.check()
    return st


def plan_rerun(in_flight: Sequence[InFlight], task_at: Callable[[int], Any]) -> Tuple[List[Tuple[InFlight, Any]], List[InFlight]]:
    """Split the checkpoint's in-flight episodes into ``(rerun, lost)``: ``rerun`` pairs each
    with its task (``task_at(index)``, whose ``id`` must be the recorded ``task_id``);
    ``lost`` are those whose data position now holds another task."""
    rerun: List[Tuple[InFlight, Any]] = []
    lost: List[InFlight] = []
    for f in in_flight:
        task = task_at(f.index)
        if getattr(task, "id", None) == f.task_id:
            rerun.append((f, task))
        else:
            lost.append(f)
    return rerun, lost
