"""The pieces of a Hugging Face causal LM, whether ``peft`` wraps it or not."""
from __future__ import annotations

from torch import nn

__all__ = ["causal_lm", "causal_parts"]


def causal_lm(model: nn.Module) -> nn.Module:
    """The causal LM itself: ``model.get_base_model()`` for a peft model, else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def causal_parts(model: nn.Module):
    """(backbone, lm_head) of a Hugging Face causal LM, peft-wrapped or not."""
    causal = causal_lm(model)
    backbone = getattr(causal, "model", None)
    head = getattr(causal, "lm_head", None)
    if backbone is None or head is None:
        raise ValueError("model: expected a Hugging Face causal LM with .model and .lm_head")
    return backbone, head
