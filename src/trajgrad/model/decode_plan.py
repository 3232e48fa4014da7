r"""What the lean decode step calls for each layer: fused projections, norms, rotary table.

:func:`~trajgrad.model.decode.decode_step` runs one new token per row through a Llama
model. At one token per row the products are small and a call's fixed cost is a large part
of each, so :class:`DecodePlan` prepares, once per sampling call (the weights are fixed
while a batch is sampled), the fewest calls that compute the same function:

* **q | k | v in one product.** Where ``q_proj``, ``k_proj`` and ``v_proj`` are plain
  ``nn.Linear`` layers, their weights are stacked,
  :math:`[q; k; v] = h\,[W_q; W_k; W_v]^\top + [b_q; b_k; b_v]`, the same rows of the same
  products as the three layers. **gate | up** likewise,
  :math:`\mathrm{down}(\mathrm{act}(g) \odot u)` with :math:`[g; u] = h\,[W_g; W_u]^\top`.
  Stacking copies the weights, so it is done only where that copy is small (at most
  :data:`FUSE_MAX_ELEMENTS` elements per stacked matrix; small layers are where a call's
  fixed cost matters). Wrapped projections (LoRA adapters) are called as they are.
* **Rotary embedding on q and k at once** (stacked, as the same elementwise formula),
  :math:`x \cos\theta + \mathrm{rotate\_half}(x) \sin\theta`, with :math:`\cos\theta,
  \sin\theta` read from a table of every position the call can reach, computed by the
  model's own ``rotary_emb`` (elementwise in the position, so the same values); rotary
  types whose frequencies depend on the sequence length (``dynamic``, ``longrope``) call
  ``rotary_emb`` at each step instead.
* **RMSNorm as one** ``torch.nn.functional.rms_norm`` call,
  :math:`w \odot x / \sqrt{\overline{x^2} + \epsilon}`, for float32 ``LlamaRMSNorm``
  layers (the formula of the module, rounded the same within 1e-6); other dtypes call the
  module (it normalizes in float32 and rounds before the weight).

The weights are read when the plan is made: a plan is made per sampling call and must not
outlive an optimizer step.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

__all__ = ["DecodePlan", "FUSE_MAX_ELEMENTS", "rope"]

FUSE_MAX_ELEMENTS = 1 << 20
"""Largest stacked weight (elements) that :class:`DecodePlan` builds."""

_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _plain(*layers) -> bool:
    return all(type(m) is torch.nn.Linear for m in layers)


def _stack(*layers) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor], List[int]]]:
    """``(W, b, sizes)`` of plain linear layers stacked along their outputs, or None."""
    if not _plain(*layers):
        return None
    weights = [m.weight for m in layers]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return None
    if sum(w.numel() for w in weights) > FUSE_MAX_ELEMENTS:
        return None
    biases = [m.bias for m in layers]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    with torch.no_grad():
        W = torch.cat([w.detach() for w in weights], dim=0)
        b = None if biases[0] is None else torch.cat([x.detach() for x in biases], dim=0)
    return W, b, [int(w.shape[0]) for w in weights]


def _norm_fn(module) -> Callable[[torch.Tensor], torch.Tensor]:
    w = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if (type(module).__name__ != "LlamaRMSNorm" or not isinstance(w, torch.Tensor) or w.dtype != torch.float32
            or eps is None):
        return module
    shape, weight, eps = tuple(w.shape), w.detach(), float(eps)

    def norm(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return module(x)
        return torch.nn.functional.rms_norm(x, shape, weight, eps)

    return norm


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r""":math:`x\cos\theta + \mathrm{rotate\_half}(x)\sin\theta` (``rotate_half(x) = [-x_2, x_1]``,
    the halves of the last dimension): the operations of the Llama rotary embedding."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Layer:
    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.norm_in = _norm_fn(layer.input_layernorm)
        self.norm_post = _norm_fn(layer.post_attention_layernorm)
        self.qkv = _stack(attn.q_proj, attn.k_proj, attn.v_proj)
        gated = type(mlp).__name__ == "LlamaMLP" and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "act_fn"))
        self.gate_up = _stack(mlp.gate_proj, mlp.up_proj) if gated else None


class DecodePlan:
    """Per-layer calls of :func:`~trajgrad.model.decode.decode_step` (module docstring).

    Args:
      backbone: a ``LlamaModel`` (:func:`~trajgrad.model.decode.fast_backbone`).
      max_position: the largest position id the sampling call can reach; the rotary table
        covers ``0 .. max_position`` (``None``: no table, ``rotary_emb`` at each step).
    """

    def __init__(self, backbone, max_position: Optional[int] = None):
        n_layers = getattr(backbone.config, "num_hidden_layers", len(backbone.layers))
        self.layers = [_Layer(layer) for layer in backbone.layers[:n_layers]]
        self.final_norm = _norm_fn(backbone.norm)
        self.backbone = backbone
        self.table = None
        rope_type = str((getattr(backbone.config, "rope_parameters", None) or {}).get("rope_type", "default"))
        if max_position is not None and not any(t in rope_type for t in _LENGTH_DEPENDENT_ROPE):
            if isinstance(max_position, bool) or not isinstance(max_position, int) or max_position < 0:
                raise ValueError(f"max_position: expected a non-negative integer, got {max_position!r}")
            emb = backbone.embed_tokens.weight
            pos = torch.arange(max_position + 1, device=emb.device)[None]
            with torch.no_grad():
                cos, sin = backbone.rotary_emb(emb[:1, None].detach(), pos)
            self.table = (cos[0], sin[0])  # [positions, head_dim]

    @classmethod
    def modules_only(cls, backbone, max_position: Optional[int] = None) -> "DecodePlan":
        """A plan that calls every module as it is: no stacked weights, no functional norm, no
        rotary table (the reference the fused plan is tested and benchmarked against)."""
        plan = cls(backbone)
        for layer, p in zip(backbone.layers, plan.layers):
            p.qkv = p.gate_up = None
            p.norm_in, p.norm_post = layer.input_layernorm, layer.post_attention_layernorm
        plan.final_norm = backbone.norm
        return plan

    def cos_sin(self, x: torch.Tensor, position: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[B, 1, head_dim]`` of one new token per row at ``position`` ``[B]``."""
        if self.table is not None and int(position.max()) < self.table[0].shape[0]:
            cos, sin = self.table
            return cos[position][:, None], sin[position][:, None]
        return self.backbone.rotary_emb(x, position[:, None])
