r"""Atomic, resumable training checkpoints.

A checkpoint holds everything a run needs to continue as if it had never stopped:

* the trainable weights of every module (a LoRA adapter for a ``peft`` model, only the
  parameters with ``requires_grad`` otherwise, or the full ``state_dict`` on request),
  as ``safetensors``;
* the state of every optimizer (or any object with ``state_dict`` / ``load_state_dict``:
  LR schedulers, gradient scalers), with ``torch.save``;
* the random-number streams of Python ``random``, the NumPy global generator, torch CPU
  and every CUDA device;
* ``extra``, a JSON object for the rest (data cursor, trajectory-log and metrics-log
  offsets, policy version, Lagrange multiplier state, ...).

Layout on disk::

    run_dir/checkpoints/
        latest                        text: directory name of the newest complete checkpoint
        step-000120/
            modules/policy.safetensors
            modules/value_head.safetensors
            optimizers/policy.pt
            rng.pt
            extra.json
            <name>                    any further files given as ``files`` (e.g. async_state.json)
            manifest.json             written last; every file's size and SHA-256

Atomicity. A checkpoint is written into a hidden temporary directory next to its final
place; every file and the directory are ``fsync``-ed, the directory is renamed into place
with ``os.replace`` and only then is ``latest`` rewritten (temporary file, ``fsync``,
``os.replace``). Old checkpoints are deleted only after ``latest`` names the new one. A
process killed at any instant therefore leaves ``latest`` naming a complete checkpoint:
the previous one or the new one, never a torn one. Leftover temporary directories are
swept by the next save.

Integrity. :func:`load_checkpoint` checks every file against the SHA-256 of the manifest
before anything is loaded, so a same-size corruption of weights or optimizer state is
refused (naming the file) instead of resumed silently; :func:`verify_checkpoint` runs the
same check alone and :func:`newest_intact_checkpoint` finds the newest checkpoint that
passes it. When ``latest`` is missing (deleted by hand, or a kill between a directory's
rename and the pointer's write), :func:`latest_checkpoint` falls back to the newest
complete checkpoint.

One process writes a given ``run_dir`` (rank 0 in a distributed run). The file-level
helpers live in :mod:`trajgrad.train._checkpoint_files`, the state capture in
:mod:`trajgrad.train._checkpoint_state`.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Mapping, NamedTuple, Optional

import numpy as np
import torch

from . import _checkpoint_files as F
from . import _checkpoint_state as S
from ._checkpoint_files import CorruptCheckpoint
from ..weights import file_tensors, module_state, module_state_loader

__all__ = [
    "CheckpointState",
    "CorruptCheckpoint",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "verify_checkpoint",
    "newest_intact_checkpoint",
]

# names kept for code that imported them from here
FORMAT_VERSION = F.FORMAT_VERSION
CHECKPOINTS = F.CHECKPOINTS
LATEST = F.LATEST
MANIFEST = F.MANIFEST
_read_manifest = F.read_manifest


class CheckpointState(NamedTuple):
    """What :func:`load_checkpoint` returns.

    Attributes:
      step: the training step the checkpoint was saved at.
      extra: the JSON object passed as ``extra`` to :func:`save_checkpoint`.
      path: the checkpoint directory that was loaded.
    """

    step: int
    extra: Dict[str, Any]
    path: Path


def _run_dir(run_dir) -> Path:
    if not isinstance(run_dir, (str, os.PathLike)):
        raise ValueError(f"run_dir: expected a path, got {type(run_dir).__name__}")
    return Path(run_dir)


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ValueError(f"step: expected a non-negative int, got {step!r}")
    if step < 0:
        raise ValueError(f"step: expected a non-negative int, got {step}")
    return int(step)


# ----------------------------------------------------------------------------- finding


def list_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoints of ``run_dir`` (every file present with its size), oldest first
    (by save time)."""
    root = F.checkpoint_root(_run_dir(run_dir))
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        if F.STEP_DIR.match(entry.name):
            try:
                manifest = F.read_manifest(entry)
            except F.CorruptCheckpoint:
                continue
            found.append((manifest.get("saved_at_ns", 0), manifest["step"], entry))
    return [p for _, _, p in sorted(found)]


