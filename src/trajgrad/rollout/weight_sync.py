"""Weight sync: a trained model's weights into the server that an
:class:`~trajgrad.rollout.openai_backend.OpenAIBackend` samples from.

The files are written with :mod:`trajgrad.weights` (a peft adapter with
``save_pretrained``, or the trainable parameters with
:func:`~trajgrad.weights.save_trainable`), so that ``trajgrad serve``'s ``/reload`` reads
exactly what is written here.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import torch

from ..weights import is_peft, save_trainable, unwrap

__all__ = ["sync_server_weights", "load_vllm_adapter", "reload_vllm_weights", "reset_vllm_prefix_cache"]


def sync_server_weights(backend, model, version: int, save_dir: Union[str, os.PathLike]) -> Path:
    """Save ``model``'s trainable weights and load them into ``backend``'s server.

    * LoRA (peft) models: the adapter, with ``model.save_pretrained`` (
      ``adapter_config.json`` + ``adapter_model.safetensors``).
    * Other models: ``trainable.safetensors``, the parameters with ``requires_grad``
      by ``named_parameters()`` name (trajgrad server); the full Hugging Face
      checkpoint (``save_pretrained``) for SGLang.

    Then, per server: trajgrad: ``POST /reload {"path", "version"}``; vLLM: a LoRA model
    through :func:`load_vllm_adapter`, other models through :func:`reload_vllm_weights` (the
    full checkpoint, ``save_pretrained``), then :func:`reset_vllm_prefix_cache`; SGLang:
    ``POST /update_weights_from_disk {"model_path", "weight_version"}`` (a LoRA model is
    merged into a copy of its base first).

    Returns the directory written (``save_dir/v{version:06d}``). The server reads it, so
    ``save_dir`` must be on a file system the server can see. The caller records
    ``version`` (:meth:`~trajgrad.rollout.openai_backend.OpenAISampler.sync_weights` does).
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version: must be a non-negative integer, got {version!r}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    model = unwrap(model)
    out = Path(os.fspath(save_dir)).expanduser().resolve() / f"v{version:06d}"
    out.mkdir(parents=True, exist_ok=True)
    peft = is_peft(model)
    if backend.server == "trajgrad":
        if peft:
            model.save_pretrained(str(out))
        else:
            try:
                save_trainable(model, out / "trainable.safetensors", {"version": str(version)})
            except ValueError:
                raise ValueError("model: has no parameter with requires_grad; nothing to sync") from None
        data = backend.post("/reload", {"path": str(out), "version": version})
        served = data.get("policy_version") if isinstance(data, dict) else None
        if served != version:
            raise ValueError(
                f"server: the trajgrad server reports policy_version {served!r} after /reload, not {version}"
            )
    elif backend.server == "vllm":
        if peft:
            model.save_pretrained(str(out))
            load_vllm_adapter(backend, out, version)
        else:
            model.save_pretrained(str(out), safe_serialization=True)
            reload_vllm_weights(backend, out)
        reset_vllm_prefix_cache(backend, required=not peft)
    else:  # sglang
        if peft:
            import copy

            merged = copy.deepcopy(model).merge_and_unload()
            merged.save_pretrained(str(out), safe_serialization=True)
            del merged
        else:
            model.save_pretrained(str(out), safe_serialization=True)
        data = backend.post("/update_weights_from_disk", {"model_path": str(out), "weight_version": str(version)})
        if isinstance(data, dict) and data.get("success") is False:
            raise ValueError(f"server: the sglang server refused the weights: {data.get('message')}")
    return out


def load_vllm_adapter(backend, path: Path, version: int) -> None:
    """``POST /v1/load_lora_adapter {"lora_name": f"{lora_name}-v{version}", "lora_path"}`` (the
    server needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora``); later requests
    name that adapter. Adapters older than the newest ``1 + backend.keep_adapters`` are unloaded
    (``keep_adapters`` 0: the previous one at once; rollout workers that sample while the learner
    syncs keep a few, so that a turn begun under an older name still finds it)."""
    name = f"{backend.lora_name}-v{version}"
    try:
        backend.post_text("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    except ValueError as exc:
        raise ValueError(f"{exc} (vLLM loads adapters at run time only when started with --enable-lora and "
                         f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)") from None
    loaded = [n for n in getattr(backend, "loaded_adapters", []) if n != name] + [name]
    backend.loaded_adapter = name
    backend.request_model = name
    keep = 1 + int(getattr(backend, "keep_adapters", 0))
    for previous in loaded[:-keep]:
        try:  # best effort: an unloaded old adapter only costs server memory
            backend.post_text("/v1/unload_lora_adapter", {"lora_name": previous})
        except (ValueError, ConnectionError):
            pass
    backend.loaded_adapters = loaded[-keep:]


def reload_vllm_weights(backend, path: Path) -> None:
    """Replace every weight of the served model in place from the checkpoint at ``path``:
    ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": path}}`` (vLLM's
    in-place reload; the route exists when the server runs with ``VLLM_SERVER_DEV_MODE=1``)."""
    resp = backend.send("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
    if resp.status_code == 404:
        raise ValueError("server: the vllm server has no /collective_rpc route; start it with VLLM_SERVER_DEV_MODE=1 "
                         "(full-weight sync reloads the weights in place through it), or train with LoRA")
    if resp.status_code >= 400:
        backend.json_of(resp, "/collective_rpc")


def reset_vllm_prefix_cache(backend, *, required: bool = True) -> bool:
    """``POST /reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1``): no cached keys/values of the old
    weights are reused. A server without the route (404) is told to the caller as a ValueError.

    vLLM refuses the reset (``success: false``) while requests hold cache blocks. With
    ``required`` that is a ValueError; without it (a LoRA sync, whose new adapter name and path
    are part of every cache block's hash in vLLM, so no block of an older adapter is reused)
    the refusal is counted in ``backend.prefix_cache_kept`` and False is returned."""
    resp = backend.send("POST", "/reset_prefix_cache", None)
    if resp.status_code == 404:
        raise ValueError("server: the vllm server has no /reset_prefix_cache route; start it with "
                         "VLLM_SERVER_DEV_MODE=1 so that cached keys/values of old weights are dropped at each sync")
    data = backend.json_of(resp, "/reset_prefix_cache")
    if isinstance(data, dict) and data.get("success") is False:
        if required:
            raise ValueError("server: the vllm server could not reset its prefix cache (requests still running)")
        backend.prefix_cache_kept = int(getattr(backend, "prefix_cache_kept", 0)) + 1
        return False
    return True
