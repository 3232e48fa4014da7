r"""A lean one-token decode step for Llama-architecture models (the sampler's inner loop).

Sampling one token per row calls the model once per new token. For a small model on a
CPU most of the time of a Hugging Face forward call goes to its framework (a causal mask
built every call, a cache that re-concatenates every layer's keys and values, output
capture), not to arithmetic. :func:`decode_step` computes the same function of the same
weights for one new token per row, calling the model's own modules (embedding, RMSNorm,
the q/k/v/o projections (LoRA-wrapped or not), rotary embedding, MLP, final norm), with

* keys and values written in place into preallocated buffers (:class:`KVBuffers`,
  capacity fixed when the prompt has been run), and
* attention as one ``scaled_dot_product_attention`` call per layer over the filled part
  of the buffer, masked by the row's attention mask (left padding):

.. math::

   o_h = \operatorname{softmax}\!\Big(\frac{q_h K_{g(h)}^\top}{\sqrt{d}} + m\Big) V_{g(h)},
   \qquad g(h) = \lfloor h / (H / H_{kv}) \rfloor,

where :math:`m` is 0 at real tokens and :math:`-\infty` at padding, and the query heads of
one key/value group are stacked as that group's queries (grouped-query attention). The values equal the Hugging Face forward up to float
rounding (about 1e-7 in float32), so the §24 check (ratio = 1 within 1e-5 between the
sampler's log-probs and the learner's recomputation) holds.

:func:`fast_backbone` says whether a model qualifies: a ``LlamaForCausalLM`` (possibly
wrapped by ``peft``; SmolLM2, the tiny model, any Llama checkpoint loaded through
``model.path``, with biases, rope scaling or grouped-query attention alike) using the
``sdpa`` attention implementation, in eval mode. Anything else keeps the Hugging Face
forward: other architectures compute other functions with the same module names (Gemma
scales the embeddings and normalizes with :math:`1 + w`, Qwen2 can use sliding windows).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .parts import causal_lm

__all__ = ["KVBuffers", "decode_step", "fast_backbone"]


def fast_backbone(model) -> Optional[torch.nn.Module]:
    """The ``LlamaModel`` of ``model`` if :func:`decode_step` can run it, else None."""
    causal = causal_lm(model)
    if type(causal).__name__ != "LlamaForCausalLM" or getattr(causal, "training", False):
        return None
    if getattr(getattr(causal, "config", None), "model_type", "llama") != "llama":
        return None
    backbone = getattr(causal, "model", None)
    config = getattr(causal, "config", None)
    if backbone is None or config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not all(hasattr(backbone, n) for n in needed):
        return None
    return backbone


class _LayerView:
    """``keys`` / ``values`` of one layer: the filled part ``[B, H_kv, length, D]``."""

    def __init__(self, owner: "KVBuffers", index: int):
        self.owner, self.index = owner, index

    @property
    def keys(self) -> torch.Tensor:
        return self.owner.k[self.index][:, :, : self.owner.length]

    @property
    def values(self) -> torch.Tensor:
        return self.owner.v[self.index][:, :, : self.owner.length]


class KVBuffers:
    """Per-layer key/value buffers ``[B, H_kv, capacity, D]``, the first ``length`` filled.

    Built from the per-layer ``(keys, values)`` of a prompt's forward pass with room for
    ``extra`` more tokens. ``layers[l].keys`` / ``.values`` view the filled part (the
    shape the sampler's row extraction reads); :meth:`batch_select_indices` keeps rows.
    """

    def __init__(self, layers_kv, extra: int):
        if extra < 0:
            raise ValueError(f"extra: must be >= 0, got {extra}")
        self.k: List[torch.Tensor] = []
        self.v: List[torch.Tensor] = []
        self.length = int(layers_kv[0][0].shape[2])
        cap = self.length + int(extra)
        for k, v in layers_kv:
            B, H, T, D = k.shape
            kb = k.new_empty((B, H, cap, D))
            vb = v.new_empty((B, v.shape[1], cap, v.shape[3]))
            kb[:, :, :T] = k
            vb[:, :, :T] = v
            self.k.append(kb)
            self.v.append(vb)
        self.layers = [_LayerView(self, i) for i in range(len(self.k))]

    @property
    def capacity(self) -> int:
        return int(self.k[0].shape[2])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.k = [k.index_select(0, indices) for k in self.k]
        self.v = [v.index_select(0, indices) for v in self.v]


@torch.no_grad()
def decode_step(backbone: torch.nn.Module, buffers: KVBuffers, token: torch.Tensor, position: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
    """Run one new token per row; return the final-norm hidden state ``[B, hidden]``.

    Args:
      backbone: from :func:`fast_backbone`.
      buffers: the rows' cached keys/values; the new token's are written at ``length``.
      token: ``[B]`` token ids; position: ``[B]`` their position ids.
      attention_mask: ``[B, length + 1]`` (1 = real token, 0 = padding), covering the
        cached tokens and the new one.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B = token.shape[0]
    L = buffers.length
    if L >= buffers.capacity:
        raise ValueError(f"buffers: full ({buffers.capacity} tokens); no room for another token")
    if tuple(attention_mask.shape) != (B, L + 1):
        raise ValueError(f"attention_mask: expected shape {(B, L + 1)}, got {tuple(attention_mask.shape)}")
    x = backbone.embed_tokens(token[:, None])
    cos, sin = backbone.rotary_emb(x, position[:, None])
    mask = attention_mask.bool()[:, None, None, :]
    n_layers = getattr(backbone.config, "num_hidden_layers", len(backbone.layers))
    for i, layer in enumerate(backbone.layers[:n_layers]):
        attn = layer.self_attn
        D = attn.head_dim
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(B, 1, -1, D).transpose(1, 2)
        k = attn.k_proj(h).view(B, 1, -1, D).transpose(1, 2)
        v = attn.v_proj(h).view(B, 1, -1, D).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        kb, vb = buffers.k[i], buffers.v[i]
        kb[:, :, L:L + 1] = k
        vb[:, :, L:L + 1] = v
        H, Hkv = q.shape[1], kb.shape[1]
        # the H / H_kv query heads of a key/value group attend as that group's queries
        qg = q.reshape(B, Hkv, H // Hkv, D)
        o = torch.nn.functional.scaled_dot_product_attention(
            qg, kb[:, :, :L + 1], vb[:, :, :L + 1], attn_mask=mask, scale=attn.scaling)
        x = x + attn.o_proj(o.reshape(B, 1, H * D))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    buffers.length = L + 1
    return backbone.norm(x)[:, -1]
