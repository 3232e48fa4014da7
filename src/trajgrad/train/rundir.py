"""Run directories that cannot be damaged by accident.

One writer at a time: the process that writes a run directory (rank 0 under torchrun)
holds its ``flock`` (:mod:`.runlock`, taken before the directory is read); a second
writer is refused with one line naming the holder.

A run directory holds ``run.json`` (the config the run's checkpoints were made with, its
SHA-256 fingerprint and the history of allowed changes), ``config.json`` (the same config,
for reading), ``checkpoints/``, ``metrics.jsonl`` and ``trajectories.jsonl``.

* A new run refuses an existing, non-empty directory (:func:`check_new_run_dir`) unless
  told to ``overwrite`` it, and overwrites only a trajgrad run directory. Nothing is
  created until every check has passed (:func:`create_run_dir`).
* A resume is checked completely before anything on disk changes (:func:`check_resume`):
  the requested config against the run's (refused, listing the dotted keys that differ,
  unless ``allow_config_change``), the checkpoint's files against the SHA-256 of its
  manifest (a corrupt file is named and the newest intact checkpoint offered), a missing
  ``latest`` (the newest complete checkpoint is used), the checkpoint's offsets against
  ``metrics.jsonl`` and the trajectory logs (every line the checkpoint keeps must be
  present and a JSON object; lines written after it are the replayed steps'). Only then
  does :func:`commit_resume` repoint ``latest`` and record an allowed config change, and
  the trainer truncates the logs to the checkpoint's offsets.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from . import _checkpoint_files as F
from ._dotted import set_dotted
from .checkpoint import list_checkpoints, newest_intact_checkpoint, verify_checkpoint
from .config import build_config, load_config
from .config_checks import check_effective, user_keys
from .runlock import LOCK_FILE, RunDirLock, lock_run_dir

__all__ = [
    "RUN_FILE", "ResumePlan", "config_fingerprint", "config_diff", "check_new_run_dir",
    "create_run_dir", "check_resume", "check_resume_state", "commit_resume", "record_determinism",
    "lock_existing_run_dir",
]

RUN_FILE = "run.json"
_RUN_MARKERS = (RUN_FILE, "config.json", "metrics.jsonl", "trajectories.jsonl", F.CHECKPOINTS)


def _dump(cfg) -> Dict[str, Any]:
    return json.loads(json.dumps(cfg.model_dump(mode="json")))


def config_fingerprint(cfg_or_dict) -> str:
    """SHA-256 of the config's canonical JSON (sorted keys)."""
    data = cfg_or_dict if isinstance(cfg_or_dict, dict) else _dump(cfg_or_dict)
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def config_diff(old: Any, new: Any, prefix: str = "") -> List[str]:
    """``["train.steps: 30 -> 40", ...]``: every dotted key whose value differs."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: List[str] = []
        for k in sorted(set(old) | set(new), key=str):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in old:
                out.append(f"{key}: (absent) -> {new[k]!r}")
            elif k not in new:
                out.append(f"{key}: {old[k]!r} -> (absent)")
            else:
                out.extend(config_diff(old[k], new[k], key))
        return out
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def _is_run_dir(path: Path) -> bool:
    return any((path / m).exists() for m in _RUN_MARKERS)


def lock_existing_run_dir(path) -> Optional[RunDirLock]:
    """Lock ``path`` (:func:`.runlock.lock_run_dir`) when it is a run directory already (or
    holds a lock file); None otherwise, creating nothing: a directory that is not a run is
    refused by the checks, or becomes one (and is locked) in :func:`create_run_dir`.

    Raises:
      RunDirLocked: another live process writes the run (the message names it).
    """
    path = Path(path)
    if path.is_dir() and (_is_run_dir(path) or (path / LOCK_FILE).exists()):
        return lock_run_dir(path)
    return None


def _entries(path: Path) -> List[str]:
    """The directory's entries but the writer's lock file (:mod:`.runlock`)."""
    return sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE)


def check_new_run_dir(path, *, overwrite: bool = False) -> Path:
    """Check that a new run may be written at ``path``; changes nothing on disk.

    Raises ValueError naming ``run_dir``: ``path`` is a file; ``path`` is a non-empty
    directory and ``overwrite`` is false; ``overwrite`` of a non-empty directory that is not
    a trajgrad run directory; no directory can be created there.
    """
    path = Path(path)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise ValueError(f"run_dir: {path} exists and is not a directory")
        entries = _entries(path)
        if entries:
            if not overwrite:
                shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
                raise ValueError(f"run_dir: {path} is not empty ({shown}); continue that run with --resume {path}, "
                                 "or replace it with --overwrite")
            if not _is_run_dir(path):
                raise ValueError(f"run_dir: {path} is not empty and not a trajgrad run directory; "
                                 "--overwrite only replaces run directories")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"run_dir: {path} is not writable")
        return path
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"run_dir: cannot create {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"run_dir: cannot create {path}: {parent} is not writable")
    return path


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    F._write_bytes(tmp, text.encode())
    F._replace(tmp, path)
    F._fsync_dir(path.parent)


def _write_json_atomic(path: Path, data: Any) -> None:
    _write_atomic(path, json.dumps(data, indent=2, sort_keys=True))


def _config_text(cfg) -> str:
    """``config.json`` exactly as the trainer writes it."""
    return json.dumps(cfg.model_dump(), indent=2, default=str)


def _run_record(cfg, history: Optional[list] = None) -> Dict[str, Any]:
    data = _dump(cfg)
    return {"format": 1, "config": data, "config_sha256": config_fingerprint(data),
            "history": history or [{"time": time.time(), "event": "created"}]}


class NewRunDir:
    """What :func:`create_run_dir` made; :meth:`abandon` undoes it if the start then fails,
    :meth:`keep` makes it final (and deletes an overwritten run)."""

    def __init__(self, path: Path, created: bool, trash: Optional[Path], lock: Optional[RunDirLock] = None):
        self.path, self.created, self.trash, self.lock = path, created, trash, lock

    def keep(self) -> None:
        if self.trash is not None:
            shutil.rmtree(self.trash, ignore_errors=True)
            self.trash = None

    def abandon(self) -> None:
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
        if self.trash is not None:
            os.replace(self.trash, self.path)
            self.trash = None


def create_run_dir(path, cfg, *, overwrite: bool = False, lock: Optional[RunDirLock] = None) -> NewRunDir:
    """Create the run directory of a new run (after :func:`check_new_run_dir`), lock it
    (:mod:`.runlock`) and write ``run.json`` and ``config.json``. An overwritten run is
    moved aside, deleted by :meth:`NewRunDir.keep` and put back by
    :meth:`NewRunDir.abandon`. ``lock``: the caller's lock on the existing directory, kept
    when the directory stays the same one (empty before).

    Raises:
      RunDirLocked: another process took the new directory's lock first.
    """
    path = check_new_run_dir(path, overwrite=overwrite)
    trash = None
    if path.is_dir() and _entries(path):
        trash = path.with_name(f".{path.name}.overwritten-{uuid.uuid4().hex[:8]}")
        os.replace(path, trash)
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    if lock is None or not lock.held or trash is not None or created:
        try:
            lock = lock_run_dir(path)
        except ValueError:
            NewRunDir(path, False, trash).abandon()
            raise
    _write_json_atomic(path / RUN_FILE, _run_record(cfg))
    _write_atomic(path / "config.json", _config_text(cfg))
    return NewRunDir(path, created, trash, lock)


# ----------------------------------------------------------------------------- resume


@dataclass
class ResumePlan:
    """A resume that passed every check (see :func:`check_resume`).

    Attributes:
      run_dir: the run directory.
      cfg: the config the run continues with.
      checkpoint: the checkpoint directory it continues from (verified).
      step: that checkpoint's step.
      repoint: ``latest`` must be rewritten to name ``checkpoint``.
      changes: dotted-key differences from the run's config (allowed ones).
      notes: what the resume will do that the user should know (one line each).
    """

    run_dir: Path
    cfg: Any
    checkpoint: Path
    step: int
    repoint: bool = False
    changes: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    record: Dict[str, Any] = field(default_factory=dict)


def _saved_config(run_dir: Path):
    """(reference config dict, run.json record or {}) of an existing run."""
    run_file, cfg_file = run_dir / RUN_FILE, run_dir / "config.json"
    if run_file.exists():
        try:
            record = json.loads(run_file.read_text())
            data = record["config"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"resume: {run_file} is unreadable ({exc})") from None
        if config_fingerprint(data) != record.get("config_sha256"):
            raise ValueError(f"resume: {run_file} does not match its own fingerprint (edited by hand?)")
        return data, record
    if cfg_file.exists():
        try:
            return json.loads(cfg_file.read_text()), {}
        except (OSError, ValueError) as exc:
            raise ValueError(f"resume: {cfg_file} is unreadable ({exc})") from None
    raise ValueError(f"resume: {run_dir} has no {RUN_FILE} or config.json (not a trajgrad run directory)")


def _requested(run_dir: Path, reference: Dict[str, Any], config, preset, overrides):
    """The config the user asks the resumed run to use."""
    if config is not None or preset is not None:
        return load_config(config, preset=preset, overrides=overrides)
    cfg_file = run_dir / "config.json"
    data = copy.deepcopy(reference)
    if cfg_file.exists():  # what the user sees (and may have edited) in the run directory
        try:
            data = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"resume: {cfg_file} is unreadable ({exc})") from None
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value)
    try:
        cfg = build_config(data)
    except ValueError as exc:
        if overrides:
            raise
        raise ValueError(f"resume: the run's config is invalid: {exc}") from None
    keys = [k for key, v in (overrides or {}).items() for k in user_keys(v, key)]
    check_effective(cfg, keys)
    return cfg


def _offer(run_dir: Path, bad: Optional[Path]) -> str:
    good = newest_intact_checkpoint(run_dir, exclude=[bad] if bad is not None else [])
    if good is None:
        return "no intact checkpoint is left; start the run again with --overwrite"
    return (f"the newest intact checkpoint is {good.name}: resume from it with --checkpoint {good.name} "
            "(the steps after it are run again)")


def _pick_checkpoint(run_dir: Path, checkpoint) -> tuple:
    """(verified checkpoint dir, manifest, repoint, notes)."""
    root = F.checkpoint_root(run_dir)
    notes: List[str] = []
    if checkpoint is not None:
        path = Path(checkpoint)
        if not path.is_absolute() and len(path.parts) == 1:
            path = root / path
        if not F.STEP_DIR.match(path.name) or path.parent.resolve() != root.resolve():
            raise ValueError(f"checkpoint: {checkpoint} is not a checkpoint of {run_dir} (expected step-NNNNNN)")
        if not path.is_dir():
            raise ValueError(f"checkpoint: {path} does not exist")
        repoint = True
    else:
        try:
            name = F.read_pointer(root)
        except ValueError as exc:
            raise ValueError(f"{exc}; {_offer(run_dir, None)}") from None
        if name is None:
            found = list_checkpoints(run_dir)
            if not found:
                raise ValueError(f"resume: {run_dir} has no checkpoint to resume from (the run stopped before its "
                                 "first one); start it again with --overwrite")
            path = found[-1]
            notes.append(f"{root / F.LATEST} is missing; resuming from the newest complete checkpoint, {path.name}")
            repoint = True
        else:
            path = F.resolve(root, name)
            repoint = False
    try:
        manifest = verify_checkpoint(path)
    except F.CorruptCheckpoint as exc:
        what = f"the checkpoint {path.name}" if checkpoint is None else f"checkpoint {path.name}"
        raise ValueError(f"checkpoint: {what} is damaged: {exc}; {_offer(run_dir, path)}") from None
    return path, manifest, repoint, notes


def _check_log(path: Path, keep: int, what: str) -> int:
    """Check that ``path`` has ``keep`` complete JSON-object lines; return the total count."""
    if not path.exists():
        if keep:
            raise ValueError(f"resume: {path} is missing; the checkpoint needs its first {keep} {what}")
        return 0
    count = 0
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                break  # torn last line: a write interrupted by the kill
            count += 1
            if count <= keep:
                try:
                    ok = isinstance(json.loads(line), dict)
                except ValueError:
                    ok = False
                if not ok:
                    raise ValueError(f"resume: {path} line {count} is not a JSON record; the checkpoint keeps its "
                                     f"first {keep} {what} (the file is left as it is)")
    if count < keep:
        raise ValueError(f"resume: {path} has {count} complete lines; the checkpoint needs its first {keep} {what} "
                         "(lines are missing; the file is left as it is)")
    return count


@dataclass
class ResumeState:
    """The checkpoint a resume continues from, checked with the logs it cuts (see
    :func:`check_resume_state`)."""

    checkpoint: Path
    step: int
    repoint: bool
    notes: List[str]


def check_resume_state(run_dir, *, checkpoint=None, world_size: Optional[int] = None) -> ResumeState:
    """Check the checkpoint and the logs of ``run_dir`` for a resume; read-only.

    The checkpoint (``checkpoint``, a ``step-NNNNNN`` name, or the one ``latest`` names, or
    the newest complete one when ``latest`` is missing) must pass its SHA-256 check, hold the
    trainer's state, have been saved by ``world_size`` processes, and every log line it keeps
    (``metrics.jsonl``, the trajectory logs) must be present and a JSON record. Call it before
    anything truncates a log: :class:`~trajgrad.train.trainer.Trainer` cuts them right after
    loading the checkpoint. Raises ValueError, one line naming the file, otherwise.
    """
    run_dir = Path(run_dir)
    path, manifest, repoint, notes = _pick_checkpoint(run_dir, checkpoint)
    try:
        extra = json.loads((path / "extra.json").read_text())
        step = int(extra["step"])
        metrics_offset = int(extra["metrics_offset"])
        offsets = [int(o) for o in (extra.get("trajectory_offsets") or [extra["trajectory_offset"]])]
        saved_world = int(extra.get("world_size", 1))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"checkpoint: {path / 'extra.json'} lacks the trainer's state ({exc})") from None
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else int(world_size)
    if saved_world != world:
        raise ValueError(f"resume: the run used {saved_world} process(es); resume it with the same number, not {world}")
    _check_log(run_dir / "metrics.jsonl", metrics_offset, "metrics records")
    for rank, keep in enumerate(offsets):
        name = "trajectories.jsonl" if saved_world == 1 else f"trajectories.rank{rank}.jsonl"
        total = _check_log(run_dir / name, keep, "trajectories")
        if total > keep:
            notes.append(f"{name}: {total - keep} trajectories written after step {step} are dropped from the log and "
                         "sampled again (an asynchronous run trains the ones its checkpoint buffered from that buffer)")
    return ResumeState(checkpoint=path, step=step, repoint=repoint, notes=notes)


def check_resume(run_dir, *, config=None, preset=None, overrides=None, allow_config_change: bool = False,
                 checkpoint=None, world_size: Optional[int] = None) -> ResumePlan:
    """Check everything a resume of ``run_dir`` needs; read-only (see the module docstring).

    Args:
      run_dir: the run directory to continue.
      config, preset, overrides: the config to continue with (as for
        :func:`~trajgrad.train.config.load_config`); ``overrides`` alone apply to the run's own
        config; none of them: the run's own config (``config.json``).
      allow_config_change: accept a config that differs from the run's.
      checkpoint: a checkpoint directory name (``step-000020``) to resume from instead of the
        one ``latest`` names.
      world_size: processes of the resumed run (default ``$WORLD_SIZE`` or 1).

    Raises ValueError, one line naming the key or file, when the resume would fail or
    would continue under a different config.
    """
    if not isinstance(run_dir, (str, os.PathLike)):
        raise ValueError(f"resume: expected a path, got {type(run_dir).__name__}")
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ValueError(f"resume: {run_dir} does not exist")
    if not run_dir.is_dir():
        raise ValueError(f"resume: {run_dir} is not a directory")
    reference, record = _saved_config(run_dir)
    cfg = _requested(run_dir, reference, config, preset, overrides)
    changes = config_diff(reference, _dump(cfg))
    if changes and not allow_config_change:
        shown = "; ".join(changes[:8]) + (f"; ... ({len(changes)} keys)" if len(changes) > 8 else "")
        raise ValueError(f"resume: the config differs from the run's ({shown}); resume with the run's own config "
                         "(no CONFIG, --preset or --set, and config.json as it was), or pass --allow-config-change")
    state = check_resume_state(run_dir, checkpoint=checkpoint, world_size=world_size)
    notes = list(state.notes)
    if changes:
        notes.append("continuing with a changed config: " + "; ".join(changes))
    return ResumePlan(run_dir=run_dir, cfg=cfg, checkpoint=state.checkpoint, step=state.step, repoint=state.repoint,
                      changes=changes, notes=notes, record=record)


def commit_resume(plan: ResumePlan) -> None:
    """Apply what :func:`check_resume` decided: repoint ``latest``, record a config change
    (or write ``run.json`` for a run made before it existed)."""
    if plan.repoint:
        F.write_pointer(F.checkpoint_root(plan.run_dir), plan.checkpoint.name)
    if plan.changes or not plan.record:
        history = list(plan.record.get("history", []))
        history.append({"time": time.time(), "event": "resumed", "step": plan.step, "changed": plan.changes})
        _write_json_atomic(plan.run_dir / RUN_FILE, _run_record(plan.cfg, history))
        _write_atomic(plan.run_dir / "config.json", _config_text(plan.cfg))


def record_determinism(run_dir, settings: Dict[str, Any]) -> None:
    """Store the run's thread counts and deterministic-algorithm switches in ``run.json``
    (:func:`trajgrad.train.seeding.determinism_settings`); a resume under different settings
    is added to the history (the same seed then need not give the same bits). No-op for a
    directory without ``run.json`` (a trainer built outside ``trajgrad train``)."""
    path = Path(run_dir) / RUN_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(record, dict) or record.get("determinism") == settings:
        return
    if record.get("determinism") is not None:
        record.setdefault("history", []).append({"time": time.time(), "event": "determinism changed",
                                                 "was": record["determinism"]})
    record["determinism"] = settings
    _write_json_atomic(path, record)
