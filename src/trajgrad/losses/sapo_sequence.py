r"""Sequence-level SAPO: the soft gate applied to the geometric-mean sequence ratio (spec §17, §18).

Gao et al. 2025 (SAPO) gate :math:`f(r)=\frac4\tau\sigma[\tau(r-1)]` on the GSPO sequence ratio
:math:`s_i=\exp[\frac1{L_i}\sum_t(\ell^\theta_{i,t}-\ell^{old}_{i,t})]` instead of the token
ratio: TRL 1.16's ``loss_type="sapo"`` with ``importance_sampling_level="sequence"``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..aggregate import aggregate
from ..diagnostics import policy_metrics
from ..ratios import gspo_log_sequence_ratio
from ..types import LossResult
from .reinforce import _prepare
from .sapo import _check_tau


def sapo_sequence_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    aggregation: str = "seq_mean_token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""SAPO with the sequence ratio :math:`s_i` in the gate (§18 gate, §17 ratio).

    .. math::
        x_{i,t}=-\frac4{\tau_{i,t}}\,\sigma\big[\tau_{i,t}(s_i-1)\big]\hat A_{i,t},\qquad
        \tau_{i,t}=\tau_{pos}\ (\hat A_{i,t}>0)\ \text{else}\ \tau_{neg},\qquad
        \mathcal L=\operatorname{agg}_{i,t}x_{i,t}.

    With :math:`p_{i,t}=\sigma[\tau_{i,t}(s_i-1)]` and
    :math:`\nabla s_i=\frac{s_i}{L_i}\sum_t\nabla\ell^\theta_{i,t}`, the gradient of one token
    term is :math:`-4p(1-p)\,\frac{s_i}{L_i}\hat A_{i,t}\sum_{t'}\nabla\ell^\theta_{i,t'}`: every
    token of response :math:`i` gets the same weight (for a per-response advantage), gated
    softly by how far the *whole* response has moved. At :math:`s_i=1` the gate is 1 for every
    :math:`\tau`, and with the default ``seq_mean_token_mean`` the loss is then GSPO's unclipped
    objective. Per-token advantages are allowed (TRL broadcasts the sequence gate onto them).

    The sequence ratio is attached (its gradient is the update); advantages and ``old_logp``
    are detached. Where :math:`e^{\log s_i}` overflows the gate is exactly 0 and the term the
    constant :math:`-\frac4\tau\hat A` (no ``0 * inf``).

    TRL 1.16 (``loss_type="sapo"``, ``importance_sampling_level="sequence"``) averages
    :math:`\frac1{L_i}\sum_t x_{i,t}` over *all* rows; this is ``seq_mean_token_mean``, which
    averages over non-empty rows (the same when no row is empty; otherwise pass
    ``denominator=B``).

    Args:
      logp: ``[B, L]`` current log-probs (attached).
      old_logp: ``[B, L]`` log-probs of the sampling policy (detached here).
      advantages: ``[B, L]`` or ``[B]`` (detached here).
      mask: ``[B, L]`` action mask.
      tau_pos, tau_neg: positive temperatures (SAPO's defaults 1.0 / 1.05).
      aggregation: default ``"seq_mean_token_mean"``.
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; metrics from :func:`trajgrad.diagnostics.policy_metrics` on the
      sequences (``log_ratio/*`` of :math:`\log s_i`), ``sequences``, ``tokens`` and
      ``gate/mean`` (mean of :math:`4p(1-p)` over valid tokens).
    """
    x = _prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    tp = _check_tau("tau_pos", tau_pos)
    tn = _check_tau("tau_neg", tau_neg)
    log_s = gspo_log_sequence_ratio(x.logp, x.behaviour, x.mask)  # [B], attached
    z = log_s.detach()
    overflow = torch.isinf(torch.exp(z))
    s = torch.exp(torch.where(overflow, torch.zeros_like(log_s), log_s))[:, None]
    over = overflow[:, None].expand(x.mask.shape)
    tau = torch.where(x.advantages > 0, torch.full_like(x.advantages, tp), torch.full_like(x.advantages, tn))
    gate_arg = tau * (s - 1.0)
    f = torch.where(over, 4.0 / tau, (4.0 / tau) * torch.sigmoid(gate_arg))
    term = -f * x.advantages
    loss = aggregate(term, x.mask, aggregation, constant=constant, denominator=denominator)
    nonempty = x.mask.any(-1)
    first = x.mask.to(torch.int8).argmax(-1)
    seq_adv = torch.where(nonempty, x.advantages.gather(1, first[:, None]).squeeze(1), torch.zeros_like(z))
    metrics = policy_metrics(z[:, None], seq_adv[:, None], nonempty[:, None])
    metrics["sequences"] = metrics.pop("tokens")
    dt = metrics["sequences"].dtype
    with torch.no_grad():
        p = torch.sigmoid(gate_arg.detach())
        gate = torch.where(over | ~x.mask, torch.zeros_like(p), 4.0 * p * (1.0 - p))
        n = x.mask.sum()
        metrics["tokens"] = n.to(dt)
        metrics["gate/mean"] = gate.sum().to(dt) / n.clamp_min(1).to(dt)
    return LossResult(loss, metrics)


__all__ = ["sapo_sequence_loss"]
