"""Building the policy (embedded SmolLM2 or a tiny random model), LoRA, and the reference.

With LoRA the reference policy is the base model with the adapters switched off (no
second copy of the weights); without LoRA the trainer keeps a frozen copy.
"""
from __future__ import annotations

import contextlib
from typing import Tuple

import torch

from .config import ModelConfig


def build_policy_model(cfg: ModelConfig) -> Tuple[torch.nn.Module, object]:
    """(model, tokenizer) ready for training: LoRA applied when configured."""
    from ..rollout.models import build_char_tokenizer, build_tiny_model, load_smollm2, preferred_dtype

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(cfg.dtype) or preferred_dtype()
    if cfg.name == "smollm2":
        model, tok = load_smollm2(dtype=dtype)
    else:
        tok = build_char_tokenizer()
        t = cfg.tiny
        model = build_tiny_model(tok, hidden_size=t.hidden_size, layers=t.layers, heads=t.heads, seed=t.seed, dtype=dtype)
    if cfg.lora is not None:
        from peft import LoraConfig, get_peft_model

        for p in model.parameters():
            p.requires_grad_(False)
        lcfg = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                          target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM")
        model = get_peft_model(model, lcfg)
    if cfg.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable()
    model.train()
    return model, tok


@contextlib.contextmanager
def reference_context(model: torch.nn.Module):
    """Run ``model`` as the reference policy: LoRA adapters disabled (peft models only)."""
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            yield model
    else:
        raise ValueError("model: no LoRA adapters to disable; keep a frozen reference copy instead")
