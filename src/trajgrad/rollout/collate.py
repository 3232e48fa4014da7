r"""Trajectories -> one right-padded batch of tensors for the learner.

Row ``b`` of :class:`RolloutBatch` is ``trajectories[b].token_ids()`` followed by padding.
Per-token fields are aligned with the targets ``input_ids[:, 1:]`` (§4), so they are
``[B, T-1]``. Padding targets have ``action_mask`` 0, ``old_logp`` NaN,
``policy_version`` -1 and ``turn_ids`` 0.

``old_logp`` holds the behaviour log-probabilities recorded at sampling time (§7) and NaN
at every position that is not an action token: a loss that reads it without its mask
produces NaN instead of a silently wrong number.

The learner must feed ``position_ids`` (computed from ``attention_mask`` by
:func:`~trajgrad.model.positions.position_ids_from_attention_mask`) to the model, as the sampler does with its
left-padded batches; the position of a token is then the same in both, and the learner
recomputes exactly the behaviour log-probabilities when the weights did not change (§24).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..model.positions import PrefixGroups, position_ids_from_attention_mask, prefix_groups
from .trajectory import NO_VERSION, Trajectory

__all__ = ["PrefixGroups", "RolloutBatch", "collate", "position_ids_from_attention_mask", "prefix_groups"]


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

    # one tensor per field from right-padded Python lists (one conversion, not one per row)
    def rows(values, pad, width):
        return [v + [pad] * (width - len(v)) for v in values]

    lengths = torch.tensor([len(x) for x in ids], dtype=torch.long)
    input_ids = torch.tensor(rows(ids, pad_id, T), dtype=torch.long)
    attention_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    action_mask = torch.tensor(rows([t.action_mask() for t in trajectories], 0, T - 1), dtype=torch.bool)
    # float64 first: the recorded values are Python floats; the cast to ``dtype`` is then a
    # single rounding (exact when they came from ``dtype`` logits).
    old_logp = torch.tensor(rows([t.behaviour_logp_aligned() for t in trajectories], float("nan"), T - 1),
                            dtype=torch.float64).to(dtype)
    policy_version = torch.tensor(rows([t.policy_versions_aligned() for t in trajectories], NO_VERSION, T - 1),
                                  dtype=torch.long)
    turn_ids = torch.tensor(rows([t.turn_ids_aligned() for t in trajectories], 0, T - 1), dtype=torch.long)

    def per_turn(value):
        return torch.tensor(rows([[value(x) for x in t.turns] for t in trajectories], 0.0, K),
                            dtype=torch.float64).to(dtype)

    turn_rewards = per_turn(lambda x: x.reward)
    turn_costs = per_turn(lambda x: _float_info(x.info, "cost"))
    turn_potentials = per_turn(lambda x: _float_info(x.info, "potential"))
    turn_mask = torch.arange(K)[None, :] < torch.tensor([len(t.turns) for t in trajectories])[:, None]

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
