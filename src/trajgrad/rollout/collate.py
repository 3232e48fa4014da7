r"""Trajectories -> one right-padded batch of tensors for the learner.

Row ``b`` of :class:`RolloutBatch` is ``trajectories[b].token_ids()`` followed by padding.
Per-token fields are aligned with the targets ``input_ids[:, 1:]`` (§4), so they are
``[B, T-1]``. Padding targets have ``action_mask`` 0, ``old_logp`` NaN,
``policy_version`` -1 and ``turn_ids`` 0.

``old_logp`` holds the behaviour log-probabilities recorded at sampling time (§7) and NaN
at every position that is not an action token: a loss that reads it without its mask
produces NaN instead of a silently wrong number.

The learner must feed ``position_ids`` (computed from ``attention_mask`` by
:func:`position_ids_from_attention_mask`) to the model, as the sampler does with its
left-padded batches; the position of a token is then the same in both, and the learner
recomputes exactly the behaviour log-probabilities when the weights did not change (§24).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from .trajectory import NO_VERSION, Trajectory

__all__ = ["PrefixGroups", "RolloutBatch", "collate", "position_ids_from_attention_mask", "prefix_groups"]


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


@dataclass
class RolloutBatch:
    r"""A right-padded batch of trajectories.

    Attributes (``B`` trajectories, ``T`` the longest token sequence, ``K`` the most turns):
      input_ids: ``[B, T]`` long, right padded with ``pad_id``.
      attention_mask: ``[B, T]`` long, 1 on real tokens.
      position_ids: ``[B, T]`` long, from ``attention_mask``.
      action_mask: ``[B, T-1]`` bool, True on action targets (tokens the policy sampled).
      old_logp: ``[B, T-1]`` float, behaviour log-probs at action targets, NaN elsewhere.
      policy_version: ``[B, T-1]`` long, sampling policy version at action targets, -1
        elsewhere (§16).
      turn_ids: ``[B, T-1]`` long, the turn each target belongs to (0 on prompt/padding).
      turn_rewards: ``[B, K]`` float, reward of each turn, 0 past the last turn.
      turn_mask: ``[B, K]`` bool, True for existing turns.
      turn_costs: ``[B, K]`` float, ``info["cost"]`` of each turn (§22), 0 if absent.
      turn_potentials: ``[B, K]`` float, ``info["potential"]`` :math:`\Phi(s_{t+1})` (§21),
        0 if absent.
      initial_potential: ``[B]`` float, :math:`\Phi(s_0)` (``metadata["initial_potential"]``,
        0 if absent).
      rewards: ``[B]`` float, total reward of each trajectory.
      success: ``[B]`` bool (False where unknown).
      terminated, truncated: ``[B]`` bool.
      segments: ``[B]`` long, sub-trace index within the episode (§19).
      group_ids: ``[B]`` long, equal for trajectories of the same task (numbered in order of
        first appearance).
      task_ids, episode_ids: the trajectories' ids.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    action_mask: torch.Tensor
    old_logp: torch.Tensor
    policy_version: torch.Tensor
    turn_ids: torch.Tensor
    turn_rewards: torch.Tensor
    turn_mask: torch.Tensor
    turn_costs: torch.Tensor
    turn_potentials: torch.Tensor
    initial_potential: torch.Tensor
    rewards: torch.Tensor
    success: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    segments: torch.Tensor
    group_ids: torch.Tensor
    task_ids: List[str]
    episode_ids: List[str]

    @property
    def targets(self) -> torch.Tensor:
        """``input_ids[:, 1:]``, the tokens the per-token fields describe."""
        return self.input_ids[:, 1:]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device) -> "RolloutBatch":
        """A copy with every tensor moved to ``device``."""
        kw: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device) if isinstance(v, torch.Tensor) else v
        return RolloutBatch(**kw)

    def next_segment_rows(self) -> torch.Tensor:
        """``[B]`` long: the row holding the same episode's next sub-trace (``segment + 1``,
        §19), or -1 where it is not in the batch (the last sub-trace, or one not collated)."""
        where = {(e, int(s)): i for i, (e, s) in enumerate(zip(self.episode_ids, self.segments.tolist()))}
        return torch.tensor([where.get((e, int(s) + 1), -1) for e, s in zip(self.episode_ids, self.segments.tolist())],
                            dtype=torch.long)

    def select(self, index: Sequence[int]) -> "RolloutBatch":
        """Rows ``index`` (for micro-batches); the padded length is kept."""
        idx = torch.as_tensor(list(index), dtype=torch.long)
        kw: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v[idx] if isinstance(v, torch.Tensor) else [v[i] for i in idx.tolist()]
        return RolloutBatch(**kw)


