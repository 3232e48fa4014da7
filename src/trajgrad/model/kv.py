r"""KV-cache plumbing: the cache argument of a forward call, and per-row keys/values.

* :func:`cache_kwarg` / :func:`output_cache`: the name under which a Hugging Face forward
  takes and returns its cache (it changed across transformers releases).
* :class:`RowKV`: the cached keys and values of one row (what a multi-turn episode keeps
  between its turns); :func:`extract_rows` reads rows out of a batched ``DynamicCache``,
  :func:`batched_cache` left-pads rows back into one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .parts import causal_lm

__all__ = ["RowKV", "batched_cache", "cache_kwarg", "cache_layers", "empty_row", "extract_rows", "output_cache"]


def cache_kwarg(model) -> str:
    """Name of the forward argument that takes the KV cache (``cache`` in recent
    transformers, ``past_key_values`` before)."""
    import inspect

    base = causal_lm(model)
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - exotic wrappers
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out):
    """The KV cache a forward pass returned (``cache`` or ``past_key_values``)."""
    cache = out.get("cache") if hasattr(out, "get") else None
    if cache is None:
        cache = out.get("past_key_values") if hasattr(out, "get") else getattr(out, "past_key_values", None)
    return cache


@dataclass
class RowKV:
    """The cached keys and values of the first ``length`` tokens of one row.

    ``keys[l]`` / ``values[l]`` have shape ``[heads, length, head_dim]`` for layer ``l``.
    Produced and consumed by :func:`trajgrad.rollout.generation.sample_actions` (``past_kv`` / ``return_kv``).
    """

    keys: List[torch.Tensor]
    values: List[torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[-2]) if self.keys else 0


def cache_layers(cache) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """``[(keys, values), ...]`` of a ``DynamicCache`` (``[B, H, T, D]`` each), or None."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    out = []
    for layer in layers:
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
            return None
        out.append((k, v))
    return out


def extract_rows(cache, rows: torch.Tensor, mask: torch.Tensor) -> Optional[List[RowKV]]:
    """Per-row :class:`RowKV` for ``rows`` of a batched cache; ``mask`` [B, T] marks real tokens.

    A cache with its own ``rows_kv(rows, mask)`` (the decode step's buffers) reads them itself."""
    if hasattr(cache, "rows_kv"):
        return cache.rows_kv(rows, mask)
    layers = cache_layers(cache)
    if layers is None:
        return None
    out = []
    for i in rows.tolist():
        keep = mask[i].bool()
        # boolean indexing copies: the row owns its tensors (the batch buffers are reused)
        out.append(RowKV([k[i][:, keep, :] for k, _ in layers], [v[i][:, keep, :] for _, v in layers]))
    return out


def batched_cache(past: Sequence[RowKV], device) -> Tuple[Any, torch.Tensor]:
    """A left-padded ``DynamicCache`` holding ``past`` and its attention mask ``[B, Lc]``."""
    from transformers import DynamicCache

    B = len(past)
    Lc = max(p.length for p in past)
    n_layers = len(past[0].keys)
    mask = torch.zeros((B, Lc), dtype=torch.long, device=device)
    data = []
    for layer in range(n_layers):
        k0, v0 = past[0].keys[layer], past[0].values[layer]
        K = k0.new_zeros((B, k0.shape[0], Lc, k0.shape[-1]))
        V = v0.new_zeros((B, v0.shape[0], Lc, v0.shape[-1]))
        for b, p in enumerate(past):
            n = p.length
            if n:
                K[b, :, Lc - n:, :] = p.keys[layer]
                V[b, :, Lc - n:, :] = p.values[layer]
        data.append((K, V))
    for b, p in enumerate(past):
        if p.length:
            mask[b, Lc - p.length:] = 1
    return DynamicCache(ddp_cache_data=data), mask


def empty_row(like: RowKV) -> RowKV:
    return RowKV([k[:, :0, :] for k in like.keys], [v[:, :0, :] for v in like.values])

