r"""Trajectories as sampled, and an append-only log that survives a killed process.

A :class:`Trajectory` is one sub-trace of one episode (§19): the prompt token ids, then
for every turn the action token ids the policy sampled and the observation token ids the
environment (and the chat format) appended after it. The trained sequence *is* the
sampled sequence, token for token; nothing is re-tokenized::

    token_ids = prompt_ids + a_0 + o_0 + a_1 + o_1 + ... + a_{T-1} + o_{T-1}

Per-token views are aligned with the *targets* ``token_ids[1:]`` (§4): position ``j``
describes the token ``token_ids[j + 1]``. Only action tokens carry ``action_mask = 1``;
prompt and observation tokens are context the policy did not choose (§4: "tool
observations must have action_mask=0").

Each turn records the log-probability of every action token under the *exact*
distribution that sampled it (after temperature / top-k / top-p, §7) and the policy
version that sampled it (§16: an episode may span several behaviour policies, so the
version is per turn, never per episode).

:class:`TrajectoryLog` stores trajectories as JSON lines, one per line, flushed and
``fsync``'d per append, so that every line written before a crash is readable after it.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Union

__all__ = ["Turn", "Trajectory", "TrajectoryLog", "read_trajectories"]

NO_VERSION = -1  # policy_versions_aligned() at targets that are not action tokens
_INT = {int}


def _check_int_list(name: str, values: Sequence[int]) -> List[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name}: expected a list of token ids, got {type(values).__name__}")
    if type(values) is list and (not values or (set(map(type, values)) == _INT and min(values) >= 0)):
        return list(values)  # plain non-negative ints (what the sampler records): nothing to convert
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            # accept integer-valued numpy / torch scalars
            try:
                iv = int(v)
            except Exception:
                raise ValueError(f"{name}: token ids must be integers, got {v!r}") from None
            if iv != v:
                raise ValueError(f"{name}: token ids must be integers, got {v!r}")
            v = iv
        if v < 0:
            raise ValueError(f"{name}: token ids must be non-negative, got {v}")
        out.append(v)
    return out


def _json_default(obj: Any) -> Any:
    """Make info / metadata values JSON-serializable (numpy and torch scalars, sets)."""
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return obj.item()
        except Exception:
            pass
    if hasattr(obj, "tolist") and callable(obj.tolist):
        return obj.tolist()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return repr(obj)


@dataclass(kw_only=True)
class Turn:
    r"""One action of the policy and the observation that followed it.

    Attributes:
      action_ids: the sampled token ids, verbatim. Ends with the end-of-turn token
        (``<|im_end|>``) unless the action was cut at ``max_new_tokens`` (``cut``).
      observation_ids: the token ids appended after the action (the end of the assistant
        message, the environment's messages, the next generation prompt); ``[]`` after
        the last action of a sub-trace.
      behaviour_logp: one float per action token, :math:`\log\mu(x_j\mid x_{<j})` under the
        exact sampling distribution (after temperature / top-k / top-p). A greedy
        (temperature 0) policy is deterministic, so it records 0.0.
      policy_version: the version of the policy that sampled this turn (§16).
      reward: the environment's reward for this step.
      info: the environment's ``StepResult.info``.
      action_text: the decoded action as passed to the environment.
      cut: True if the action hit ``max_new_tokens`` before the end-of-turn token.
      gen_seconds: wall time of the (batched) generation call that produced the action;
        shared by every episode of that batch.
      env_seconds: wall time of ``env.step`` for this action.
    """

    action_ids: List[int]
    observation_ids: List[int] = field(default_factory=list)
    behaviour_logp: List[float] = field(default_factory=list)
    policy_version: int = 0
    reward: float = 0.0
    info: Dict[str, Any] = field(default_factory=dict)
    action_text: str = ""
    cut: bool = False
    gen_seconds: float = 0.0
    env_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.action_ids = _check_int_list("action_ids", self.action_ids)
        self.observation_ids = _check_int_list("observation_ids", self.observation_ids)
        if not self.action_ids:
            raise ValueError("action_ids: a turn needs at least one action token")
        logp = [float(x) for x in self.behaviour_logp]
        if len(logp) != len(self.action_ids):
            raise ValueError(
                f"behaviour_logp: expected one value per action token ({len(self.action_ids)}), got {len(logp)}"
            )
        for x in logp:
            if not math.isfinite(x) or x > 0.0:
                raise ValueError(f"behaviour_logp: must be finite and <= 0, got {x}")
        self.behaviour_logp = logp
        if isinstance(self.policy_version, bool) or int(self.policy_version) != self.policy_version:
            raise ValueError(f"policy_version: expected an integer, got {self.policy_version!r}")
        self.policy_version = int(self.policy_version)
        self.reward = float(self.reward)
        if not math.isfinite(self.reward):
            raise ValueError(f"reward: must be finite, got {self.reward}")
        if not isinstance(self.info, dict):
            raise ValueError(f"info: expected a dict, got {type(self.info).__name__}")

    def to_dict(self) -> Dict[str, Any]:
        return _fields_copy(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Turn":
        if not isinstance(d, dict):
            raise ValueError(f"d: expected a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        if "action_ids" not in d:
            raise ValueError("d: missing key 'action_ids'")
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(kw_only=True)
class Trajectory:
    """One sub-trace of one episode, with everything needed to train on it.

    Attributes:
      task_id: the task's id (trajectories of one task form a group).
      episode_id: unique per episode; shared by the sub-traces of a compacted episode.
      segment: index of this sub-trace within its episode (§19), 0 without compaction.
      split: the task's split (``"train"`` / ``"heldout"``).
      prompt_ids: the rendered initial conversation, ending with the generation prompt.
        Must be non-empty (the first action token needs a preceding position).
      turns: the turns, in order.
      terminated: the episode ended for real in this sub-trace.
      truncated: the episode was cut (turn limit, context limit) in this sub-trace.
      sampling: the sampling parameters (temperature, top_k, top_p, max_new_tokens,
        model, ...).
      success: the environment's ``info["success"]`` at the end of the episode (None if
        the environment did not say).
      total_reward: sum of the turn rewards of this sub-trace (computed when None).
      created_at: Unix time of creation.
      metadata: anything else (group index, environment name, initial potential, ...).
    """

    task_id: str
    episode_id: str
    prompt_ids: List[int]
    turns: List[Turn] = field(default_factory=list)
    segment: int = 0
    split: str = "train"
    terminated: bool = False
    truncated: bool = False
    sampling: Dict[str, Any] = field(default_factory=dict)
    success: Optional[bool] = None
    total_reward: Optional[float] = None
    created_at: float = field(default_factory=time.time)
    metadata: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt_ids = _check_int_list("prompt_ids", self.prompt_ids)
        if not self.prompt_ids:
            raise ValueError("prompt_ids: must contain at least one token")
        turns = []
        for t in self.turns:
            if isinstance(t, dict):
                t = Turn.from_dict(t)
            if not isinstance(t, Turn):
                raise ValueError(f"turns: expected Turn objects, got {type(t).__name__}")
            turns.append(t)
        self.turns = turns
        if isinstance(self.segment, bool) or int(self.segment) != self.segment or self.segment < 0:
            raise ValueError(f"segment: expected a non-negative integer, got {self.segment!r}")
        self.segment = int(self.segment)
        if self.total_reward is None:
            self.total_reward = float(sum(t.reward for t in self.turns))
        self.total_reward = float(self.total_reward)
        if self.success is not None:
            self.success = bool(self.success)

    # ------------------------------------------------------------------ token views
    def __len__(self) -> int:
        """Number of tokens of :meth:`token_ids`."""
        return len(self.prompt_ids) + sum(len(t.action_ids) + len(t.observation_ids) for t in self.turns)

    @property
    def num_action_tokens(self) -> int:
        return sum(len(t.action_ids) for t in self.turns)

    def token_ids(self) -> List[int]:
        """``prompt_ids + a_0 + o_0 + a_1 + o_1 + ...``: the sampled sequence, verbatim."""
        ids = list(self.prompt_ids)
        for t in self.turns:
            ids.extend(t.action_ids)
            ids.extend(t.observation_ids)
        return ids

    def _aligned(self, action_value, other) -> List[Any]:
        """One value per target (``len(token_ids()) - 1``), built turn by turn: the prompt's
        targets get ``other(None)``; turn ``k``'s action targets the list ``action_value(k, t)``
        (one value per action token), its observation targets ``other(k)``."""
        out = [other(None)] * (len(self.prompt_ids) - 1)
        for k, t in enumerate(self.turns):
            out.extend(action_value(k, t))
            out.extend([other(k)] * len(t.observation_ids))
        return out

    def action_mask(self) -> List[int]:
        """1 at targets that are action tokens, 0 at prompt and observation targets."""
        return self._aligned(lambda k, t: [1] * len(t.action_ids), lambda k: 0)

    def behaviour_logp_aligned(self) -> List[float]:
        """The recorded behaviour log-prob at action targets, NaN elsewhere."""
        nan = float("nan")
        return self._aligned(lambda k, t: t.behaviour_logp, lambda k: nan)

    def policy_versions_aligned(self) -> List[int]:
        """The sampling policy version at action targets, ``-1`` elsewhere (§16)."""
        return self._aligned(lambda k, t: [t.policy_version] * len(t.action_ids), lambda k: NO_VERSION)

    def turn_ids_aligned(self) -> List[int]:
        """The index of the turn each target belongs to (its action or observation).

        Prompt targets get 0; they are masked, and 0 keeps the ids valid for ``gather``.
        """
        return self._aligned(lambda k, t: [k] * len(t.action_ids), lambda k: 0 if k is None else k)

    def rewards_per_turn(self) -> List[float]:
        return [t.reward for t in self.turns]

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> Dict[str, Any]:
        return _fields_copy(self, {"turns": [t.to_dict() for t in self.turns]})

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Trajectory":
        if not isinstance(d, dict):
            raise ValueError(f"d: expected a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"task_id", "episode_id", "prompt_ids"} - set(d)
        if missing:
            raise ValueError(f"d: missing keys {sorted(missing)}")
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs["turns"] = [Turn.from_dict(t) for t in d.get("turns", [])]
        return cls(**kwargs)

    def to_json(self) -> str:
        """One line of JSON (no newline inside). Floats round-trip exactly.

        The text of ``json.dumps(self.to_dict(), default=_json_default)``: the fields are
        encoded in place (a copy changes nothing the encoder writes) unless one holds a value
        JSON does not know (a numpy scalar, a set): then the copy and ``default`` do.
        """
        view = _fields_view(self)
        view["turns"] = [_fields_view(t) for t in self.turns]
        try:
            return _ENCODE(view)
        except TypeError:
            return json.dumps(self.to_dict(), default=_json_default, separators=(",", ":"), ensure_ascii=True)

    @classmethod
    def from_json(cls, line: Union[str, bytes]) -> "Trajectory":
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line: not valid JSON ({exc})") from exc
        return cls.from_dict(d)


_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True).encode  # no ``default``: TypeError
_FIELD_NAMES: Dict[type, tuple] = {}


def _fields_view(obj) -> Dict[str, Any]:
    """The dataclass fields as a dict of the objects themselves (no copy)."""
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    return {n: getattr(obj, n) for n in names}


def _fields_copy(obj, given: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The dataclass fields as a dict that shares nothing mutable with ``obj`` (what
    ``dataclasses.asdict`` returns, without walking every int of the token lists)."""
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if given and f.name in given:
            out[f.name] = given[f.name]
            continue
        v = getattr(obj, f.name)
        if isinstance(v, list) and all(x is None or isinstance(x, (int, float, str, bool)) for x in v):
            v = list(v)  # token ids / log-probs: a shallow copy is a full copy
        elif isinstance(v, (dict, list, tuple)):
            v = copy.deepcopy(v)
        out[f.name] = v
    return out


