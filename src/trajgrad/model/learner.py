r"""The learner's view of a causal LM: token log-probs, entropy and head inputs from hidden states.

Log-probs are computed from the final hidden states with
:func:`trajgrad.fused.fused_token_logprobs` (chunked, recomputed in backward), so the
``[B, L, V]`` logits of a batch are never held. The head runs in float32 even when the
backbone is bfloat16: log-probs feed exponentials (ratios), where bf16 rounding alone moves a
ratio by ~1%. When the sampler truncated the distribution (top-k / top-p), the learner uses
:func:`trajgrad.logprobs.token_logprobs` with the same transform on the valid positions
only (§7: the denominator must be the distribution that sampled).

Positions come from :func:`trajgrad.model.positions.position_ids_from_attention_mask`, the
function the sampler uses, so both evaluate the model at the same positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .. import logprobs as lp
from ..fused import fused_entropy, fused_token_logprobs
from .kv import cache_kwarg, output_cache
from .parts import causal_parts
from .positions import position_ids_from_attention_mask, prefix_groups

__all__ = ["LearnerOutput", "causal_parts", "head_inputs", "learner_logprobs"]


@dataclass
class LearnerOutput:
    logp: torch.Tensor  # [B, T-1] (0 at masked positions)
    hidden: Optional[torch.Tensor]  # [B, T-1, H] detached float32 (for the value head), if requested
    entropy: Optional[torch.Tensor]  # [B, T-1] (no grad), if requested


def _stochastic(model: nn.Module) -> bool:
    """True when a forward pass is random (dropout active): rows must then run separately."""
    if not model.training:
        return False
    for m in model.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "attention_dropout", 0.0) or 0.0)


def _sharded(backbone: nn.Module) -> bool:
    """True when FSDP2 shards a layer of ``backbone``: each forward then all-gathers, so every
    rank must run the same number of forwards (the shared-prefix path runs two, or one)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - builds without distributed support
        return False
    return any(isinstance(m, FSDPModule) for m in backbone.modules())


