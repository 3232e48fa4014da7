r"""Position ids and shared-prefix groups of a batch of token rows.

* :func:`position_ids_from_attention_mask`: a token's position is its index among the
  non-padding tokens of its row, so the left-padded sampler and the right-padded learner
  give it the same position (and evaluate the same function, §24).
* :func:`prefix_groups`: rows that start with the same tokens (a GRPO group's prompt, a
  shared system prompt), so that the prefix runs once per group; each group's prefix is as
  long as its rows share (prompts of different lengths in one batch).
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
    """Rows grouped by their first ``length`` tokens; group ``u`` shares ``lengths[u]``.

    ``rows[u]`` is a representative row of group ``u`` and ``index[b]`` the group of row
    ``b``: row ``rows[index[b]]`` has the same first ``lengths[index[b]]`` tokens as row
    ``b``. ``length`` is the grouping's threshold: a group of two or more rows shares at
    least that many tokens. Every row keeps at least one attended token after its group's
    prefix.
    """

    length: int
    rows: torch.Tensor  # [U] long
    index: torch.Tensor  # [B] long
    lengths: torch.Tensor  # [U] long, each >= length

    @property
    def saved_tokens(self) -> int:
        r"""Token positions not computed when each group's prefix runs once:
        :math:`\sum_b P_{u(b)} - \sum_u P_u`."""
        return int(self.lengths[self.index].sum()) - int(self.lengths.sum())


def prefix_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    min_prefix: int = 16,
    max_elements: int = 50_000_000,
    per_group: bool = True,
) -> Optional[PrefixGroups]:
    r"""The grouping of rows that saves the most computation, and each group's prefix length.

    For a threshold :math:`P`, rows whose first :math:`P` tokens are identical form a
    group :math:`u`, which shares what all its rows share,
    :math:`P_u = \min_{b, c \in u} \mathrm{lcp}(b, c) \ge P`, so prompts of different
    lengths each run once whole. Running each group's prefix once saves
    :math:`\sum_b P_{u(b)} - \sum_u P_u` token positions; the threshold saving the most is
    chosen among the pairwise common-prefix lengths of the rows (a GRPO group shares its
    prompt; a whole batch may share a system prompt and few-shot example). Common prefixes
    are capped so that every row keeps at least one attended token after its prefix and a
    prefix holds attended tokens only (a group of one row saves nothing and keeps
    :math:`\min(P, \text{its cap})`). Returns ``None`` for one row, when no two rows share
    ``>= min_prefix`` tokens, or when the pairwise comparison would exceed
    ``max_elements`` (``B * B * T``).

    ``per_group=False``: one length for every group, :math:`P_u = P` (a rectangular prefix
    batch), the :math:`P` saving the most, :math:`(B - U(P))\,P`, within every row's cap.
    """
    if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids: expected [B, T] with an attention_mask of the same shape, got "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    if not isinstance(per_group, bool):
        raise ValueError(f"per_group: expected a bool, got {per_group!r}")
    B, T = input_ids.shape
    if B < 2 or B * B * T > max_elements:
        return None
    att = attention_mask.bool()
    lead = att.long().cumprod(1).sum(1)  # attended tokens before a row's first padding
    same = (input_ids[:, None, :] == input_ids[None, :, :]) & att[:, None, :] & att[None, :, :]
    row_cap = torch.minimum(att.sum(1) - 1, lead)  # [B]: a token left after the prefix, attended only
    # [B, B] common-prefix lengths, within both rows' caps
    lcp = torch.minimum(same.long().cumprod(-1).sum(-1), torch.minimum(row_cap[:, None], row_cap[None, :]))
    lower = torch.ones(B, B, dtype=torch.bool, device=lcp.device).tril(-1)
    eye = torch.eye(B, dtype=torch.bool, device=lcp.device)
    if not per_group:
        lcp = lcp.clamp(max=int(row_cap.min()))
    best, chosen = 0, None
    for p in sorted(set(lcp[lower].tolist()), reverse=True):
        if p < max(int(min_prefix), 1):
            break
        grouping = _grouping(lcp, eye, row_cap, int(p))
        if not per_group:
            grouping = (*grouping[:2], torch.full_like(grouping[2], int(p)))
        saved = int(grouping[2][grouping[1]].sum() - grouping[2].sum())
        if saved > best:
            best, chosen = saved, (int(p), *grouping)
    if chosen is None:
        return None
    best_p, rows, index, lengths = chosen
    return PrefixGroups(length=best_p, rows=rows, index=index, lengths=lengths)


def _grouping(lcp: torch.Tensor, eye: torch.Tensor, row_cap: torch.Tensor, p: int):
    """(representative rows, group of each row, each group's shared length) for threshold ``p``:
    rows whose (capped) common prefix is ``>= p`` form a group, which shares the smallest
    common prefix among its rows (a group of one row: ``p`` within its cap; it saves nothing)."""
    member = (lcp >= p) | eye
    first = member.long().argmax(1)  # the earliest row with the same first p tokens
    rows, index = torch.unique(first, sorted=True, return_inverse=True)
    within = lcp.masked_fill(index[:, None] != index[None, :], torch.iinfo(torch.long).max)
    per_row = within.min(1).values  # the smallest over the row's group (itself included: its cap)
    lengths = torch.zeros(rows.numel(), dtype=torch.long, device=lcp.device).scatter_reduce(
        0, index, per_row, "amin", include_self=False)
    single = torch.bincount(index, minlength=rows.numel()) == 1
    return rows, index, torch.where(single, row_cap[rows].clamp(max=p), lengths)

