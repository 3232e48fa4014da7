r"""Decode attention over prompt prefixes that several rows share, each prefix's keys kept once.

A GRPO batch samples :math:`G` continuations of each prompt: every row of a group has the
same prompt, so the same keys and values for it. Kept per row, a decode step reads those
keys :math:`G` times; kept once per group (cascade, or shared-prefix, attention), it reads
them once. For row :math:`b` of group :math:`s(b)`, with query :math:`q_{b}` of one head,
the prefix's keys/values :math:`K^{p}_{s}, V^{p}_{s}` and the row's own tokens after the
prefix :math:`K^{o}_{b}, V^{o}_{b}`:

.. math::

   a_b = \frac{[\,q_b K^{p\top}_{s(b)},\; q_b K^{o\top}_{b}\,]}{\sqrt{d}} + m_b, \qquad
   o_b = \operatorname{softmax}(a_b)\,\begin{bmatrix} V^{p}_{s(b)} \\ V^{o}_{b} \end{bmatrix},

the attention over the concatenated keys, softmax over all of them at once (so the
function is the one of :func:`~trajgrad.model.decode.decode_step` without a prefix, up to
float rounding); :math:`m_b` is 0 at real tokens and :math:`-\infty` at padding. The
queries of a group are stacked so that :math:`q K^{p\top}` and the product with
:math:`V^{p}` are one matrix product per group and key/value head. Scores and softmax are
computed in float32, as the CPU kernel of ``scaled_dot_product_attention`` accumulates.

:class:`SharedPrefix` holds the prefixes (``[S, H_kv, W, D]`` per layer, left padded to the
widest ``W``) and each row's *slot*: group ``s`` and place ``j`` in it, ``s * G_max + j``.
Dropping rows (ended ones) keeps the prefixes and drops the rows' slots.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .kv import RowKV

__all__ = ["SharedPrefix", "shared_prefix_attention"]


class SharedPrefix:
    """Per-layer keys/values of the distinct prefixes of a batch, and each row's slot.

    Build it with :meth:`from_rows`. ``k[l]`` / ``v[l]``: ``[S, H_kv, width, D]`` float32,
    prefix ``s`` in its last ``rows[...].length`` columns (left padding is zeros, masked by
    the rows' attention mask); ``slot``: ``[B]`` long; ``rows``: each row's :class:`RowKV`.
    """

    def __init__(self, k: List[torch.Tensor], v: List[torch.Tensor], slot: torch.Tensor, group_size: int,
                 rows: List[RowKV]):
        self.k, self.v, self.slot, self.group_size, self.rows = k, v, slot, int(group_size), rows
        self.groups = int(k[0].shape[0])
        self.width = int(k[0].shape[2])
        # every slot filled in order: the queries are a view, no scatter or gather
        self.identity = slot.numel() == self.groups * self.group_size and bool(
            torch.equal(slot, torch.arange(slot.numel(), device=slot.device)))

    @classmethod
    def from_rows(cls, past: Sequence[Optional[RowKV]], width: int, device) -> Optional["SharedPrefix"]:
        """Group the rows by their :class:`RowKV` object (the same object = the same prefix).

        Returns None where sharing saves nothing: a row without a prefix, fewer than two
        rows per prefix on average, or groups so uneven that the padded slots
        (``S * G_max``) exceed twice the rows.
        """
        if not past or any(p is None or p.length == 0 for p in past):
            return None
        index, members = {}, []
        for b, p in enumerate(past):
            s = index.setdefault(id(p), len(index))
            if s == len(members):
                members.append([])
            members[s].append(b)
        S, B = len(members), len(past)
        g_max = max(len(m) for m in members)
        if B < 2 * S or S * g_max > 2 * B:
            return None
        if any(p.length > width for p in past):
            raise ValueError(f"width: {width} is shorter than a row's prefix")
        slot = torch.empty(B, dtype=torch.long)
        for s, rows in enumerate(members):
            for j, b in enumerate(rows):
                slot[b] = s * g_max + j
        first = [past[m[0]] for m in members]
        k, v = [], []
        for layer in range(len(first[0].keys)):
            k0, v0 = first[0].keys[layer], first[0].values[layer]
            K = torch.zeros((S, k0.shape[0], width, k0.shape[-1]), dtype=torch.float32, device=device)
            V = torch.zeros((S, v0.shape[0], width, v0.shape[-1]), dtype=torch.float32, device=device)
            for s, p in enumerate(first):
                K[s, :, width - p.length:] = p.keys[layer]
                V[s, :, width - p.length:] = p.values[layer]
            k.append(K)
            v.append(V)
        return cls(k, v, slot.to(device), g_max, list(past))

    def select(self, indices: torch.Tensor) -> "SharedPrefix":
        """The same prefixes for the rows ``indices`` (in that order)."""
        rows = [self.rows[i] for i in indices.tolist()]
        return SharedPrefix(self.k, self.v, self.slot[indices], self.group_size, rows)

    def expanded(self, layer: int, which: str) -> torch.Tensor:
        """Per-row copies ``[B, H_kv, width, D]`` of one layer's prefix keys (``which="k"``) or
        values (``"v"``), in float32: what a cache without sharing would hold."""
        t = (self.k if which == "k" else self.v)[layer]
        return t[torch.div(self.slot, self.group_size, rounding_mode="floor")]


def _to_slots(x: torch.Tensor, shared: SharedPrefix) -> torch.Tensor:
    """Per-row ``[B, H_kv, n, m]`` -> per-group ``[S, H_kv, G_max * n, m]`` (empty slots zero)."""
    B, Hkv, n, m = x.shape
    S, G = shared.groups, shared.group_size
    if not shared.identity:
        full = x.new_zeros((S * G, Hkv, n, m))
        full[shared.slot] = x
        x = full
    return x.reshape(S, G, Hkv, n, m).transpose(1, 2).reshape(S, Hkv, G * n, m)


def _from_slots(x: torch.Tensor, shared: SharedPrefix, n: int) -> torch.Tensor:
    """Inverse of :func:`_to_slots`: ``[S, H_kv, G_max * n, m]`` -> per-row ``[B, H_kv, n, m]``."""
    S, Hkv, _, m = x.shape
    G = shared.group_size
    x = x.view(S, Hkv, G, n, m).transpose(1, 2).reshape(S * G, Hkv, n, m)
    return x if shared.identity else x[shared.slot]


def shared_prefix_attention(q: torch.Tensor, shared: SharedPrefix, layer: int, own_k: torch.Tensor,
                            own_v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention of the module docstring for one layer.

    Args:
      q: ``[B, H_kv, n_q, D]`` (the ``n_q = H / H_kv`` query heads of a key/value group).
      shared: the prefixes; ``layer`` picks its keys/values.
      own_k, own_v: ``[B, H_kv, n, D]``, each row's keys/values after the prefix.
      bias: ``[B, 1, 1, width + n]`` float, 0 at real tokens and ``-inf`` at padding.
      scale: the score scale (``1 / sqrt(D)`` for Llama).

    Returns ``[B, H_kv, n_q, D]`` in ``q``'s dtype.
    """
    nq = q.shape[2]
    qf = q.float()
    prefix_scores = _from_slots(torch.matmul(_to_slots(qf, shared), shared.k[layer].transpose(-1, -2)), shared, nq)
    own_scores = torch.matmul(qf, own_k.float().transpose(-1, -2))
    scores = torch.cat([prefix_scores, own_scores], dim=-1).mul_(scale).add_(bias)
    w = torch.softmax(scores, dim=-1)
    W = shared.width
    out = _from_slots(torch.matmul(_to_slots(w[..., :W], shared), shared.v[layer]), shared, nq)
    out = out + torch.matmul(w[..., W:], own_v.float())
    return out.to(q.dtype)