def latest_checkpoint(run_dir) -> Optional[Path]:
    """Directory of the newest complete checkpoint of ``run_dir``, or None if there is none.

    The checkpoint ``checkpoints/latest`` names; when ``latest`` is missing, the newest
    complete checkpoint by save time. Raises ValueError naming ``run_dir`` if ``latest``
    exists but does not name a complete checkpoint.
    """
    run_dir = _run_dir(run_dir)
    root = F.checkpoint_root(run_dir)
    name = F.read_pointer(root)
    if name is None:
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = F.resolve(root, name)
    try:
        F.read_manifest(path)
    except F.CorruptCheckpoint as exc:
        raise ValueError(f"run_dir: {root / F.LATEST} names a corrupt checkpoint: {exc}") from None
    return path


def verify_checkpoint(path) -> dict:
    """Check every file of the checkpoint directory ``path`` against its manifest (size and
    SHA-256); return the manifest. Raises :class:`CorruptCheckpoint` (its ``file`` the
    offending file) otherwise."""
    return F.read_manifest(Path(path), verify=True)


def newest_intact_checkpoint(run_dir, *, exclude=()) -> Optional[Path]:
    """The newest checkpoint of ``run_dir`` (by save time) that passes
    :func:`verify_checkpoint`, skipping the directories in ``exclude``; None if none does."""
    skip = {Path(p).resolve() for p in exclude}
    for path in reversed(list_checkpoints(run_dir)):
        if path.resolve() in skip:
            continue
        try:
            verify_checkpoint(path)
        except F.CorruptCheckpoint:
            continue
        return path
    return None


# ----------------------------------------------------------------------------- save


def _sweep(root: Path) -> None:
    """Remove temporary and trash entries left by an interrupted save (not the one
    ``latest`` may name)."""
    try:
        keep = F.read_pointer(root)
    except ValueError:
        keep = None
    for entry in root.iterdir():
        name = entry.name
        if name == keep:
            continue
        if name.startswith(F.TMP_PREFIX) or name.startswith(F.TRASH_PREFIX):
            F._rmtree(entry)
        elif name.startswith(F.LATEST + F.TMP_PREFIX):
            try:
                entry.unlink()
            except OSError:
                pass


def _prune(root: Path, keep: Optional[int], current: str) -> None:
    if keep is None:
        return
    ranked = []
    for entry in root.iterdir():
        if not F.STEP_DIR.match(entry.name) or entry.name == current:
            continue
        try:
            saved = F.read_manifest(entry).get("saved_at_ns", 0)
        except F.CorruptCheckpoint:
            saved = -1  # not loadable: first to go
        ranked.append((saved, entry))
    ranked.sort(key=lambda item: item[0], reverse=True)
    for _, entry in ranked[keep - 1 :]:
        trash = root / f"{F.TRASH_PREFIX}{entry.name}-{uuid.uuid4().hex[:8]}"
        F._replace(entry, trash)
        F._rmtree(trash)
    F._fsync_dir(root)


