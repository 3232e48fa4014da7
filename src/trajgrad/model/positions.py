r"""Position ids and shared-prefix groups of a batch of token rows.

* :func:`position_ids_from_attention_mask`: a token's position is its index among the
  non-padding tokens of its row, so the left-padded sampler and the right-padded learner
  give it the same position (and evaluate the same function, §24).
* :func:`prefix_groups`: rows that start with the same tokens (a GRPO group's prompt, a
  shared system prompt), so that the prefix runs once per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["PrefixGroups", "position_ids_from_attention_mask", "prefix_groups"]


def position_ids_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of every token counted over the non-padding tokens before it.

    ``attention_mask`` ``[B, T]`` (0/1, left or right padding) -> ``[B, T]`` long; padding
    slots get 0. Both the left-padded sampler and the right-padded learner use it, so a
    token has the same position in both.
    """
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask: expected a 2-D tensor, got shape {tuple(attention_mask.shape)}")
    am = attention_mask.long()
    return (am.cumsum(-1) - 1).clamp(min=0) * am


@dataclass(frozen=True)
class PrefixGroups:
    """Rows that start with the same ``length`` tokens.

    ``rows[u]`` is a representative row of group ``u`` and ``index[b]`` the group of row
    ``b``: row ``rows[index[b]]`` has the same first ``length`` tokens as row ``b``.
    """

    length: int
    rows: torch.Tensor  # [U] long
    index: torch.Tensor  # [B] long

    @property
    def saved_tokens(self) -> int:
        """Token positions not computed when each group's prefix runs once."""
        return (int(self.index.numel()) - int(self.rows.numel())) * self.length


def prefix_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    min_prefix: int = 16,
    max_elements: int = 50_000_000,
) -> Optional[PrefixGroups]:
    r"""The prefix length :math:`P` and grouping of rows that saves the most computation.

    Rows whose first :math:`P` tokens are identical form a group; running each group's
    prefix once saves :math:`(B - U(P))\,P` token positions for :math:`U(P)` groups. The
    candidate lengths are the pairwise common-prefix lengths of the rows (a GRPO group
    shares its prompt; a whole batch may share a system prompt and few-shot example),
    capped so that every row keeps at least one token after the prefix and the prefix
    holds attended tokens only. Returns ``None`` for one row, when nothing of length
    ``>= min_prefix`` is shared, or when the pairwise comparison would exceed
    ``max_elements`` (``B * B * T``).
    """
    if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids: expected [B, T] with an attention_mask of the same shape, got "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    B, T = input_ids.shape
    if B < 2 or B * B * T > max_elements:
        return None
    att = attention_mask.bool()
    lead = att.long().cumprod(1).sum(1)  # attended tokens before a row's first padding
    cap = min(int(att.sum(1).min()) - 1, int(lead.min()))
    if cap < max(int(min_prefix), 1):
        return None
    same = (input_ids[:, None, :] == input_ids[None, :, :]) & att[:, None, :] & att[None, :, :]
    lcp = same.long().cumprod(-1).sum(-1).clamp(max=cap)  # [B, B] common-prefix lengths
    lower = torch.ones(B, B, dtype=torch.bool).tril(-1)
    best, best_p = 0, 0
    for p in sorted(set(lcp[lower].tolist()), reverse=True):
        if p < min_prefix:
            break
        joined = int(((lcp >= p) & lower).any(1).sum())  # rows that join an earlier row's group
        if joined * p > best:
            best, best_p = joined * p, int(p)
    if best == 0:
        return None
    member = (lcp >= best_p) | torch.eye(B, dtype=torch.bool)
    first = member.long().argmax(1)  # the earliest row with the same prefix
    rows, index = torch.unique(first, sorted=True, return_inverse=True)
    return PrefixGroups(length=best_p, rows=rows, index=index)

