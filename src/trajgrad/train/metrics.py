"""Crash-safe metrics log: one JSON object per line, mirrored to TensorBoard and trackers.

``run_dir/metrics.jsonl`` holds one record per :meth:`MetricsLogger.log` call::

    {"step": 12, "kind": "train", "time": 1767225600.5, "wall_time": 84.2,
     "loss": 0.31, "reward/mean": 0.5, "clip_frac/pos_high": 0.02, ...}

``time`` is the Unix time of the call; ``wall_time`` the seconds the run has been logging,
summed over every process that appended to the file (it continues from the last kept
record after a resume, so the time a job spent dead is not counted). It is the x-axis of
equal-wall-clock comparisons (:func:`trajgrad.view.plot.plot_compare`).

Every line is flushed and ``fsync``-ed before :meth:`~MetricsLogger.log` returns, so a
killed process loses at most the line being written. :attr:`MetricsLogger.offset` (the
number of complete lines) goes into a checkpoint's ``extra``; a resumed run passes it
back as ``resume_offset`` and the file is cut to exactly what the checkpoint had seen,
dropping the lines of the steps that will be replayed (and a torn last line).

One process writes a given ``run_dir`` (rank 0 in a distributed run).

The JSONL file is the source of truth. TensorBoard and the experiment trackers of
``log.backends`` (Weights & Biases offline, MLflow's local file store, trackio;
:mod:`trajgrad.train.tracking`) are sinks: each record goes to them after its line is on
disk, and a sink that fails is disabled with a warning while the JSONL log goes on.
"""
from __future__ import annotations

import atexit
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from .tracking import build_sinks

__all__ = ["MetricsLogger", "read_metrics", "METRICS_FILE", "RESERVED_KEYS"]

METRICS_FILE = "metrics.jsonl"
RESERVED_KEYS = ("step", "kind", "time", "wall_time")


def _metrics_path(run_dir) -> Path:
    if not isinstance(run_dir, (str, os.PathLike)):
        raise ValueError(f"run_dir: expected a path, got {type(run_dir).__name__}")
    path = Path(run_dir)
    return path if path.is_file() else path / METRICS_FILE


def _complete_lines(path: Path) -> Iterator[Tuple[int, bytes]]:
    """Yield (end byte offset, line without newline) for every newline-terminated line."""
    end = 0
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                return  # torn last line: a write interrupted by a crash
            end += len(line)
            yield end, line[:-1]


def _parse(path: Path, number: int, line: bytes, name: str = "run_dir") -> Dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"{name}: {path} line {number} is not valid JSON ({exc})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{name}: {path} line {number} is not a JSON object")
    return record


def read_metrics(run_dir, *, kind: Optional[str] = None) -> List[Dict[str, Any]]:
    """All complete records of ``run_dir/metrics.jsonl`` (or of the file ``run_dir``).

    A torn last line (no terminating newline) is ignored. Records are returned in file
    order; with ``kind`` only those of that kind ("train", "eval", ...).

    Raises ValueError naming ``run_dir`` if the file is missing or a complete line is not
    a JSON object.
    """
    path = _metrics_path(run_dir)
    if not path.is_file():
        raise ValueError(f"run_dir: no metrics file at {path}")
    records = []
    for number, (_, line) in enumerate(_complete_lines(path), start=1):
        if not line.strip():
            continue
        record = _parse(path, number, line)
        if kind is None or record.get("kind", "train") == kind:
            records.append(record)
    return records


