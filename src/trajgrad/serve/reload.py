"""``POST /reload``: load new weights into the served model in place (see :func:`load_weights`)."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, Optional, Union

from ..weights import adapter_loader, checkpoint_module_loader, is_checkpoint, named_tensors_loader, safetensors_files
from .errors import RequestError
from .state import ServerState

__all__ = ["load_weights"]


def _path_error(exc: Exception) -> RequestError:
    msg = str(exc)
    return RequestError(msg if msg.startswith("path:") else f"path: {msg}", param="path")


def load_weights(state: ServerState, path: Union[str, os.PathLike], version: Optional[int] = None) -> Dict[str, Any]:
    """Load the weights at ``path`` into ``state.model`` in place, under ``state.lock``.

    Formats, tried in this order (readers in :mod:`trajgrad.weights.files`):

    1. a **peft adapter directory** (``adapter_config.json`` + ``adapter_model.safetensors``
       or ``.bin``, as ``PeftModel.save_pretrained`` writes it). The served model must
       carry a LoRA adapter with the same ``r``, ``lora_alpha``, ``target_modules``, ...;
       a served model without adapters is wrapped with this one
       (``PeftModel.from_pretrained``).
    2. a **trajgrad checkpoint**: a run directory (``checkpoints/latest``) or one
       ``step-NNNNNN`` directory written by ``trajgrad.train.checkpoint.save_checkpoint``;
       its ``policy`` module is loaded (trainable tensors, peft adapter or full state).
    3. **named tensors in safetensors**: a ``.safetensors`` file, or a directory holding
       ``trainable.safetensors`` or ``model.safetensors`` (or a sharded
       ``model.safetensors.index.json``), keys being the served model's parameter /
       buffer names (``named_parameters()``; Hugging Face ``save_pretrained`` names). A
       subset is fine (the trainable tensors); unknown names or wrong shapes are refused.
       Values are cast to the served dtype.

    Everything is read and checked before the model is touched; a bad file (unreadable,
    garbage, mismatched) is answered with a :class:`~trajgrad.serve.errors.RequestError`
    naming ``path`` (HTTP 400) and leaves the served weights (and version) unchanged. Files
    are read without holding the sampling lock; reloads are serialized among themselves.
    With ``version``, the new weights and the new ``policy_version`` become visible
    together: no token is sampled with one but not the other. Returns ``{"format",
    "tensors", "seconds"}``.
    """
    t0 = time.perf_counter()
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
        raise RequestError(f"version: must be a non-negative integer, got {version!r}", param="version")
    p = Path(os.fspath(path)).expanduser()
    with state.reload_lock:
        if not p.exists():
            raise RequestError(f"path: {p} does not exist (on the server's file system)", param="path")
        try:
            if p.is_dir() and (p / "adapter_config.json").is_file():
                kind = "peft_adapter"
                apply, n = adapter_loader(state.model, p)
            elif is_checkpoint(p):
                kind = "trajgrad_checkpoint"
                apply, n = checkpoint_module_loader(state.model, p, name="policy")
            else:
                files = safetensors_files(p)
                if files is None:
                    raise RequestError(
                        f"path: {p} is neither a peft adapter directory, a trajgrad checkpoint, nor safetensors weights",
                        param="path",
                    )
                kind = "safetensors"
                apply, n = named_tensors_loader(state.model, files)
        except RequestError:
            raise
        except ValueError as exc:
            raise _path_error(exc) from None
        with state.lock:
            try:
                model = apply()
            except ValueError as exc:  # checked beforehand; a late mismatch still names the path
                raise _path_error(exc) from None
            state.model = model
            state.model.eval()
            if version is not None:
                state.policy_version = int(version)
    return {"format": kind, "tensors": n, "seconds": time.perf_counter() - t0}
