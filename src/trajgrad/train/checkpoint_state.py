"""The objects a checkpoint holds: module weights, optimizer states, RNG streams, ``extra``.

Used by :mod:`trajgrad.train.checkpoint`: turning modules into flat tensor dicts (a
``peft`` adapter, the trainable parameters, or the full ``state_dict``) and back with
shape checks made before anything is modified, capturing and restoring the Python, NumPy,
torch CPU and CUDA random-number streams, and serializing ``extra`` to JSON.
"""
from __future__ import annotations

import json
import os
import random
import re
import sys
import warnings
from typing import Any, Dict, Mapping

import numpy as np
import torch

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


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