def _scalar(key: str, value: Any) -> Any:
    """A JSON value for one metric: numbers, bools, strings and None."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metrics: {key!r} is a tensor of shape {tuple(value.shape)}; log scalars")
        value = value.detach().cpu().item()
    elif isinstance(value, np.ndarray):
        if value.size != 1:
            raise ValueError(f"metrics: {key!r} is an array of shape {value.shape}; log scalars")
        value = value.reshape(()).item()
    elif isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"metrics: {key!r} has unsupported type {type(value).__name__}")


def _flatten(metrics: Mapping[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"metrics: keys must be non-empty strings, got {key!r}")
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, name + "/")
        else:
            yield name, value


class MetricsLogger:
    """Append metrics records to ``run_dir/metrics.jsonl`` and TensorBoard.

    Args:
      run_dir: run directory (created if missing).
      tensorboard: also write numeric values as TensorBoard scalars to ``run_dir/tb``
        (skipped with a warning when the ``tensorboard`` package is missing).
      resume_offset: cut the file to its first ``resume_offset`` complete lines before
        appending (the :attr:`offset` stored in the checkpoint being resumed). When None,
        only a torn last line is removed. TensorBoard events at steps after the last kept
        record are purged.
      sinks: experiment trackers (:class:`trajgrad.train.tracking.Sink`), each given every
        record after it is written; see :meth:`for_config`.

    Use as a context manager or call :meth:`close`.
    """

    def __init__(self, run_dir, *, tensorboard: bool = True, resume_offset: Optional[int] = None,
                 sinks: Sequence[Any] = ()):
        if not isinstance(run_dir, (str, os.PathLike)):
            raise ValueError(f"run_dir: expected a path, got {type(run_dir).__name__}")
        if resume_offset is not None and (
            isinstance(resume_offset, bool) or not isinstance(resume_offset, (int, np.integer)) or resume_offset < 0
        ):
            raise ValueError(f"resume_offset: expected a non-negative int or None, got {resume_offset!r}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE

        lines, keep_bytes, last = 0, 0, None
        if self.path.exists():
            for end, line in _complete_lines(self.path):
                if resume_offset is not None and lines == resume_offset:
                    break
                lines, keep_bytes, last = lines + 1, end, line
            if resume_offset is not None and lines < resume_offset:
                raise ValueError(
                    f"resume_offset: {self.path} has only {lines} complete lines, cannot resume at {resume_offset}"
                )
            if self.path.stat().st_size != keep_bytes:
                with open(self.path, "r+b") as fh:
                    fh.truncate(keep_bytes)
                    fh.flush()
                    os.fsync(fh.fileno())
        elif resume_offset:
            raise ValueError(f"resume_offset: {self.path} does not exist, cannot resume at {resume_offset}")

        last_record = _parse(self.path, lines, last, name="run_dir") if last and last.strip() else {}
        self._offset = lines
        self._wall_base = float(last_record.get("wall_time", 0.0) or 0.0)
        self._t0 = time.monotonic()
        self._fh = open(self.path, "ab")

        self._sinks = list(sinks)
        if self._sinks:  # trackers finish their runs (flush, mark them ended) even if close() is never called
            atexit.register(self.close)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # tensorboard is an optional dependency
                warnings.warn(f"TensorBoard logging disabled ({exc})", stacklevel=2)
            else:
                purge = None
                if resume_offset is not None and "step" in last_record:
                    purge = int(last_record["step"]) + 1
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=purge, flush_secs=10)

    # ------------------------------------------------------------------ properties
    @property
    def offset(self) -> int:
        """Number of complete lines in ``metrics.jsonl`` (store it in checkpoints)."""
        return self._offset

    @property
    def wall_time(self) -> float:
        """Seconds of logging so far, continued across resumes."""
        return self._wall_base + (time.monotonic() - self._t0)

    @property
    def sinks(self) -> List[Any]:
        """The experiment-tracker sinks (:mod:`trajgrad.train.tracking`); each has ``.error``."""
        return list(self._sinks)

    @classmethod
    def for_config(cls, run_dir, cfg, *, resume_offset: Optional[int] = None) -> "MetricsLogger":
        """The logger of a run with :class:`~trajgrad.train.config.Config` ``cfg``: TensorBoard
        when ``log.tensorboard`` or ``"tensorboard"`` in ``log.backends``, and a sink for each
        of wandb / mlflow / trackio in ``log.backends`` (offline, under ``run_dir``)."""
        log = cfg.log
        sinks = build_sinks(log.backends, run_dir, project=log.project, run_name=cfg.name,
                            config=cfg.model_dump(mode="json"))
        return cls(run_dir, tensorboard=log.tensorboard or "tensorboard" in log.backends,
                   resume_offset=resume_offset, sinks=sinks)

    @property
    def closed(self) -> bool:
        return self._fh is None

    # ------------------------------------------------------------------ logging
    def log(self, step: int, metrics: Mapping[str, Any], *, kind: str = "train") -> Dict[str, Any]:
        """Append one record and return it.

        Args:
          step: non-negative training step (the x-axis of every plot).
          metrics: name -> scalar (Python / NumPy number, one-element tensor, bool, str,
            None). Nested dicts are flattened with "/" ("reward": {"mean": x} ->
            "reward/mean"). The keys step, kind, time, wall_time are reserved.
          kind: "train", "eval", or any other label for the record.
        """
        if self._fh is None:
            raise ValueError("MetricsLogger: log() called after close()")
        if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
            step = step.item()
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step: expected a non-negative int, got {step!r}")
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"kind: expected a non-empty string, got {kind!r}")
        if not isinstance(metrics, Mapping):
            raise ValueError(f"metrics: expected a dict, got {type(metrics).__name__}")
        now = time.time()
        record: Dict[str, Any] = {"step": int(step), "kind": kind, "time": now, "wall_time": self.wall_time}
        for key, value in _flatten(metrics):
            if key in RESERVED_KEYS:
                raise ValueError(f"metrics: key {key!r} is reserved")
            record[key] = _scalar(key, value)
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        self._fh.write(data)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._offset += 1

        if self._tb is not None:
            for key, value in record.items():
                if key in RESERVED_KEYS or isinstance(value, str) or value is None:
                    continue
                self._tb.add_scalar(self._tag(kind, key), float(value), global_step=int(step), walltime=now)
        for sink in self._sinks:  # after the JSONL line is on disk; a failing sink disables itself
            sink.log(int(step), record, kind)
        return record

    @staticmethod
    def _tag(kind: str, key: str) -> str:
        if kind == "train" or key.startswith(kind + "/"):
            return key
        return f"{kind}/{key}"

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._sinks:
            atexit.unregister(self.close)
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsLogger({str(self.run_dir)!r}, offset={self._offset})"

