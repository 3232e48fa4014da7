r"""Which tensors of a model are "its weights" for a sync or a checkpoint, and copying them in.

* :func:`unwrap` removes ``DataParallel`` / ``DistributedDataParallel`` / ``torch.compile``
  wrappers; :func:`is_peft` says whether a module is a ``peft`` model (without importing
  peft when nothing did); :func:`peft_adapter_name` names its active adapter.
* :func:`trainable_state` / :func:`load_trainable_state`: the parameters with
  ``requires_grad`` (LoRA adapters of a peft model; every parameter of a model trained in
  full), by ``named_parameters()`` name, as a weight sync sends them.
* :func:`module_state` / :func:`module_state_loader`: the three kinds of saved module state
  (``"peft"`` adapter, ``"trainable"`` parameters, ``"full"`` state dict) and a checked
  loader for each. The loader checks everything first and returns a closure that copies,
  so that a caller can check several modules before modifying any.
* :func:`file_tensors`: CPU, contiguous tensors sharing no storage (what safetensors needs).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

__all__ = [
    "file_tensors",
    "is_peft",
    "load_trainable_state",
    "module_state",
    "module_state_loader",
    "peft_adapter_name",
    "trainable_state",
    "unwrap",
]


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DataParallel / DistributedDataParallel / torch.compile wrappers."""
    while True:
        if isinstance(module, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            module = module.module
        elif type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
            module = module._orig_mod
        else:
            return module


def is_peft(module) -> bool:
    """True for a ``peft.PeftModel`` (False, without importing peft, when nothing imported it)."""
    if "peft" not in sys.modules:  # a PeftModel cannot exist without peft imported
        return False
    from peft import PeftModel

    return isinstance(module, PeftModel)


def peft_adapter_name(module) -> str:
    """The active adapter's name of a peft model (``"default"`` when it has several or none)."""
    name = getattr(module, "active_adapter", "default")
    return name if isinstance(name, str) else "default"


def trainable_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The tensors a weight sync sends: every parameter with ``requires_grad`` (the LoRA
    adapters of a PEFT model, all parameters of a model trained in full), detached, on CPU."""
    out = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}
    if not out:
        raise ValueError("model: has no trainable parameters to publish")
    return out


@torch.no_grad()
def load_trainable_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> int:
    """Copy ``state`` (from :func:`trainable_state`) into ``model``'s parameters in place.

    Every name must be a parameter of ``model`` with the same shape (checked for all names
    before any is copied); values are cast to the parameter's device and dtype. Returns the
    number of tensors copied.
    """
    params = dict(model.named_parameters())
    pairs = []
    for name, value in state.items():
        p = params.get(name)
        if p is None:
            raise ValueError(f"state: {name!r} is not a parameter of the model")
        if tuple(p.shape) != tuple(value.shape):
            raise ValueError(f"state: {name!r} has shape {tuple(value.shape)}, the model's is {tuple(p.shape)}")
        pairs.append((p, value))
    for p, value in pairs:
        p.copy_(torch.as_tensor(value).to(device=p.device, dtype=p.dtype))
    return len(state)


def module_state(module: torch.nn.Module, trainable_only: bool) -> Tuple[str, Dict[str, Any], Optional[str]]:
    """``(kind, state, adapter_name)`` of one module.

    With ``trainable_only``: a peft model gives ``("peft", its active adapter's state,
    name)`` (``peft.get_peft_model_state_dict``), any other module ``("trainable", its
    parameters with requires_grad, None)``. Without: ``("full", state_dict(), None)``.
    Wrappers (:func:`unwrap`) are removed first.
    """
    module = unwrap(module)
    if trainable_only and is_peft(module):
        from peft import get_peft_model_state_dict

        adapter = peft_adapter_name(module)
        return "peft", get_peft_model_state_dict(module, adapter_name=adapter), adapter
    if trainable_only:
        return "trainable", {n: p for n, p in module.named_parameters() if p.requires_grad}, None
    return "full", module.state_dict(), None


def module_state_loader(name: str, module: torch.nn.Module, kind: str, state: Mapping[str, torch.Tensor], *,
                        adapter: Optional[str] = None, require_all_trainable: bool = True) -> Callable[[], None]:
    """Check that ``state`` (of ``kind``, from :func:`module_state`) fits ``module``; return
    a closure that copies it in. Mismatches raise ValueError naming ``modules`` and ``name``.

    ``require_all_trainable``: for ``"trainable"`` state, every parameter of ``module`` with
    requires_grad must be in ``state`` (a checkpoint); ``False`` accepts a subset.
    """
    module = unwrap(module)
    if kind == "peft":
        if not is_peft(module):
            raise ValueError(f"modules: {name!r} was saved as a peft adapter but is a {type(module).__name__}")

        def apply_peft():
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(module, dict(state), adapter_name=adapter or "default")
            unexpected = list(getattr(result, "unexpected_keys", []) or [])
            if unexpected:
                raise ValueError(f"modules: {name!r} adapter keys not in the model: {unexpected[:5]}")

        return apply_peft
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
                    f"modules: {name!r} {key!r} has shape {tuple(own[key].shape)}, checkpoint has {tuple(t.shape)}"
                )

        def apply_full():
            module.load_state_dict(dict(state), strict=True)

        return apply_full
    if kind == "trainable":
        params = dict(module.named_parameters(remove_duplicate=False))
        unexpected = sorted(set(state) - set(params))
        if unexpected:
            raise ValueError(f"modules: {name!r} has no parameters {unexpected[:5]} (from the checkpoint)")
        if require_all_trainable:
            trainable = {n for n, p in module.named_parameters() if p.requires_grad}
            missing = sorted(trainable - set(state))
            if missing:
                raise ValueError(f"modules: {name!r} trainable parameters {missing[:5]} are not in the checkpoint")
        for key, t in state.items():
            if tuple(params[key].shape) != tuple(t.shape):
                raise ValueError(
                    f"modules: {name!r} {key!r} has shape {tuple(params[key].shape)}, checkpoint has {tuple(t.shape)}"
                )

        def apply_trainable():
            with torch.no_grad():
                for key, t in state.items():
                    params[key].copy_(t)

        return apply_trainable
    raise ValueError(f"modules: {name!r} has unknown kind {kind!r} in the checkpoint")


def file_tensors(name: str, state: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """CPU, contiguous tensors that share no storage (a safetensors requirement).

    A tensor that is a view, shares its storage with an earlier one, or is empty is cloned;
    a non-tensor entry raises ValueError naming ``modules`` and ``name``.
    """
    out: Dict[str, torch.Tensor] = {}
    seen: set = set()
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
