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


_RESERVED_FILES = ("modules", "optimizers", "rng.pt", "extra.json", "manifest.json")


def _check_files(files) -> Dict[str, bytes]:
    """The ``files`` argument of ``save_checkpoint``: name -> bytes, names that are plain file
    names and none of the checkpoint's own."""
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise ValueError(f"files: expected a dict of name -> bytes, got {type(files).__name__}")
    for key, data in files.items():
        if not isinstance(key, str) or not _NAME.match(key) or key in _RESERVED_FILES or key.startswith("."):
            raise ValueError(f"files: name {key!r} must match [A-Za-z0-9_.-]+, not start with '.', and not be one of "
                             f"{list(_RESERVED_FILES)}")
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"files: {key!r} is a {type(data).__name__}, expected bytes")
    return {k: bytes(v) for k, v in files.items()}


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


# Module states are the weights layer's (trajgrad.weights): peft detection, trainable state,
# safetensors-ready tensors and the checked loader.


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


# ----------------------------------------------------------------------------- adaptive entropy coefficient

# The adaptive entropy coefficient (Objective.entropy_target) is a training state like a
# learning rate: it is kept in the policy optimizer's first parameter group, whose keys
# ``Optimizer.state_dict`` saves and ``load_state_dict`` restores, so every checkpoint of the
# optimizer holds it and a resumed run continues with the exact value.
ENTROPY_COEF_KEY = "trajgrad_entropy_coef"


def entropy_coef_state(optimizer: torch.optim.Optimizer, initial: float) -> float:
    """The current adaptive entropy coefficient; ``initial`` until a step has set one."""
    group = optimizer.param_groups[0]
    if ENTROPY_COEF_KEY not in group:
        group[ENTROPY_COEF_KEY] = float(initial)
    return float(group[ENTROPY_COEF_KEY])


def set_entropy_coef_state(optimizer: torch.optim.Optimizer, value: float) -> None:
    """Record the coefficient of the next step (saved with the optimizer's state)."""
    v = float(value)
    if not v >= 0 or v == float("inf"):
        raise ValueError(f"value: the entropy coefficient must be a finite number >= 0, got {value!r}")
    optimizer.param_groups[0][ENTROPY_COEF_KEY] = v