def save_checkpoint(
    run_dir,
    step: int,
    *,
    model: Optional[torch.nn.Module] = None,
    optimizer: Any = None,
    modules: Optional[Mapping[str, torch.nn.Module]] = None,
    optimizers: Optional[Mapping[str, Any]] = None,
    extra: Optional[Mapping[str, Any]] = None,
    trainable_only: bool = True,
    keep: Optional[int] = 2,
    files: Optional[Mapping[str, bytes]] = None,
) -> Path:
    """Atomically write ``run_dir/checkpoints/step-{step:06d}/`` and point ``latest`` at it.

    Args:
      run_dir: the run directory (created if missing).
      step: non-negative training step; names the directory.
      model: shorthand for ``modules={"policy": model}``.
      optimizer: shorthand for ``optimizers={"policy": optimizer}``.
      modules: name -> ``torch.nn.Module`` (policy, value head, ...). DDP / DataParallel /
        ``torch.compile`` wrappers are removed before saving. Per module, with
        ``trainable_only``: a ``peft`` model saves its active adapter
        (``peft.get_peft_model_state_dict``), any other module its parameters with
        ``requires_grad`` (buffers are not saved); without it, the full ``state_dict``.
      optimizers: name -> object with ``state_dict()`` / ``load_state_dict()`` (optimizers,
        LR schedulers, gradient scalers), saved with ``torch.save``.
      extra: JSON-serializable dict (tensors and NumPy scalars become numbers / lists).
      trainable_only: see ``modules``.
      keep: number of newest checkpoints kept (>= 1; the new one always counts); None
        keeps all. Older ones are deleted after the new one is in place.
      files: more files of the checkpoint, name -> bytes (a name matching
        ``[A-Za-z0-9_.-]+``, none of the checkpoint's own): written, checksummed and listed
        in the manifest like the others, so they are part of the checkpoint or absent with it.

    Returns:
      The checkpoint directory.

    The Python ``random``, NumPy global, torch CPU and (when available) CUDA RNG states are
    saved too. Saving the same step twice replaces the older copy atomically.
    """
    run_dir = _run_dir(run_dir)
    step = _check_step(step)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep: expected an int >= 1 or None, got {keep!r}")
    modules = S._collect("modules", modules, "model", model, torch.nn.Module)
    optimizers = S._collect("optimizers", optimizers, "optimizer", optimizer, None)
    extra_bytes = S._dump_extra(extra)
    more = S._check_files(files)

    root = F.checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    _sweep(root)
    name = f"step-{step:06d}"
    tmp = root / f"{F.TMP_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files: Dict[str, dict] = {}
        module_entries: Dict[str, dict] = {}
        (tmp / "modules").mkdir()
        (tmp / "optimizers").mkdir()
        for mname, module in modules.items():
            kind, state, adapter = module_state(module, trainable_only)
            rel = f"modules/{mname}.safetensors"
            meta = {"kind": kind, "adapter": adapter or "", "step": str(step)}
            files[rel] = F.file_entry(tmp / rel, F._write_safetensors(tmp / rel, file_tensors(mname, state), meta))
            module_entries[mname] = {"kind": kind, "adapter": adapter, "file": rel, "tensors": len(state)}
        opt_entries: Dict[str, dict] = {}
        for oname, opt in optimizers.items():
            rel = f"optimizers/{oname}.pt"
            files[rel] = F.file_entry(tmp / rel, F._write_torch(tmp / rel, opt.state_dict()))
            opt_entries[oname] = {"file": rel, "type": type(opt).__name__}
        files["rng.pt"] = F.file_entry(tmp / "rng.pt", F._write_torch(tmp / "rng.pt", S._capture_rng()))
        files["extra.json"] = F.file_entry(tmp / "extra.json", F._write_bytes(tmp / "extra.json", extra_bytes))
        for fname, data in more.items():
            files[fname] = F.file_entry(tmp / fname, F._write_bytes(tmp / fname, data))
        manifest = {
            "format": F.FORMAT_VERSION,
            "step": step,
            "saved_at_ns": time.time_ns(),
            "trainable_only": bool(trainable_only),
            "modules": module_entries,
            "optimizers": opt_entries,
            "files": files,
            "torch": torch.__version__,
        }
        F._write_bytes(tmp / F.MANIFEST, json.dumps(manifest, indent=1).encode())
        F._fsync_dir(tmp / "modules")
        F._fsync_dir(tmp / "optimizers")
        F._fsync_dir(tmp)
    except BaseException:
        F._rmtree(tmp)
        raise

    final = root / name
    if final.exists():
        # Re-saving a step: ``latest`` names the complete temporary copy while the old
        # directory is moved aside; when the copy is renamed into place, ``_resolve``
        # follows the temporary name to the final one. No instant exists at which
        # ``latest`` leads to an incomplete checkpoint.
        F.write_pointer(root, tmp.name)
        trash = root / f"{F.TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        F._replace(final, trash)
        F._replace(tmp, final)
        F._fsync_dir(root)
        F.write_pointer(root, name)
        F._rmtree(trash)
    else:
        F._replace(tmp, final)
        F._fsync_dir(root)
        F.write_pointer(root, name)
    _prune(root, keep, current=name)
    return final