def _spreader(index: torch.Tensor, groups: int):
    """``x -> x[index]`` along dim 0 (each group's prefix, read by its rows; the grad sums them).

    Rows in equal consecutive blocks (a GRPO batch: ``G`` samples of each prompt in turn) expand
    each group ``G`` times, whose backward is one sum over the block (about 4x cheaper than
    ``index_add_`` on the strided gradient the cache's concatenation hands back: 0.25 ms against
    1.05 ms for 8 x 8 rows of ``[4, 35, 32]``, one thread). Otherwise ``index_select``,
    not advanced indexing: the backward of ``x[idx]`` is ``index_put_(accumulate=True)``, which on
    a CPU with more than one thread adds rows with atomic float adds in the order the threads reach
    them (gradients differed in the last bits from run to run); ``index_select``'s backward
    (``index_add_``) adds the rows one index after another, the same sum every time."""
    B = index.numel()
    if B % groups == 0 and torch.equal(index, torch.arange(groups, device=index.device).repeat_interleave(B // groups)):
        G = B // groups
        return lambda x: x.unsqueeze(1).expand(groups, G, *x.shape[1:]).reshape(B, *x.shape[1:])
    return lambda x: x.index_select(0, index)


def head_inputs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                share_prefix: bool = True, min_prefix: int = 16):
    r"""(hidden ``[B, T-1, H]`` float32, head weight ``[V, H]`` float32, bias or None).

    The final hidden states that predict ``input_ids[:, 1:]`` and the output head, so that
    a loss can form logits chunk by chunk (``trajgrad.fused``, ``reverse_kl_distill_loss``).

    Shared prefixes: rows that start with the same ``P >= min_prefix`` attended tokens (a
    GRPO group's prompt, a few-shot preamble; :func:`trajgrad.model.positions.prefix_groups`
    picks the ``P`` that saves most) run that prefix once per group, and the rest of every
    row attends to its group's keys and values. This is the same function of the same
    tokens (causal attention: a prefix position never sees what follows), and the gradient
    is exact: it reaches the prefix computation through both its hidden states and the
    keys/values every row reads (autograd sums over the rows of a group). Skipped when a
    forward pass is random (dropout), uses gradient checkpointing, or runs FSDP-sharded
    layers (every rank must then make the same forward calls, whatever its rows share).

    Columns after the last attended one (padding a micro-batch carries from its batch) are
    not computed; their hidden states are zeros (they are masked in every use).
    """
    backbone, head = causal_parts(model)
    T = input_ids.shape[1]
    # trailing columns that no row attends (a micro-batch of a longer batch) are not run;
    # their hidden states are returned as zeros
    cols = attention_mask.bool().any(0).nonzero()
    used = int(cols.max()) + 1 if cols.numel() else T
    if 1 < used < T:
        hidden, weight, bias = head_inputs(model, input_ids[:, :used], attention_mask[:, :used],
                                           share_prefix=share_prefix, min_prefix=min_prefix)
        return torch.nn.functional.pad(hidden, (0, 0, 0, T - used)), weight, bias
    pos = position_ids_from_attention_mask(attention_mask)
    checkpointing = bool(getattr(backbone, "gradient_checkpointing", False))
    groups = None
    if share_prefix and not checkpointing and not _stochastic(model) and not _sharded(backbone):
        # one prefix length for every group: a rectangular prefix pass (per-group lengths, which
        # the sampler uses, measured no faster here: bench/results/trl.md)
        groups = prefix_groups(input_ids, attention_mask, min_prefix=min_prefix, per_group=False)
    if groups is not None:
        from transformers import DynamicCache

        kw = cache_kwarg(backbone)
        B, P, reps, idx = input_ids.shape[0], groups.length, groups.rows, groups.index
        first = backbone(input_ids=input_ids[reps, :P], attention_mask=attention_mask[reps, :P],
                         position_ids=pos[reps, :P], use_cache=True, **{kw: DynamicCache()})
        cache = output_cache(first)
        spread = _spreader(idx, reps.numel())
        for layer in cache.layers:
            layer.keys, layer.values = spread(layer.keys), spread(layer.values)
        rest = backbone(input_ids=input_ids[:, P:], attention_mask=attention_mask, position_ids=pos[:, P:],
                        use_cache=True, **{kw: cache})
        full = torch.cat([spread(first.last_hidden_state), rest.last_hidden_state], dim=1)
    else:
        out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False)
        full = out.last_hidden_state
    hidden = full[:, :-1].float()
    weight = head.weight.float()
    bias = head.bias.float() if getattr(head, "bias", None) is not None else None
    return hidden, weight, bias


def learner_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    want_hidden: bool = False,
    want_entropy: bool = False,
    chunk_size: "int | str" = "auto",
) -> LearnerOutput:
    """Log-probs of ``input_ids[:, 1:]`` under ``model`` (§4 alignment), masked by ``action_mask``."""
    h32, weight, bias = head_inputs(model, input_ids, attention_mask)
    targets = input_ids[:, 1:]
    mask = action_mask.bool()
    t = max(float(temperature), 1e-8) if temperature and temperature > 0 else 1.0
    ent = None
    if top_k is None and (top_p is None or top_p >= 1.0):
        # the entropy, when wanted, is read off the same logits (no second pass over the head)
        res = fused_token_logprobs(h32, weight, targets, bias=bias, temperature=t, chunk_size=chunk_size, mask=mask,
                                   with_entropy=bool(want_entropy))
        logp, ent = res if want_entropy else (res, None)
    else:
        idx = mask.nonzero(as_tuple=True)
        rows = h32[idx]  # [N, H]
        logits = rows @ weight.T
        if bias is not None:
            logits = logits + bias
        sel = lp.token_logprobs(logits[None], targets[idx][None], temperature=t, top_k=top_k, top_p=top_p)[0]
        logp = torch.zeros_like(targets, dtype=sel.dtype).index_put(idx, sel)
    if want_entropy and ent is None:
        with torch.no_grad():
            ent = fused_entropy(h32.detach(), weight.detach(), bias=None if bias is None else bias.detach(),
                                temperature=t, chunk_size=chunk_size, mask=mask)
    return LearnerOutput(logp=logp, hidden=h32.detach() if want_hidden else None, entropy=ent)
