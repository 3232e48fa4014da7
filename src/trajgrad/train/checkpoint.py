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
            manifest.json             written last; lists every file and its size

Atomicity. A checkpoint is written into a hidden temporary directory next to its final
place; every file and the directory are ``fsync``-ed, the directory is renamed into place
with ``os.replace`` and only then is ``latest`` rewritten (temporary file, ``fsync``,
``os.replace``). Old checkpoints are deleted only after ``latest`` names the new one. A
process killed at any instant therefore leaves ``latest`` naming a complete checkpoint:
the previous one or the new one, never a torn one. Leftover temporary directories are
swept by the next save.

One process writes a given ``run_dir`` (rank 0 in a distributed run).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Dict, Mapping, NamedTuple, Optional

import numpy as np
import torch

__all__ = [
    "CheckpointState",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
]

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


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


class _Corrupt(Exception):
    """A checkpoint directory that is not a complete checkpoint (internal)."""


# ----------------------------------------------------------------------------- durable I/O
# Every operation that changes what is on disk goes through these few functions, so that
# tests can inject a crash between any two of them.


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - e.g. some network file systems
        pass
    finally:
        os.close(fd)


def _replace(src: Path, dst: Path) -> None:
    os.replace(src, dst)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _write_bytes(path: Path, data: bytes) -> int:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return len(data)


def _write_torch(path: Path, obj: Any) -> int:
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return path.stat().st_size


def _write_safetensors(path: Path, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> int:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    _fsync_file(path)
    return path.stat().st_size


def _write_pointer(root: Path, name: str) -> None:
    tmp = root / f"{LATEST}{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    _write_bytes(tmp, (name + "\n").encode())
    _replace(tmp, root / LATEST)
    _fsync_dir(root)


# ----------------------------------------------------------------------------- validation


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


def _collect(name: str, mapping, single_name: str, single, kind: type | None) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if mapping is not None:
        if not isinstance(mapping, Mapping):
            raise ValueError(f"{name}: expected a dict of name -> object, got {type(mapping).__name__}")
        out.update(mapping)
    if single is not None:
        if "policy" in out:
            raise ValueError(f"{single_name}: is shorthand for {name}['policy'], which is also given")
        out = {"policy": single, **out}
    for key, obj in out.items():
        if not isinstance(key, str) or not _NAME.match(key):
            raise ValueError(f"{name}: name {key!r} must match [A-Za-z0-9_.-]+ (it becomes a file name)")
        if kind is not None and not isinstance(obj, kind):
            raise ValueError(f"{name}: {key!r} is a {type(obj).__name__}, expected a {kind.__name__}")
        if kind is None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ValueError(f"{name}: {key!r} ({type(obj).__name__}) has no state_dict/load_state_dict")
    return out


def _json_default(obj):
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu()
        return obj.item() if obj.numel() == 1 and obj.ndim == 0 else obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _dump_extra(extra) -> bytes:
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"extra: expected a dict, got {type(extra).__name__}")
    try:
        return json.dumps(dict(extra), default=_json_default, indent=1, sort_keys=True).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extra: must be JSON-serializable ({exc})") from exc


