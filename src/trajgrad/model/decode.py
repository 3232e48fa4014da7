r"""A lean one-token decode step for Llama-architecture models (the sampler's inner loop).

Sampling one token per row calls the model once per new token. For a small model on a
CPU most of the time of a Hugging Face forward call goes to its framework (a causal mask
built every call, a cache that re-concatenates every layer's keys and values, output
capture), not to arithmetic. :func:`decode_step` computes the same function of the same
weights for one new token per row, calling the model's own modules (embedding, RMSNorm,
the q/k/v/o projections (LoRA-wrapped or not), rotary embedding, MLP, final norm) or the
fewer calls of a :class:`~trajgrad.model.decode_plan.DecodePlan` made from them (q|k|v
and gate|up stacked into one product each where they are plain linear layers, RMSNorm as
one functional call, the rotary angles read from a table), with

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

With a :class:`~trajgrad.model.shared_prefix.SharedPrefix` (the rows of a GRPO group share
their prompt's keys and values) the buffers hold only each row's tokens after the prefix,
and attention is :func:`~trajgrad.model.shared_prefix.shared_prefix_attention`: the same
function, with each prefix's keys read once per group instead of once per row.

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

from .decode_plan import DecodePlan, rope
from .kv import RowKV
from .parts import causal_lm
from .shared_prefix import SharedPrefix, shared_prefix_attention

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
    """``keys`` / ``values`` of one layer: the filled part ``[B, H_kv, length, D]`` (with a
    shared prefix, per-row copies of it in front: built when read)."""

    def __init__(self, owner: "KVBuffers", index: int):
        self.owner, self.index = owner, index

    def _full(self, own: List[torch.Tensor], which: str) -> torch.Tensor:
        o = self.owner
        part = own[self.index][:, :, : o.length - o.offset]
        if o.shared is None:
            return part
        return torch.cat([o.shared.expanded(self.index, which).to(part.dtype), part], dim=2)

    @property
    def keys(self) -> torch.Tensor:
        return self._full(self.owner.k, "k")

    @property
    def values(self) -> torch.Tensor:
        return self._full(self.owner.v, "v")


class KVBuffers:
    """Per-layer key/value buffers ``[B, H_kv, capacity, D]``, the first ``length`` filled.

    Built from the per-layer ``(keys, values)`` of a prompt's forward pass with room for
    ``extra`` more tokens. ``layers[l].keys`` / ``.values`` view the filled part (the
    shape the sampler's row extraction reads); :meth:`batch_select_indices` keeps rows.

    With ``shared`` (a :class:`~trajgrad.model.shared_prefix.SharedPrefix` of width ``W``),
    the first ``W`` columns of ``layers_kv`` are the rows' prefixes, which ``shared`` holds
    once per group: the buffers keep only the columns after them (``offset = W``);
    ``length`` and ``capacity`` still count the prefix.
    """

    def __init__(self, layers_kv, extra: int, shared: Optional[SharedPrefix] = None):
        if extra < 0:
            raise ValueError(f"extra: must be >= 0, got {extra}")
        self.shared = shared
        self.offset = 0 if shared is None else shared.width
        self.k: List[torch.Tensor] = []
        self.v: List[torch.Tensor] = []
        self.length = int(layers_kv[0][0].shape[2])
        if self.offset > self.length:
            raise ValueError(f"shared: its width {self.offset} exceeds the {self.length} cached tokens")
        cap = self.length - self.offset + int(extra)
        for k, v in layers_kv:
            B, H, T, D = k.shape
            kb = k.new_empty((B, H, cap, D))
            vb = v.new_empty((B, v.shape[1], cap, v.shape[3]))
            kb[:, :, :T - self.offset] = k[:, :, self.offset:]
            vb[:, :, :T - self.offset] = v[:, :, self.offset:]
            self.k.append(kb)
            self.v.append(vb)
        self.layers = [_LayerView(self, i) for i in range(len(self.k))]

    @classmethod
    def after_prefix(cls, shared: SharedPrefix, rows: int, extra: int, dtype: torch.dtype) -> "KVBuffers":
        """Buffers of ``rows`` rows holding only ``shared``'s prefixes (``length = offset =
        width``, no token of a row's own yet), with room for ``extra`` tokens in ``dtype``."""
        layers = [(k[:1].to(dtype).expand(rows, -1, -1, -1), v[:1].to(dtype).expand(rows, -1, -1, -1))
                  for k, v in zip(shared.k, shared.v)]
        return cls(layers, extra, shared=shared)

    @property
    def capacity(self) -> int:
        return self.offset + int(self.k[0].shape[2])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.k = [k.index_select(0, indices) for k in self.k]
        self.v = [v.index_select(0, indices) for v in self.v]
        if self.shared is not None:
            self.shared = self.shared.select(indices)

    def rows_kv(self, rows: torch.Tensor, mask: torch.Tensor) -> List[RowKV]:
        """Each of ``rows``' :class:`~trajgrad.model.kv.RowKV` (its real tokens); ``mask``:
        ``[B, length]``, 1 at real tokens. With a shared prefix, the row's prefix is the
        :class:`RowKV` it came with, the rest is read from the buffers."""
        out = []
        n = self.length - self.offset
        for i in rows.tolist():
            keep = mask[i, self.offset:].bool()
            # boolean indexing copies: the row owns its tensors (the buffers are reused)
            ks = [k[i, :, :n][:, keep, :] for k in self.k]
            vs = [v[i, :, :n][:, keep, :] for v in self.v]
            if self.shared is not None:
                head = self.shared.rows[i]
                ks = [torch.cat([h.to(x.dtype), x], dim=1) for h, x in zip(head.keys, ks)]
                vs = [torch.cat([h.to(x.dtype), x], dim=1) for h, x in zip(head.values, vs)]
            out.append(RowKV(ks, vs))
        return out


@torch.no_grad()
def decode_step(backbone: torch.nn.Module, buffers: KVBuffers, token: torch.Tensor, position: torch.Tensor,
                attention_mask: torch.Tensor, plan: Optional[DecodePlan] = None) -> torch.Tensor:
    """Run one new token per row; return the final-norm hidden state ``[B, hidden]``.

    Args:
      backbone: from :func:`fast_backbone`.
      buffers: the rows' cached keys/values; the new token's are written at ``length``.
      token: ``[B]`` token ids; position: ``[B]`` their position ids.
      attention_mask: ``[B, length + 1]`` (1 = real token, 0 = padding), covering the
        cached tokens and the new one.
      plan: the layers' calls (:class:`~trajgrad.model.decode_plan.DecodePlan` of this
        ``backbone``, made with its current weights); ``None`` makes one for this call.
    """
    B = token.shape[0]
    L = buffers.length
    if L >= buffers.capacity:
        raise ValueError(f"buffers: full ({buffers.capacity} tokens); no room for another token")
    if tuple(attention_mask.shape) != (B, L + 1):
        raise ValueError(f"attention_mask: expected shape {(B, L + 1)}, got {tuple(attention_mask.shape)}")
    if plan is None:
        plan = DecodePlan(backbone)
    elif plan.backbone is not backbone:
        raise ValueError("plan: made for another backbone")
    x = backbone.embed_tokens(token[:, None])
    cos, sin = plan.cos_sin(x, position)  # [B, 1, D]: broadcast over the heads of [B, heads, D]
    mask = attention_mask.bool()[:, None, None, :]
    shared, off = buffers.shared, buffers.offset
    if shared is not None:
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    n = L - off  # each row's tokens in the buffers, before the new one
    for i, (layer, p) in enumerate(zip(backbone.layers, plan.layers)):
        attn, mlp = layer.self_attn, layer.mlp
        D = attn.head_dim
        kb, vb = buffers.k[i], buffers.v[i]
        Hkv = kb.shape[1]
        h = p.norm_in(x)
        if p.qkv is not None:  # one product, then q and k rotated together: [B, H + 2 H_kv, D]
            W, b, sizes = p.qkv
            qkv = torch.nn.functional.linear(h, W, b).view(B, -1, D)
            H = sizes[0] // D
            qk = rope(qkv[:, :H + Hkv], cos, sin)
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]
        else:
            q = rope(attn.q_proj(h).view(B, -1, D), cos, sin)
            k = rope(attn.k_proj(h).view(B, -1, D), cos, sin)
            v = attn.v_proj(h).view(B, -1, D)
            H = q.shape[1]
        kb[:, :, n] = k
        vb[:, :, n] = v
        # the H / H_kv query heads of a key/value group attend as that group's queries
        qg = q.reshape(B, Hkv, H // Hkv, D)
        if shared is None:
            o = torch.nn.functional.scaled_dot_product_attention(
                qg, kb[:, :, :n + 1], vb[:, :, :n + 1], attn_mask=mask, scale=attn.scaling)
        else:
            o = shared_prefix_attention(qg, shared, i, kb[:, :, :n + 1], vb[:, :, :n + 1], bias, attn.scaling)
        x = x + attn.o_proj(o.reshape(B, 1, H * D))
        h = p.norm_post(x)
        if p.gate_up is not None:
            W, b, sizes = p.gate_up
            g, u = torch.nn.functional.linear(h, W, b).split(sizes, dim=-1)
            x = x + mlp.down_proj(mlp.act_fn(g) * u)
        else:
            x = x + mlp(h)
    buffers.length = L + 1
    return plan.final_norm(x)[:, -1]
