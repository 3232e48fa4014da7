"""Durable files of a checkpoint: fsync'd writes, atomic renames, checksums, the manifest.

Every operation that changes what is on disk goes through the few functions of this
module (``_write_*``, ``_replace``, ``_rmtree``, ``_fsync_*``), so that tests can inject a
crash between any two of them. Every file of a checkpoint is listed in its
``manifest.json`` with its size and SHA-256; :func:`read_manifest` checks the sizes (cheap:
enough to tell a complete checkpoint from a torn one) and, with ``verify=True``, the
checksums (a same-size corruption of weights or optimizer state).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ..weights.files import CHECKPOINT_FORMAT as FORMAT_VERSION  # the layout is the weights layer's
from ..weights.files import CHECKPOINTS, LATEST, MANIFEST
from ..weights.files import READABLE_CHECKPOINT_FORMATS as READABLE_FORMATS

STEP_DIR = re.compile(r"^step-(\d{6,})$")
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


class CorruptCheckpoint(Exception):
    """A checkpoint directory that is not a complete, intact checkpoint.

    ``file`` is the path of the offending file (None when the directory itself is the problem).
    """

    def __init__(self, message: str, file: Optional[Path] = None):
        super().__init__(message)
        self.file = file


# ----------------------------------------------------------------------------- durable I/O
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


def write_pointer(root: Path, name: str) -> None:
    tmp = root / f"{LATEST}{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    _write_bytes(tmp, (name + "\n").encode())
    _replace(tmp, root / LATEST)
    _fsync_dir(root)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_entry(path: Path, size: int) -> Dict[str, Any]:
    """The manifest entry of a written file: its size and SHA-256 (read back from disk)."""
    return {"size": int(size), "sha256": _sha256(path)}


# ----------------------------------------------------------------------------- reading


def read_manifest(path: Path, *, verify: bool = False) -> dict:
    """The manifest of the complete checkpoint ``path``; raise :class:`CorruptCheckpoint`
    otherwise. Sizes are always checked; ``verify`` also checks every file's SHA-256."""
    mpath = path / MANIFEST
    if not path.is_dir():
        raise CorruptCheckpoint(f"{path} is not a directory")
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path} has no {MANIFEST} (incomplete checkpoint)", mpath) from None
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(f"{mpath} is unreadable ({exc})", mpath) from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
        raise CorruptCheckpoint(f"{mpath} has an unknown format", mpath)
    files = manifest.get("files")
    if not isinstance(files, dict) or not isinstance(manifest.get("step"), int):
        raise CorruptCheckpoint(f"{mpath} is malformed", mpath)
    for rel, entry in files.items():
        size, digest = (entry, None) if isinstance(entry, int) else (entry.get("size"), entry.get("sha256"))
        fpath = path / rel
        try:
            actual = fpath.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{fpath} is missing", fpath) from None
        if actual != size:
            raise CorruptCheckpoint(f"{fpath} has {actual} bytes, the manifest says {size}", fpath)
        if verify and digest is not None and _sha256(fpath) != digest:
            raise CorruptCheckpoint(f"{fpath} is corrupt (its SHA-256 differs from the manifest's)", fpath)
    return manifest


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS


def read_pointer(root: Path) -> Optional[str]:
    """The directory name ``latest`` holds; None when there is no ``latest``."""
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"run_dir: cannot read {root / LATEST} ({exc})") from None
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"run_dir: {root / LATEST} is corrupt (content {name!r})")
    return name


def resolve(root: Path, name: str) -> Path:
    """Directory named by ``latest``. While a step is re-saved, ``latest`` briefly names the
    new copy's temporary directory; once that directory has been renamed to its final name
    (encoded in the temporary name), follow it there."""
    path = root / name
    if not path.exists() and name.startswith(TMP_PREFIX):
        m = re.match(r"^\.tmp-(step-\d{6,})-", name)
        if m:
            return root / m.group(1)
    return path
