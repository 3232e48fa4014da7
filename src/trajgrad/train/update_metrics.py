"""What an update reports besides its loss: how far the learner's log-probs are from the
sampler's (§7), and the rollout correction's weights and masks over the batch and per turn (§16).
Everything is detached.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ..aggregate import masked_mean
from ..logprobs.correction import turn_metrics
from ..losses import kl_estimate
from ..objective import Objective
from ..rollout import RolloutBatch

__all__ = ["sampler_learner_metrics", "correction_metrics"]


def sampler_learner_metrics(learner, behaviour, entropy, mask) -> Dict[str, float]:
    r"""Entropy, and how far the learner's log-probs are from the sampler's records (§7).

    ``mismatch/kl_k1`` and ``mismatch/kl_k3`` are the sampled estimates of
    :math:`\mathrm{KL}(\mu\Vert\pi)` on the tokens the sampler drew (:math:`-z` and
    :math:`e^z-1-z`, :math:`z=\log\pi-\log\mu`), the quantities the rollout correction
    reports as ``correction/kl/*``, logged with the correction off too.
    """
    m = {"entropy": float(masked_mean(entropy.double(), mask))}
    m["mismatch/k3_learner_vs_sampler"] = float(masked_mean(kl_estimate(learner, behaviour, mask, kind="k3"), mask))
    z = torch.where(mask, learner.double() - torch.nan_to_num(behaviour.double()), torch.zeros_like(learner.double()))
    m["mismatch/kl_k1"] = float(masked_mean(-z, mask))
    m["mismatch/kl_k3"] = float(masked_mean(torch.expm1(z) - z, mask))
    diff = torch.where(mask, (learner - torch.nan_to_num(behaviour)).abs(), torch.zeros_like(learner))
    m["mismatch/max_abs_log_ratio"] = float(diff.max()) if diff.numel() else 0.0
    return m


def correction_metrics(obj: Objective, batch: RolloutBatch, behaviour_logp: torch.Tensor, target_logp: torch.Tensor,
                       advantages: Optional[torch.Tensor] = None,
                       current_logp: Optional[torch.Tensor] = None) -> Dict[str, float]:
    r"""The recipe's rollout-correction metrics over the whole batch, and per turn (§7, §16).

    The correction (:meth:`RolloutCorrection.__call__`) is computed once on the whole batch,
    from ``behaviour_logp`` :math:`\log\mu` and ``target_logp`` (:math:`\log\pi_{old}` in
    ``"decoupled"`` mode, the current :math:`\log\pi_\theta` in ``"bypass"``), so the
    sequence-level weights and the min / max / effective sample size are those of the step,
    not averages over micro-batches (``current_logp``, the first epoch's :math:`\log\pi_\theta`, is
    the sequence mask's policy with ``mismatch_policy="current"``). Its ``correction/*`` metrics are
    returned, and, for each
    turn index ``k`` present (``batch.turn_ids``), the same quantities restricted to that
    turn's action tokens (:func:`trajgrad.logprobs.correction.turn_metrics`):
    ``correction/turn{k}/weight/mean|min|max``, ``ess`` (Kish, over the turn's tokens),
    ``kept_frac``, ``dropped_frac``, and each reason separately: ``truncated_frac``,
    ``masked_frac``, ``rejected_frac``, ``seq_masked_frac``; ``kl/k1`` and ``kl/k3`` (of
    :math:`\mathrm{KL}(\mu\Vert\pi)`). Everything is detached.
    """
    rc = obj.rollout_correction
    mask = batch.action_mask.bool()
    with torch.no_grad():
        beh = torch.where(mask, behaviour_logp.detach().double(), 0.0)
        tgt = torch.where(mask, target_logp.detach().double(), 0.0)
        adv = None if rc.seq_mask_delta is None else advantages
        corr = rc(beh, tgt, mask, advantages=adv, current_logp=current_logp)
        out = {k: float(v) for k, v in corr.metrics.items()}
        out.update(turn_metrics(corr, beh, tgt, mask, batch.turn_ids))
    return out