def _scan(path: str) -> tuple[List[int], int]:
    """End offsets of the complete lines of ``path`` and the file size."""
    ends: List[int] = []
    pos = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.readline()
            if not chunk:
                break
            pos += len(chunk)
            if chunk.endswith(b"\n"):
                ends.append(pos)
    return ends, pos


def read_trajectories(path: Union[str, os.PathLike], start: int = 0) -> List[Trajectory]:
    """All complete lines of a log (from line ``start``) as trajectories.

    A torn last line (no final newline: a write interrupted by a crash) is ignored; the
    file is not modified.
    """
    path = os.fspath(path)
    out: List[Trajectory] = []
    with open(path, "rb") as f:
        for n, line in enumerate(f):
            if not line.endswith(b"\n"):
                break  # torn last line
            if n < start:
                continue
            try:
                out.append(Trajectory.from_json(line))
            except ValueError as exc:
                raise ValueError(f"path: line {n + 1} of {path} is not a trajectory ({exc})") from exc
    return out


class TrajectoryLog:
    """Append-only JSONL log of trajectories, durable per append.

    Every :meth:`append` writes one line, flushes it and calls ``os.fsync``: after a
    crash (even SIGKILL) every appended trajectory is readable. A torn last line (a crash
    in the middle of a write) is ignored when reading and cut off when the log is
    reopened. :attr:`offset` is the number of complete lines, the resume point a trainer
    stores in its checkpoint; :meth:`truncate_to` drops the lines written after it.

    One writer per file.
    """

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        if not os.path.exists(self.path):
            open(self.path, "ab").close()
        ends, size = _scan(self.path)
        self._ends = ends
        complete = ends[-1] if ends else 0
        if size != complete:  # torn tail from a crash: drop it
            with open(self.path, "r+b") as f:
                f.truncate(complete)
                f.flush()
                os.fsync(f.fileno())
        self._file = open(self.path, "ab")

    # -------------------------------------------------------------- writing
    def append(self, trajectory: Trajectory) -> int:
        """Append one trajectory durably; returns the new :attr:`offset`."""
        return self.extend([trajectory])

    def extend(self, trajectories: Iterable[Trajectory]) -> int:
        """Append several trajectories with one ``fsync``; returns the new :attr:`offset`."""
        self._check_open()
        lines = []
        for t in trajectories:
            if not isinstance(t, Trajectory):
                raise ValueError(f"trajectories: expected Trajectory objects, got {type(t).__name__}")
            lines.append(t.to_json().encode("ascii") + b"\n")
        if not lines:
            return self.offset
        pos = self._ends[-1] if self._ends else 0
        for line in lines:
            self._file.write(line)
            pos += len(line)
            self._ends.append(pos)
        self._file.flush()
        os.fsync(self._file.fileno())
        return self.offset

    def truncate_to(self, n: int) -> None:
        """Keep the first ``n`` lines (resume from a checkpoint taken at offset ``n``)."""
        self._check_open()
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n > self.offset:
            raise ValueError(f"n: must be an integer in [0, {self.offset}], got {n!r}")
        size = self._ends[n - 1] if n > 0 else 0
        self._file.flush()
        self._file.truncate(size)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.seek(0, os.SEEK_END)
        del self._ends[n:]

    # -------------------------------------------------------------- reading
    @property
    def offset(self) -> int:
        """Number of complete lines (= trajectories) in the log."""
        return len(self._ends)

    def __len__(self) -> int:
        return self.offset

    @staticmethod
    def read(path: Union[str, os.PathLike], start: int = 0) -> List[Trajectory]:
        """The trajectories stored at ``path`` (see :func:`read_trajectories`)."""
        return read_trajectories(path, start)

    def __iter__(self) -> Iterator[Trajectory]:
        self._file.flush()
        return iter(read_trajectories(self.path))

    # -------------------------------------------------------------- lifetime
    def _check_open(self) -> None:
        if self._file.closed:
            raise ValueError("log: the log is closed")

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "TrajectoryLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TrajectoryLog({self.path!r}, offset={self.offset})"
