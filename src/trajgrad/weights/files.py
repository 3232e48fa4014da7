r"""Weights on disk: safetensors files of named tensors, peft adapter directories, and the
policy module of a trajgrad checkpoint, each read and checked against a model before
anything is copied.

Every reader here returns ``(apply, count)``: ``apply()`` copies the checked tensors into
the model in place and returns the model to use afterwards (the same object, or a new
``PeftModel`` wrapping it when the first adapter is loaded into a plain model); ``count``
is the number of tensors (-1 when not known before applying). Bad files raise ValueError
naming ``path``; nothing is modified until ``apply`` is called.

Formats:

* **named tensors** (:func:`save_trainable`, :func:`named_tensors_loader`): a
  ``.safetensors`` file whose keys are the model's parameter / buffer names
  (``named_parameters()``; Hugging Face ``save_pretrained`` names), a subset being fine.
* **peft adapter directory** (:func:`adapter_loader`): ``adapter_config.json`` +
  ``adapter_model.safetensors`` (``PeftModel.save_pretrained``).
* **trajgrad checkpoint** (:func:`checkpoint_module_loader`): a run directory
  (``checkpoints/latest``) or one ``step-NNNNNN`` directory; the layout constants are
  :data:`CHECKPOINTS`, :data:`LATEST`, :data:`MANIFEST`, :data:`CHECKPOINT_FORMAT`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .state import file_tensors, is_peft, module_state_loader, peft_adapter_name

__all__ = [
    "CHECKPOINTS",
    "CHECKPOINT_FORMAT",
    "READABLE_CHECKPOINT_FORMATS",
    "LATEST",
    "MANIFEST",
    "adapter_loader",
    "checkpoint_module_loader",
    "named_tensors_loader",
    "safetensors_files",
    "save_trainable",
]

CHECKPOINT_FORMAT = 2          # a manifest's "files": {name: {"size": bytes, "sha256": hex}}
READABLE_CHECKPOINT_FORMATS = (1, 2)  # format 1: {name: size}, no checksums
CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
_TMP_STEP = re.compile(r"^\.tmp-(step-\d{6,})-")
_LORA_FIELDS = ("r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "bias")

Loader = Tuple[Callable[[], torch.nn.Module], int]


def save_trainable(model: torch.nn.Module, path: Union[str, os.PathLike],
                   metadata: Optional[Mapping[str, str]] = None) -> Path:
    """Write the parameters with ``requires_grad`` (by ``named_parameters()`` name) to the
    safetensors file ``path``; ``metadata`` (strings) is stored in its header.

    Raises ValueError naming ``model`` when nothing is trainable.
    """
    from safetensors.torch import save_file

    tensors = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not tensors:
        raise ValueError("model: has no parameter with requires_grad; nothing to save")
    meta = {"format": "pt", "content": "trainable_parameters"}
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    path = Path(os.fspath(path))
    save_file(file_tensors("model", tensors), str(path), metadata=meta)
    return path


def safetensors_files(path: Union[str, os.PathLike]) -> Optional[List[Path]]:
    """The safetensors file(s) ``path`` designates, or None if it designates none: the file
    itself, a directory's ``model.safetensors.index.json`` shards, ``trainable.safetensors``
    or ``model.safetensors``."""
    path = Path(os.fspath(path))
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if not path.is_dir():
        return None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"path: unreadable shard index {index} ({exc})") from None
        return [path / name for name in names]
    for name in ("trainable.safetensors", "model.safetensors"):
        if (path / name).is_file():
            return [path / name]
    return None


def _read_safetensors(files: Sequence[Path]) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: Dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f), device="cpu"))
        except Exception as exc:  # corrupt or missing file
            raise ValueError(f"path: cannot read {f} ({exc})") from None
    return state


def _named_targets(model) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by state-dict name (tied names included)."""
    out: Dict[str, torch.Tensor] = {}
    out.update(dict(model.named_buffers(remove_duplicate=False)))
    out.update(dict(model.named_parameters(remove_duplicate=False)))
    return out


def _check_finite(key: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise ValueError(f"path: tensor {key!r} holds NaN or inf")


def named_tensors_loader(model: torch.nn.Module, files: Sequence[Path]) -> Loader:
    """Read named tensors from ``files`` and check them against ``model`` (names known to the
    model, or to its base model under peft; same shapes; finite). Values are cast to the
    model's dtype when copied."""
    state = _read_safetensors(files)
    if not state:
        raise ValueError(f"path: {files[0]} holds no tensors")
    targets = _named_targets(model)
    base_targets = _named_targets(model.get_base_model()) if is_peft(model) else {}
    pairs, unknown = [], []
    for key, t in state.items():
        dst = targets.get(key, base_targets.get(key))
        if dst is None:
            unknown.append(key)
            continue
        if tuple(dst.shape) != tuple(t.shape):
            raise ValueError(f"path: tensor {key!r} has shape {tuple(t.shape)}, the model has {tuple(dst.shape)}")
        _check_finite(key, t)
        pairs.append((dst, t))
    if unknown:
        raise ValueError(f"path: {len(unknown)} tensor(s) are not in the model, e.g. {sorted(unknown)[:5]}")

    def apply() -> torch.nn.Module:
        with torch.no_grad():
            for dst, t in pairs:
                dst.copy_(t)
        return model

    return apply, len(pairs)


def _adapter_config(path: Path) -> Dict[str, Any]:
    try:
        cfg = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"path: unreadable adapter_config.json in {path} ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"path: adapter_config.json in {path} is not a JSON object")
    return cfg


def _adapter_weights(path: Path) -> Dict[str, torch.Tensor]:
    from peft.utils import load_peft_weights

    try:
        loaded = load_peft_weights(str(path), device="cpu")
    except Exception as exc:
        raise ValueError(f"path: cannot read the adapter weights in {path} ({exc})") from None
    if not isinstance(loaded, dict) or not loaded:
        raise ValueError(f"path: the adapter in {path} holds no tensors")
    for key, t in loaded.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"path: adapter entry {key!r} in {path} is not a tensor")
        _check_finite(key, t)
    return loaded


