"""Reading a run directory for ``trajgrad view``: trajectories, metrics, config, token log.

A run directory (:mod:`trajgrad.train.rundir`) holds ``trajectories.jsonl`` (one
:class:`~trajgrad.rollout.Trajectory` per line; ``trajectories.rank{r}.jsonl`` per rank in a
distributed run), ``metrics.jsonl``, ``config.json`` / ``run.json`` (the config) and, when
``log.token_log`` is on, the per-token sidecar ``tokens.jsonl``
(:mod:`trajgrad.train.tokenlog`). Everything but the trajectories is optional: a missing or
unreadable file is reported in :attr:`RunFiles.notes`, never fatal, and torn last lines (a
killed process) are ignored, as every log of the trainer allows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..rollout.trajectory import Trajectory
from ..train.metrics import read_metrics
from ..train.tokenlog import read_token_log

__all__ = ["RunFiles", "read_run"]

TokenKey = Tuple[str, int]  # (episode_id, segment)


@dataclass
class RunFiles:
    """What a run directory holds, as read.

    Attributes:
      path: the run directory.
      trajectories: ``(file name, line number, Trajectory)`` in file order.
      total_trajectories: how many complete lines the trajectory logs hold (may exceed
        ``len(trajectories)`` when reading stopped at ``max_trajectories``).
      metrics: the records of ``metrics.jsonl`` (``[]`` if absent).
      config: the run's config as a dict (``config.json``, else ``run.json``'s), or None.
      tokens: token-log records by ``(episode_id, segment)``, in step order.
      token_log_capped_at: the step from which the token log is missing (its size cap), or None.
      notes: one line per file that was missing or unreadable.
    """

    path: Path
    trajectories: List[Tuple[str, int, Trajectory]] = field(default_factory=list)
    total_trajectories: int = 0
    metrics: List[Dict[str, Any]] = field(default_factory=list)
    config: Optional[Dict[str, Any]] = None
    tokens: Dict[TokenKey, List[Dict[str, Any]]] = field(default_factory=dict)
    token_log_capped_at: Optional[int] = None
    notes: List[str] = field(default_factory=list)


def _trajectory_files(path: Path) -> List[Path]:
    single = path / "trajectories.jsonl"
    ranks = sorted(path.glob("trajectories.rank*.jsonl"))
    return ([single] if single.is_file() else []) + ranks


def _environment_of(line: bytes) -> Optional[str]:
    """``metadata["environment"]`` of one trajectory line (a run with several environments), or None."""
    try:
        md = json.loads(line).get("metadata") or {}
    except (ValueError, AttributeError):
        return None
    env = md.get("environment") if isinstance(md, dict) else None
    return env if isinstance(env, str) else None


def _read_trajectories(files: List[Path], limit: Optional[int], notes: List[str], environment: Optional[str] = None):
    """The last ``limit`` trajectories (all when None) over ``files``, and the total count;
    with ``environment``, only that environment's (ValueError naming ``environment`` when it
    has none, listing the run's environments)."""
    out: List[Tuple[str, int, Trajectory]] = []
    total = 0
    seen = set()
    for f in files:
        with open(f, "rb") as fh:
            for n, line in enumerate(fh, start=1):
                if not line.endswith(b"\n"):
                    break  # torn last line
                total += 1
                if environment is not None:
                    env = _environment_of(line)
                    seen.add(env)
                    if env != environment:
                        continue
                out.append((f.name, n, line))
                if limit is not None and len(out) > 2 * limit:
                    out = out[-limit:]
    if environment is not None and not out:
        known = ", ".join(sorted(e for e in seen if e is not None)) or "none: the run has one task"
        raise ValueError(f"environment: no trajectory of environment {environment!r} in the run (environments: {known})")
    if limit is not None:
        out = out[-limit:]
    parsed = []
    for name, n, line in out:
        try:
            parsed.append((name, n, Trajectory.from_json(line)))
        except ValueError as exc:
            notes.append(f"{name} line {n}: not a trajectory ({' '.join(str(exc).split())[:160]})")
    return parsed, total


def _read_config(path: Path, notes: List[str]) -> Optional[Dict[str, Any]]:
    for name in ("config.json", "run.json"):
        p = path / name
        if not p.is_file():
            continue
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            notes.append(f"{name}: unreadable ({exc})")
            continue
        if name == "run.json" and isinstance(data, dict):
            data = data.get("config")
        if isinstance(data, dict):
            return data
    notes.append("config.json: absent (no objective, token ids shown without text)")
    return None


def read_run(run_dir, *, max_trajectories: Optional[int] = None, environment: Optional[str] = None) -> RunFiles:
    """Read a run directory.

    Args:
      run_dir: the directory ``trajgrad train`` wrote.
      max_trajectories: keep only the last this many trajectories (None: all).
      environment: keep only the trajectories of this environment (a run with several
        environments, ``tasks:``; each trajectory's ``metadata["environment"]``).

    Raises:
      ValueError naming ``run_dir``: it is not a directory, or it holds no trajectory log,
      or the log holds no trajectory.
    """
    path = Path(run_dir)
    if not path.exists():
        raise ValueError(f"run_dir: {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"run_dir: {str(path)!r} is not a directory")
    files = _trajectory_files(path)
    if not files:
        raise ValueError(f"run_dir: {str(path)!r} has no trajectories.jsonl (is it a trajgrad run directory?)")
    run = RunFiles(path=path)
    run.trajectories, run.total_trajectories = _read_trajectories(files, max_trajectories, run.notes, environment)
    if not run.trajectories:
        raise ValueError(f"run_dir: {str(path)!r} has no trajectories yet ({', '.join(f.name for f in files)} "
                         "holds no complete line)")
    try:
        run.metrics = read_metrics(path)
    except ValueError as exc:
        run.notes.append(" ".join(str(exc).split()).removeprefix("run_dir: "))
    run.config = _read_config(path, run.notes)
    token_files = sorted(path.glob("tokens*.jsonl"))
    if not token_files:
        run.notes.append("tokens.jsonl: absent (log.token_log off, or a run from before it): "
                         "per-token advantages, ratios and clip flags are not shown")
    wanted = {(t.episode_id, t.segment) for _, _, t in run.trajectories}
    for tf in token_files:
        for rec in read_token_log(tf):
            if rec.get("capped"):
                step = int(rec.get("step", 0))
                run.token_log_capped_at = step if run.token_log_capped_at is None else min(step, run.token_log_capped_at)
                continue
            key = (str(rec.get("episode_id")), int(rec.get("segment", 0)))
            if key in wanted:
                run.tokens.setdefault(key, []).append(rec)
    return run
