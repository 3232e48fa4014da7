r"""Partial rollouts: episodes sampled by more than one policy version (§16).

In asynchronous training the learner publishes new weights while episodes are running;
a rollout worker picks them up between turns, so turns :math:`0..k` of an episode may be
sampled by :math:`\mu_0` and the later turns by :math:`\mu_1`:

.. math::

   p(\tau)=\rho_0P\Big[\prod_{t=0}^{k}\mu_0(a_t\mid h_t)P_t\Big]
           \Big[\prod_{t=k+1}^{T-1}\mu_1(a_t\mid h_t)P_t\Big].

There is no single behaviour checkpoint for the episode. Every :class:`Turn` records the
``policy_version`` that sampled it and the ``behaviour_logp`` of each of its tokens under
exactly that version's sampling distribution, so every option of §16 is available.
``asynchronous.partial`` selects one (:data:`PARTIAL_POLICIES`):

``"per_segment"`` (default)
  Keep every turn. Each token's importance ratio uses its *own* segment's behaviour
  log-prob, :math:`r_t=\pi_\theta(a_t\mid h_t)/\mu_{s(t)}(a_t\mid h_t)`. For token-level
  estimators (SAO's direct double-sided IS, §20.2; PPO's token ratio) nothing else is
  needed: the collated ``old_logp`` already holds, per token, the log-prob recorded by
  the version that sampled it. A *sequence-level* ratio (GSPO, §17; a trajectory
  weight) must not multiply tokens of different behaviour policies into one ratio
  against one checkpoint: form it per segment with
  :func:`trajgrad.logprobs.ratios.segment_log_ratios`, with the segment ids from
  :func:`segment_ids` (the rank of each token's version within its row).

``"newest_segment"``
  Train only the tokens sampled by the newest version that took part in the episode
  (Kimi k1.5's continuation rule, §16). The earlier turns become masked context: the
  trajectory is rebuilt with those turns folded into the prompt, so the token sequence
  is identical and ``action_mask`` is 0 on them (:func:`fold_older_turns`). Sub-traces
  of a compacted episode (§19) sampled entirely by older versions are dropped.

``"discard_mixed"``
  Drop every episode whose tokens were sampled by more than one version (counted).
  Unbiased with respect to each episode's own behaviour policy, but it selects against
  long episodes (the ones most likely to straddle an update, §16).

The functions are pure (no Ray, no model): they take and return
:class:`~trajgrad.rollout.Trajectory` objects.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..rollout.trajectory import NO_VERSION, Trajectory

__all__ = [
    "PARTIAL_POLICIES",
    "PartialResult",
    "apply_partial_policy",
    "fold_older_turns",
    "episode_versions",
    "is_mixed",
    "oldest_version",
    "newest_version",
    "segment_ids",
]

PARTIAL_POLICIES = ("per_segment", "newest_segment", "discard_mixed")


def _check_trajectories(trajectories) -> List[Trajectory]:
    if isinstance(trajectories, Trajectory):
        trajectories = [trajectories]
    try:
        trajs = list(trajectories)
    except TypeError:
        raise ValueError(f"trajectories: expected a Trajectory or a list of them, got {type(trajectories).__name__}") from None
    if not trajs:
        raise ValueError("trajectories: empty; an episode has at least one sub-trace")
    for t in trajs:
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajectories: expected Trajectory objects, got {type(t).__name__}")
        if not t.turns:
            raise ValueError(f"trajectories: sub-trace {t.episode_id!r}/{t.segment} has no turns")
    return trajs


def episode_versions(trajectories) -> List[int]:
    """The sorted distinct policy versions that sampled any turn of the episode."""
    trajs = _check_trajectories(trajectories)
    return sorted({turn.policy_version for t in trajs for turn in t.turns})


def oldest_version(trajectories) -> int:
    """The oldest version that sampled any token (the one that sets the policy lag)."""
    return episode_versions(trajectories)[0]


def newest_version(trajectories) -> int:
    return episode_versions(trajectories)[-1]


def is_mixed(trajectories) -> bool:
    """True when more than one policy version sampled tokens of the episode."""
    return len(episode_versions(trajectories)) > 1


def fold_older_turns(trajectory: Trajectory, version: int) -> Optional[Trajectory]:
    """The sub-trace restricted to its turns sampled by ``version``, older turns as context.

    The trained part is the longest suffix of turns whose ``policy_version`` equals
    ``version``; every turn before it is folded into ``prompt_ids`` (its action and
    observation tokens, verbatim), so ``token_ids()`` is unchanged and the folded
    actions get ``action_mask`` 0. Returns ``trajectory`` itself when no turn is folded
    and ``None`` when its last turn was not sampled by ``version`` (nothing to train).

    The returned copy keeps ``episode_id``, ``segment``, ``success``, flags and
    ``sampling``; ``total_reward`` is the reward of the kept turns (rewards earlier
    than the first trained action do not affect its reward-to-go); ``metadata`` gains
    ``folded_turns``, ``folded_reward``, and ``initial_potential`` becomes the
    ``info["potential"]`` of the last folded turn when the environment reported one
    (the state the trained part starts from, §21).
    """
    if not isinstance(trajectory, Trajectory):
        raise ValueError(f"trajectory: expected a Trajectory, got {type(trajectory).__name__}")
    if not trajectory.turns:
        raise ValueError(f"trajectory: {trajectory.episode_id!r} has no turns")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"version: expected an integer, got {version!r}")
    turns = trajectory.turns
    k = len(turns)
    while k > 0 and turns[k - 1].policy_version == version:
        k -= 1
    if k == len(turns):
        return None
    if k == 0:
        return trajectory
    prompt = list(trajectory.prompt_ids)
    for t in turns[:k]:
        prompt.extend(t.action_ids)
        prompt.extend(t.observation_ids)
    meta = copy.deepcopy(trajectory.metadata)
    meta["folded_turns"] = k
    meta["folded_reward"] = float(sum(t.reward for t in turns[:k]))
    potential = turns[k - 1].info.get("potential")
    if potential is not None:
        meta["initial_potential"] = float(potential)
    return Trajectory(
        task_id=trajectory.task_id, episode_id=trajectory.episode_id, prompt_ids=prompt,
        turns=copy.deepcopy(turns[k:]), segment=trajectory.segment, split=trajectory.split,
        terminated=trajectory.terminated, truncated=trajectory.truncated, sampling=dict(trajectory.sampling),
        success=trajectory.success, total_reward=None, created_at=trajectory.created_at, metadata=meta,
    )


@dataclass
class PartialResult:
    """What a partial-rollout policy keeps of one episode.

    Attributes:
      kept: the sub-traces to train (possibly rebuilt); empty when the episode is dropped.
      dropped: ``None``, or why the whole episode was dropped (``"mixed"``).
      mixed: the episode was sampled by more than one version.
      versions: the distinct versions that sampled it.
      folded_turns: turns turned into masked context (``newest_segment``).
      dropped_subtraces: sub-traces with no token of the newest version
        (``newest_segment``).
    """

    kept: List[Trajectory]
    dropped: Optional[str] = None
    mixed: bool = False
    versions: List[int] = field(default_factory=list)
    folded_turns: int = 0
    dropped_subtraces: int = 0


def apply_partial_policy(trajectories, policy: str) -> PartialResult:
    """Apply one of :data:`PARTIAL_POLICIES` to the sub-traces of one episode.

    Args:
      trajectories: the sub-traces of one finished episode (a single
        :class:`Trajectory` is accepted), each with at least one turn.
      policy: ``"per_segment"``, ``"newest_segment"`` or ``"discard_mixed"`` (see the
        module docstring).

    Returns:
      :class:`PartialResult`. The input trajectories are never modified.
    """
    if policy not in PARTIAL_POLICIES:
        raise ValueError(f"policy: expected one of {PARTIAL_POLICIES}, got {policy!r}")
    trajs = _check_trajectories(trajectories)
    versions = episode_versions(trajs)
    mixed = len(versions) > 1
    res = PartialResult(kept=[], mixed=mixed, versions=versions)
    if not mixed or policy == "per_segment":
        res.kept = list(trajs)
        return res
    if policy == "discard_mixed":
        res.dropped = "mixed"
        return res
    newest = versions[-1]
    for t in trajs:
        f = fold_older_turns(t, newest)
        if f is None:
            res.dropped_subtraces += 1
            continue
        res.folded_turns += int(f.metadata.get("folded_turns", 0)) if f is not t else 0
        res.kept.append(f)
    return res


def segment_ids(policy_version: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Behaviour-segment ids for :func:`trajgrad.logprobs.ratios.segment_log_ratios`.

    Args:
      policy_version: ``[B, L]`` long, the sampling version of each token
        (``RolloutBatch.policy_version``; ``-1`` off the action tokens).
      mask: ``[B, L]`` 0/1 action mask.

    Returns:
      ``[B, L]`` long: at each action token, the rank of its version among the distinct
      versions of its row (0 for the oldest); 0 at masked positions.
    """
    if not torch.is_tensor(policy_version) or policy_version.ndim != 2:
        raise ValueError(f"policy_version: expected a [B, L] tensor, got {getattr(policy_version, 'shape', policy_version)!r}")
    if policy_version.is_floating_point() or policy_version.dtype == torch.bool:
        raise ValueError(f"policy_version: expected an integer tensor, got dtype {policy_version.dtype}")
    if not torch.is_tensor(mask) or mask.shape != policy_version.shape:
        raise ValueError(f"mask: expected shape {tuple(policy_version.shape)}, got {tuple(getattr(mask, 'shape', ()))}")
    if mask.dtype != torch.bool:
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("mask: must contain only 0 and 1")
        mask = mask != 0
    if bool((mask & (policy_version < 0)).any()):
        raise ValueError(f"policy_version: negative version ({NO_VERSION}) at an action token")
    out = torch.zeros_like(policy_version, dtype=torch.long)
    for b in range(policy_version.shape[0]):
        row = policy_version[b][mask[b]]
        if row.numel() == 0:
            continue
        uniq = torch.unique(row)  # sorted
        out[b][mask[b]] = torch.searchsorted(uniq, row)
    return out


def version_counts(trajectories: Sequence[Trajectory]) -> Dict[int, int]:
    """Action tokens per sampling version over some trajectories (for logs)."""
    counts: Dict[int, int] = {}
    for t in trajectories:
        for turn in t.turns:
            counts[turn.policy_version] = counts.get(turn.policy_version, 0) + len(turn.action_ids)
    return counts