def _as_set(v) -> set:
    return {v} if isinstance(v, str) else set(v)


def adapter_loader(model: torch.nn.Module, path: Union[str, os.PathLike]) -> Loader:
    """A peft adapter directory, checked against ``model``'s adapter (same ``r``,
    ``lora_alpha``, ``target_modules``, ... and the same tensors).

    A ``model`` without adapters is wrapped by this one (``PeftModel.from_pretrained``,
    not trainable): ``apply()`` then returns the wrapper. The config and the weights are
    read and checked first, so an unreadable adapter raises before the model is touched.
    """
    from peft import LoraConfig, PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

    path = Path(os.fspath(path))
    cfg = _adapter_config(path)
    loaded = _adapter_weights(path)
    if not is_peft(model):
        try:
            LoraConfig.from_pretrained(str(path))
        except Exception as exc:
            raise ValueError(f"path: adapter_config.json in {path} is not a valid LoRA config ({exc})") from None

        def wrap() -> torch.nn.Module:
            wrapped = PeftModel.from_pretrained(model, str(path), is_trainable=False)
            return wrapped.eval()

        return wrap, len(loaded)
    name = peft_adapter_name(model)
    served = model.peft_config[name]
    for key in _LORA_FIELDS:
        mine = getattr(served, key, None)
        if key in cfg and mine is not None and cfg[key] != mine:
            raise ValueError(f"path: adapter_config.json has {key}={cfg[key]!r}, the model's adapter has {mine!r}")
    theirs = cfg.get("target_modules")
    mine = getattr(served, "target_modules", None)
    if theirs is not None and mine is not None:
        if not isinstance(theirs, (str, list)) or _as_set(theirs) != _as_set(mine):
            raise ValueError(f"path: adapter target_modules {theirs!r} differ from the model's {sorted(_as_set(mine))}")
    expected = get_peft_model_state_dict(model, adapter_name=name)
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"path: adapter tensors do not match the model's adapter (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for key, t in loaded.items():
        if tuple(t.shape) != tuple(expected[key].shape):
            raise ValueError(f"path: adapter tensor {key!r} has shape {tuple(t.shape)}, the model's is "
                             f"{tuple(expected[key].shape)}")

    def apply() -> torch.nn.Module:
        with torch.no_grad():
            set_peft_model_state_dict(model, loaded, adapter_name=name)
        return model

    return apply, len(loaded)


def is_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a trajgrad run directory (``checkpoints/latest``) or step directory."""
    p = Path(os.fspath(path))
    return p.is_dir() and ((p / MANIFEST).is_file() or (p / CHECKPOINTS / LATEST).is_file())


def _checkpoint_dir(path: Path) -> Path:
    if (path / MANIFEST).is_file():
        return path
    root = path / CHECKPOINTS
    try:
        name = (root / LATEST).read_text().strip()
    except OSError as exc:
        raise ValueError(f"path: cannot read {root / LATEST} ({exc})") from None
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"path: {root / LATEST} is corrupt (content {name!r})")
    step = root / name
    m = _TMP_STEP.match(name)
    if not step.exists() and m:  # a step being re-saved: follow it to its final name
        step = root / m.group(1)
    return step


def checkpoint_module_loader(model: torch.nn.Module, path: Union[str, os.PathLike], *, name: str = "policy") -> Loader:
    """Module ``name`` of a trajgrad checkpoint (run or step directory) into ``model``.

    The manifest must be complete (a format of :data:`READABLE_CHECKPOINT_FORMATS`, the
    module's file of the recorded size and checksum); the module's state (``peft`` adapter, ``trainable`` parameters or
    ``full`` state dict) is checked with :func:`~trajgrad.weights.state.module_state_loader`.
    """
    step = _checkpoint_dir(Path(os.fspath(path)))
    try:
        manifest = json.loads((step / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"path: {step / MANIFEST} is unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_CHECKPOINT_FORMATS:
        raise ValueError(f"path: {step / MANIFEST} has an unknown format")
    entry = (manifest.get("modules") or {}).get(name)
    if not isinstance(entry, dict) or "file" not in entry or "kind" not in entry:
        raise ValueError(f"path: the checkpoint {step} has no module {name!r}")
    file = step / entry["file"]
    recorded = (manifest.get("files") or {}).get(entry["file"])
    size, digest = (recorded, None) if not isinstance(recorded, dict) else (recorded.get("size"), recorded.get("sha256"))
    try:
        actual = file.stat().st_size
    except OSError:
        raise ValueError(f"path: {file} is missing") from None
    if size is not None and actual != size:
        raise ValueError(f"path: {file} has {actual} bytes, the manifest says {size}")
    if digest is not None and hashlib.sha256(file.read_bytes()).hexdigest() != digest:
        raise ValueError(f"path: {file} does not match its checksum in the manifest (corrupted)")
    state = _read_safetensors([file])
    try:
        load = module_state_loader(name, model, entry["kind"], state, adapter=entry.get("adapter"))
    except ValueError as exc:
        raise ValueError(f"path: {exc}") from None

    def apply() -> torch.nn.Module:
        try:
            load()
        except ValueError as exc:
            raise ValueError(f"path: {exc}") from None
        return model

    return apply, len(state)