# ----------------------------------------------------------------------------- load


def load_checkpoint(
    run_dir,
    *,
    model: Optional[torch.nn.Module] = None,
    optimizer: Any = None,
    modules: Optional[Mapping[str, torch.nn.Module]] = None,
    optimizers: Optional[Mapping[str, Any]] = None,
    restore_rng: bool = True,
    path=None,
) -> CheckpointState:
    """Load the checkpoint ``latest`` names (or ``path``) into the given objects, in place.

    Args:
      run_dir: the run directory given to :func:`save_checkpoint`.
      model, optimizer, modules, optimizers: as in :func:`save_checkpoint`. Every name given
        must be in the checkpoint; names in the checkpoint but not given are skipped.
      restore_rng: also restore the Python, NumPy, torch CPU and CUDA RNG streams.
      path: load this checkpoint directory instead of the one ``latest`` names.

    Returns:
      ``CheckpointState(step, extra, path)``.

    Raises ValueError naming ``run_dir`` when there is no checkpoint or it is corrupt (a
    file missing, of the wrong size or with a SHA-256 other than the manifest's), and
    naming ``modules`` / ``optimizers`` when an object does not match what was saved.
    Everything is read and checked before anything is modified.
    """
    run_dir = _run_dir(run_dir)
    modules = S._collect("modules", modules, "model", model, torch.nn.Module)
    optimizers = S._collect("optimizers", optimizers, "optimizer", optimizer, None)
    if path is None:
        path = latest_checkpoint(run_dir)
        if path is None:
            raise ValueError(f"run_dir: no checkpoint in {run_dir} (missing {F.checkpoint_root(run_dir) / F.LATEST})")
    else:
        path = Path(path)
    try:
        manifest = F.read_manifest(path, verify=True)
    except F.CorruptCheckpoint as exc:
        raise ValueError(f"run_dir: corrupt checkpoint: {exc}") from None

    from safetensors.torch import load_file

    appliers = []
    for mname, module in modules.items():
        entry = manifest["modules"].get(mname)
        if entry is None:
            raise ValueError(f"modules: {mname!r} is not in the checkpoint {path} (has {sorted(manifest['modules'])})")
        try:
            state = load_file(str(path / entry["file"]), device="cpu")
        except Exception as exc:
            raise ValueError(f"run_dir: corrupt checkpoint: cannot read {path / entry['file']} ({exc})") from None
        appliers.append(module_state_loader(mname, module, entry["kind"], state, adapter=entry.get("adapter")))
    opt_states = []
    for oname, opt in optimizers.items():
        entry = manifest["optimizers"].get(oname)
        if entry is None:
            raise ValueError(
                f"optimizers: {oname!r} is not in the checkpoint {path} (has {sorted(manifest['optimizers'])})"
            )
        try:
            state = torch.load(path / entry["file"], map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"run_dir: corrupt checkpoint: cannot read {path / entry['file']} ({exc})") from None
        if isinstance(opt, torch.optim.Optimizer):
            saved = [len(g.get("params", ())) for g in state.get("param_groups", ())]
            own = [len(g["params"]) for g in opt.param_groups]
            if saved != own:
                raise ValueError(
                    f"optimizers: {oname!r} has parameter groups of sizes {own}, the checkpoint has {saved}"
                )
        opt_states.append((oname, opt, state))
    try:
        extra = json.loads((path / "extra.json").read_text())
        rng = torch.load(path / "rng.pt", map_location="cpu", weights_only=True) if restore_rng else None
    except Exception as exc:
        raise ValueError(f"run_dir: corrupt checkpoint: {path} ({exc})") from None

    for apply in appliers:
        apply()
    for oname, opt, state in opt_states:
        try:
            opt.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise ValueError(f"optimizers: {oname!r} does not match the checkpoint ({exc})") from exc
    if rng is not None:
        S._restore_rng(rng)
    return CheckpointState(step=int(manifest["step"]), extra=extra, path=path)
