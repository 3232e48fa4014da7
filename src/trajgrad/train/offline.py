"""The update steps on fixed data, no sampling: DPO on preference pairs (§10), SFT on
demonstrations. The same five lines as :mod:`trajgrad.train.updates` (zero the gradients;
forward, loss with the step's global denominator, backward; sum over ranks; clip; step).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .. import distributed as dist_lib
from ..aggregate import aggregate
from ..losses import sequence_logp
from ..objective import Objective
from ..rollout import RolloutBatch
from .updates import LearnerState, finish_step, global_denominator, logprobs, micro_batches, reference_logprobs, \
    snapshot_reference

__all__ = ["dpo_pair_loss", "dpo_update", "sft_update"]


# ---------------------------------------------------------------------- DPO
def dpo_pair_loss(objective: Objective, chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp,
                  num_pairs: int):
    r"""This rank's share of the step's DPO loss: :math:`\frac1N\sum_{b\in\text{rank}}\ell_b`.

    ``N`` (``num_pairs``) is the pair count of the whole step over every rank, so the sum
    over ranks of these losses (and of their gradients) is the single-process loss on all
    pairs (§13). :meth:`Objective.dpo_loss` returns the local mean
    :math:`\frac1{B}\sum_b\ell_b`; it is rescaled by :math:`B/N` (exact: a finite factor).
    Returns the local :class:`~trajgrad.types.LossResult` (its ``loss`` the local mean) and
    the rescaled loss to backpropagate.
    """
    B = int(chosen_logp.shape[0])
    if isinstance(num_pairs, bool) or not isinstance(num_pairs, int) or num_pairs < B or num_pairs < 1:
        raise ValueError(f"num_pairs: expected an integer >= {max(B, 1)} (this rank's pairs), got {num_pairs!r}")
    res = objective.dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp)
    return res, res.loss * (B / num_pairs)


def dpo_update(st: LearnerState, chosen: Optional[RolloutBatch], rejected: Optional[RolloutBatch],
               num_pairs: int) -> Dict[str, float]:
    """One DPO step on this rank's pairs (``chosen``/``rejected`` None when it holds none:
    it still takes part in the gradient sum); the denominator is ``num_pairs``, the step's
    pair count over every rank (§13)."""
    st.optimizer.zero_grad(set_to_none=True)
    out: Dict[str, float] = {}
    local = 0.0
    if chosen is not None and len(chosen) > 0:
        with torch.no_grad():
            ref_c = sequence_logp(reference_logprobs(st, chosen).double(), chosen.action_mask)
            ref_r = sequence_logp(reference_logprobs(st, rejected).double(), rejected.action_mask)
        pc = sequence_logp(logprobs(st, chosen).logp.double(), chosen.action_mask)
        pr = sequence_logp(logprobs(st, rejected).logp.double(), rejected.action_mask)
        res, share = dpo_pair_loss(st.objective, pc, pr, ref_c, ref_r, num_pairs)
        share.backward()
        local = float(share.detach())
        out.update({k: float(v.detach()) for k, v in res.metrics.items() if torch.is_tensor(v) and v.numel() == 1})
    else:
        snapshot_reference(st)
    params = st.trainable()
    finish_step(params, st.optimizer, st.grad_clip or 1e9)
    # per-pair means over every rank's pairs; the loss is the sum of the ranks' shares
    n_local = 0 if chosen is None else len(chosen)
    out = dist_lib.mean_metrics_over_ranks(out, weight=n_local)
    out["loss"] = dist_lib.sum_over_ranks(local)
    return out


# ---------------------------------------------------------------------- SFT
def sft_update(st: LearnerState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               batch: Optional[RolloutBatch]) -> float:
    """One step of masked negative log-likelihood on demonstration tokens (token mean over
    the step's tokens on every rank); returns this rank's share of the loss. ``batch=None``:
    this rank holds no demonstration this step (it still takes part in the sums)."""
    params = st.trainable(model)
    optimizer.zero_grad(set_to_none=True)
    if batch is None:
        global_denominator([], "token_mean")  # the count's all-reduce, matched on every rank
        finish_step(params, optimizer, 1.0)
        return 0.0
    mbs = micro_batches(len(batch), st.micro_batch_size)
    den = global_denominator([batch.action_mask[i] for i in mbs], "token_mean")
    total = 0.0
    for idx in mbs:
        mb = batch.select(idx)
        loss = aggregate(-logprobs(st, mb, model=model).logp, mb.action_mask, "token_mean", denominator=den)
        loss.backward()
        total += float(loss.detach())
    finish_step(params, optimizer, 1.0)
    return total