# ----------------------------------------------------------------------------- module states


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DataParallel / DistributedDataParallel / torch.compile wrappers."""
    while True:
        if isinstance(module, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            module = module.module
        elif type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
            module = module._orig_mod
        else:
            return module


def _is_peft(module: torch.nn.Module) -> bool:
    if "peft" not in sys.modules:  # a PeftModel cannot exist without peft imported
        return False
    from peft import PeftModel

    return isinstance(module, PeftModel)


def _peft_adapter_name(module) -> str:
    name = getattr(module, "active_adapter", "default")
    return name if isinstance(name, str) else "default"


def _module_state(module: torch.nn.Module, trainable_only: bool):
    """Return (kind, state, adapter_name) for one module."""
    module = _unwrap(module)
    if trainable_only and _is_peft(module):
        from peft import get_peft_model_state_dict

        adapter = _peft_adapter_name(module)
        return "peft", get_peft_model_state_dict(module, adapter_name=adapter), adapter
    if trainable_only:
        state = {n: p for n, p in module.named_parameters() if p.requires_grad}
        return "trainable", state, None
    return "full", module.state_dict(), None


def _file_tensors(name: str, state: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """CPU, contiguous tensors that share no storage (a safetensors requirement)."""
    out: Dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"modules: {name!r} state entry {key!r} is not a tensor")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        storage = t.untyped_storage()
        whole = (
            t.is_contiguous()
            and t.storage_offset() == 0
            and t.numel() * t.element_size() == storage.nbytes()
        )
        ptr = storage.data_ptr()
        if not whole or ptr in seen or t.numel() == 0:
            t = t.clone(memory_format=torch.contiguous_format)
        else:
            seen.add(ptr)
        out[key] = t
    return out


def _load_module(name: str, module: torch.nn.Module, entry: dict, state: Dict[str, torch.Tensor]):
    """Check that ``state`` fits ``module``; return a closure that copies it in."""
    module = _unwrap(module)
    kind = entry["kind"]
    if kind == "peft":
        if not _is_peft(module):
            raise ValueError(f"modules: {name!r} was saved as a peft adapter but is a {type(module).__name__}")

        def apply():
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(module, state, adapter_name=entry.get("adapter") or "default")
            unexpected = list(getattr(result, "unexpected_keys", []) or [])
            if unexpected:
                raise ValueError(f"modules: {name!r} adapter keys not in the model: {unexpected[:5]}")

        return apply
    if kind == "full":
        own = module.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"modules: {name!r} does not match the checkpoint "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
        for key, t in state.items():
            if isinstance(own[key], torch.Tensor) and tuple(own[key].shape) != tuple(t.shape):
                raise ValueError(
                    f"modules: {name!r} {key!r} has shape {tuple(own[key].shape)}, "
                    f"checkpoint has {tuple(t.shape)}"
                )

        def apply():
            module.load_state_dict(state, strict=True)

        return apply
    if kind == "trainable":
        params = dict(module.named_parameters(remove_duplicate=False))
        unexpected = sorted(set(state) - set(params))
        if unexpected:
            raise ValueError(f"modules: {name!r} has no parameters {unexpected[:5]} (from the checkpoint)")
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        missing = sorted(trainable - set(state))
        if missing:
            raise ValueError(f"modules: {name!r} trainable parameters {missing[:5]} are not in the checkpoint")
        for key, t in state.items():
            if tuple(params[key].shape) != tuple(t.shape):
                raise ValueError(
                    f"modules: {name!r} {key!r} has shape {tuple(params[key].shape)}, "
                    f"checkpoint has {tuple(t.shape)}"
                )

        def apply():
            with torch.no_grad():
                for key, t in state.items():
                    params[key].copy_(t)

        return apply
    raise ValueError(f"modules: {name!r} has unknown kind {kind!r} in the checkpoint")


# ----------------------------------------------------------------------------- RNG


def _capture_rng() -> Dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: Dict[str, Any] = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["internal"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["name"],
            npst["keys"].numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if len(cuda) != count:
            warnings.warn(
                f"checkpoint holds {len(cuda)} CUDA RNG states but {count} devices are visible; "
                f"restoring the first {min(count, len(cuda))}",
                stacklevel=3,
            )
        for i, s in enumerate(cuda[:count]):
            torch.cuda.set_rng_state(s, i)


# ----------------------------------------------------------------------------- reading


def _read_manifest(path: Path) -> dict:
    """Return the manifest of a complete checkpoint; raise _Corrupt otherwise."""
    mpath = path / MANIFEST
    if not path.is_dir():
        raise _Corrupt(f"{path} is not a directory")
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise _Corrupt(f"{path} has no {MANIFEST} (incomplete checkpoint)") from None
    except (OSError, ValueError) as exc:
        raise _Corrupt(f"{mpath} is unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise _Corrupt(f"{mpath} has an unknown format")
    for rel, size in manifest.get("files", {}).items():
        fpath = path / rel
        try:
            actual = fpath.stat().st_size
        except FileNotFoundError:
            raise _Corrupt(f"{fpath} is missing") from None
        if actual != size:
            raise _Corrupt(f"{fpath} has {actual} bytes, the manifest says {size}")
    return manifest


def _checkpoint_root(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS


def _read_pointer(root: Path) -> Optional[str]:
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"run_dir: cannot read {root / LATEST} ({exc})") from None
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"run_dir: {root / LATEST} is corrupt (content {name!r})")
    return name


def _resolve(root: Path, name: str) -> Path:
    """Directory named by ``latest``. While a step is re-saved, ``latest`` briefly names the
    new copy's temporary directory; once that directory has been renamed to its final name
    (encoded in the temporary name), follow it there."""
    path = root / name
    if not path.exists() and name.startswith(_TMP_PREFIX):
        m = re.match(r"^\.tmp-(step-\d{6,})-", name)
        if m:
            return root / m.group(1)
    return path


def latest_checkpoint(run_dir) -> Optional[Path]:
    """Directory of the newest complete checkpoint of ``run_dir``, or None if there is none.

    Raises ValueError naming ``run_dir`` if ``checkpoints/latest`` exists but does not name
    a complete checkpoint.
    """
    run_dir = _run_dir(run_dir)
    root = _checkpoint_root(run_dir)
    name = _read_pointer(root)
    if name is None:
        return None
    path = _resolve(root, name)
    try:
        _read_manifest(path)
    except _Corrupt as exc:
        raise ValueError(f"run_dir: {root / LATEST} names a corrupt checkpoint: {exc}") from None
    return path


def list_checkpoints(run_dir) -> list[Path]:
    """Complete checkpoints of ``run_dir``, oldest first (by save time)."""
    root = _checkpoint_root(_run_dir(run_dir))
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        if _STEP_DIR.match(entry.name):
            try:
                manifest = _read_manifest(entry)
            except _Corrupt:
                continue
            found.append((manifest.get("saved_at_ns", 0), manifest["step"], entry))
    return [p for _, _, p in sorted(found)]


# ----------------------------------------------------------------------------- save


def _sweep(root: Path) -> None:
    """Remove temporary and trash entries left by an interrupted save (not the one
    ``latest`` may name)."""
    try:
        keep = _read_pointer(root)
    except ValueError:
        keep = None
    for entry in root.iterdir():
        name = entry.name
        if name == keep:
            continue
        if name.startswith(_TMP_PREFIX) or name.startswith(_TRASH_PREFIX):
            _rmtree(entry)
        elif name.startswith(LATEST + _TMP_PREFIX):
            try:
                entry.unlink()
            except OSError:
                pass


def _prune(root: Path, keep: Optional[int], current: str) -> None:
    if keep is None:
        return
    ranked = []
    for entry in root.iterdir():
        if not _STEP_DIR.match(entry.name) or entry.name == current:
            continue
        try:
            saved = _read_manifest(entry).get("saved_at_ns", 0)
        except _Corrupt:
            saved = -1  # not loadable: first to go
        ranked.append((saved, entry))
    ranked.sort(key=lambda item: item[0], reverse=True)
    for _, entry in ranked[keep - 1 :]:
        trash = root / f"{_TRASH_PREFIX}{entry.name}-{uuid.uuid4().hex[:8]}"
        _replace(entry, trash)
        _rmtree(trash)
    _fsync_dir(root)


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

    Returns:
      The checkpoint directory.

    The Python ``random``, NumPy global, torch CPU and (when available) CUDA RNG states are
    saved too. Saving the same step twice replaces the older copy atomically.
    """
    run_dir = _run_dir(run_dir)
    step = _check_step(step)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep: expected an int >= 1 or None, got {keep!r}")
    modules = _collect("modules", modules, "model", model, torch.nn.Module)
    optimizers = _collect("optimizers", optimizers, "optimizer", optimizer, None)
    extra_bytes = _dump_extra(extra)

    root = _checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    _sweep(root)
    name = f"step-{step:06d}"
    tmp = root / f"{_TMP_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files: Dict[str, int] = {}
        module_entries: Dict[str, dict] = {}
        (tmp / "modules").mkdir()
        (tmp / "optimizers").mkdir()
        for mname, module in modules.items():
            kind, state, adapter = _module_state(module, trainable_only)
            rel = f"modules/{mname}.safetensors"
            meta = {"kind": kind, "adapter": adapter or "", "step": str(step)}
            files[rel] = _write_safetensors(tmp / rel, _file_tensors(mname, state), meta)
            module_entries[mname] = {"kind": kind, "adapter": adapter, "file": rel, "tensors": len(state)}
        opt_entries: Dict[str, dict] = {}
        for oname, opt in optimizers.items():
            rel = f"optimizers/{oname}.pt"
            files[rel] = _write_torch(tmp / rel, opt.state_dict())
            opt_entries[oname] = {"file": rel, "type": type(opt).__name__}
        files["rng.pt"] = _write_torch(tmp / "rng.pt", _capture_rng())
        files["extra.json"] = _write_bytes(tmp / "extra.json", extra_bytes)
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "saved_at_ns": time.time_ns(),
            "trainable_only": bool(trainable_only),
            "modules": module_entries,
            "optimizers": opt_entries,
            "files": files,
            "torch": torch.__version__,
        }
        _write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp / "modules")
        _fsync_dir(tmp / "optimizers")
        _fsync_dir(tmp)
    except BaseException:
        _rmtree(tmp)
        raise

    final = root / name
    if final.exists():
        # Re-saving a step: ``latest`` names the complete temporary copy while the old
        # directory is moved aside; when the copy is renamed into place, ``_resolve``
        # follows the temporary name to the final one. No instant exists at which
        # ``latest`` leads to an incomplete checkpoint.
        _write_pointer(root, tmp.name)
        trash = root / f"{_TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        _replace(final, trash)
        _replace(tmp, final)
        _fsync_dir(root)
        _write_pointer(root, name)
        _rmtree(trash)
    else:
        _replace(tmp, final)
        _fsync_dir(root)
        _write_pointer(root, name)
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

    Raises ValueError naming ``run_dir`` when there is no checkpoint or it is corrupt, and
    naming ``modules`` / ``optimizers`` when an object does not match what was saved.
    Everything is read and checked before anything is modified.
    """
    run_dir = _run_dir(run_dir)
    modules = _collect("modules", modules, "model", model, torch.nn.Module)
    optimizers = _collect("optimizers", optimizers, "optimizer", optimizer, None)
    if path is None:
        path = latest_checkpoint(run_dir)
        if path is None:
            raise ValueError(f"run_dir: no checkpoint in {run_dir} (missing {_checkpoint_root(run_dir) / LATEST})")
    else:
        path = Path(path)
    try:
        manifest = _read_manifest(path)
    except _Corrupt as exc:
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
        appliers.append(_load_module(mname, module, entry, state))
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
        _restore_rng(rng)
    return CheckpointState(step=int(manifest["step"]), extra=extra, path=path)