def _float_info(info: Dict[str, Any], key: str) -> float:
    v = info.get(key)
    if v is None:
        return 0.0
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"trajectories: info[{key!r}] must be a number, got {v!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"trajectories: info[{key!r}] must be finite, got {x}")
    return x


def collate(
    trajectories: Sequence[Trajectory],
    pad_id: int,
    *,
    dtype: torch.dtype = torch.float32,
    pad_to_multiple_of: Optional[int] = None,
) -> RolloutBatch:
    """Stack trajectories into a right-padded :class:`RolloutBatch`.

    Args:
      trajectories: non-empty sequence of :class:`Trajectory`, each with at least one turn.
      pad_id: token id written into padding slots (never attended: ``attention_mask`` 0).
      dtype: floating dtype of ``old_logp`` and the reward / cost / potential tensors.
      pad_to_multiple_of: round ``T`` up to a multiple of this (fewer shapes to compile).
    """
    trajectories = list(trajectories)
    if not trajectories:
        raise ValueError("trajectories: empty; nothing to collate")
    for t in trajectories:
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajectories: expected Trajectory objects, got {type(t).__name__}")
        if not t.turns:
            raise ValueError(f"trajectories: trajectory {t.episode_id!r} has no turns")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
        raise ValueError(f"pad_id: expected a non-negative integer, got {pad_id!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating dtype, got {dtype}")

    B = len(trajectories)
    ids = [t.token_ids() for t in trajectories]
    T = max(len(x) for x in ids)
    if pad_to_multiple_of:
        m = int(pad_to_multiple_of)
        if m <= 0:
            raise ValueError(f"pad_to_multiple_of: must be positive, got {pad_to_multiple_of}")
        T = -(-T // m) * m
    K = max(len(t.turns) for t in trajectories)

    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    action_mask = torch.zeros((B, T - 1), dtype=torch.bool)
    old_logp = torch.full((B, T - 1), float("nan"), dtype=dtype)
    policy_version = torch.full((B, T - 1), NO_VERSION, dtype=torch.long)
    turn_ids = torch.zeros((B, T - 1), dtype=torch.long)
    turn_rewards = torch.zeros((B, K), dtype=dtype)
    turn_costs = torch.zeros((B, K), dtype=dtype)
    turn_potentials = torch.zeros((B, K), dtype=dtype)
    turn_mask = torch.zeros((B, K), dtype=torch.bool)

    for b, (t, seq) in enumerate(zip(trajectories, ids)):
        n = len(seq)
        input_ids[b, :n] = torch.tensor(seq, dtype=torch.long)
        attention_mask[b, :n] = 1
        # float64 first: the recorded values are Python floats; the cast to ``dtype`` is
        # then a single rounding (exact when they came from ``dtype`` logits).
        action_mask[b, : n - 1] = torch.tensor(t.action_mask(), dtype=torch.bool)
        old_logp[b, : n - 1] = torch.tensor(t.behaviour_logp_aligned(), dtype=torch.float64).to(dtype)
        policy_version[b, : n - 1] = torch.tensor(t.policy_versions_aligned(), dtype=torch.long)
        turn_ids[b, : n - 1] = torch.tensor(t.turn_ids_aligned(), dtype=torch.long)
        k = len(t.turns)
        turn_rewards[b, :k] = torch.tensor(t.rewards_per_turn(), dtype=torch.float64).to(dtype)
        turn_costs[b, :k] = torch.tensor([_float_info(x.info, "cost") for x in t.turns], dtype=torch.float64).to(dtype)
        turn_potentials[b, :k] = torch.tensor(
            [_float_info(x.info, "potential") for x in t.turns], dtype=torch.float64
        ).to(dtype)
        turn_mask[b, :k] = True

    group_of: Dict[str, int] = {}
    group_ids = torch.tensor([group_of.setdefault(t.task_id, len(group_of)) for t in trajectories], dtype=torch.long)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_attention_mask(attention_mask),
        action_mask=action_mask,
        old_logp=old_logp,
        policy_version=policy_version,
        turn_ids=turn_ids,
        turn_rewards=turn_rewards,
        turn_mask=turn_mask,
        turn_costs=turn_costs,
        turn_potentials=turn_potentials,
        initial_potential=torch.tensor(
            [_float_info(t.metadata, "initial_potential") for t in trajectories], dtype=torch.float64
        ).to(dtype),
        rewards=torch.tensor([t.total_reward for t in trajectories], dtype=torch.float64).to(dtype),
        success=torch.tensor([bool(t.success) for t in trajectories], dtype=torch.bool),
        terminated=torch.tensor([t.terminated for t in trajectories], dtype=torch.bool),
        truncated=torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
        segments=torch.tensor([t.segment for t in trajectories], dtype=torch.long),
        group_ids=group_ids,
        task_ids=[t.task_id for t in trajectories],
        episode_ids=[t.episode_id for t in trajectories],
    )
