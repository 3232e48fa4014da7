r"""SAPO: a smooth, sign-dependent trust gate instead of a hard clip (spec §18).

Gao et al., 2025, "Soft Adaptive Policy Optimization".
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks
from ..aggregate import aggregate
from ..diagnostics import policy_metrics
from ..types import LossResult
from .reinforce import _prepare


def _check_tau(name: str, tau: float) -> float:
    t = float(tau)
    _checks.check_positive(name, t)
    if not math.isfinite(t):
        raise ValueError(f"{name}: must be finite, got {tau}")
    return t


def sapo_loss(
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
    r"""SAPO loss with the soft gate :math:`f(r)=\frac4\tau\sigma[\tau(r-1)]` (§18).

    With :math:`r_{i,t}=\exp(\ell^\theta_{i,t}-\ell^{old}_{i,t})` and
    :math:`\tau_{i,t}=\tau_{pos}` if :math:`\hat A_{i,t}>0` else :math:`\tau_{neg}`:

    .. math::
        J_{\mathrm{SAPO}}=\frac1G\sum_i\frac1{L_i}\sum_t f_{i,t}(r_{i,t})\hat A_{i,t},
        \qquad \mathcal L=-J.

    With :math:`p=\sigma[\tau(r-1)]`, :math:`f'(r)=4p(1-p)` (the temperature cancels), so
    one token contributes

    .. math::
        \nabla_\theta\big(f(r)\hat A\big) = 4p(1-p)\;r\;\hat A\;\nabla_\theta\ell^\theta.

    The gate :math:`4p(1-p)` is 1 at :math:`r=1` for every :math:`\tau` (on-policy SAPO
    is REINFORCE) and decays continuously to 0 as :math:`|r-1|` grows, faster for larger
    :math:`\tau`. :math:`\tau_{neg}>\tau_{pos}` by default (the paper's choice: negative
    updates spread probability over the whole vocabulary and are less stable).

    **The ratio is NOT detached.** The surrogate has no explicit
    :math:`\log\pi_\theta` factor, so a detached :math:`r` would make the gradient
    exactly zero. Advantages and ``old_logp`` are detached evidence.

    The loss value at :math:`r=1` is :math:`-2\hat A/\tau` averaged: it depends on
    :math:`\tau` although the gradient does not, so do not compare raw SAPO losses across
    temperatures (§18).

    Where :math:`e^{z}` overflows the gate is exactly 0 and the term is the constant
    :math:`-\frac4\tau\hat A`; the ratio is then not formed, so no ``0 * inf`` NaN arises.

    Args:
      logp: ``[B, L]`` current log-probs (attached).
      old_logp: ``[B, L]`` behaviour log-probs (detached here).
      advantages: ``[B, L]`` or ``[B]`` (detached here).
      mask: ``[B, L]`` action mask.
      tau_pos, tau_neg: positive temperatures (paper defaults 1.0 / 1.05).
      aggregation: default ``"seq_mean_token_mean"`` (the paper's objective above).
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; metrics from :func:`trajgrad.diagnostics.policy_metrics` plus
      ``gate/mean`` (valid-token mean of :math:`4p(1-p)`), ``gate/pos_mean`` and
      ``gate/neg_mean`` (over tokens with :math:`\hat A>0` / :math:`\hat A\le0`).
    """
    x = _prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    tp = _check_tau("tau_pos", tau_pos)
    tn = _check_tau("tau_neg", tau_neg)
    log_ratio = _checks.fill_masked(x.logp - x.behaviour, x.mask)
    z = log_ratio.detach()
    overflow = torch.isinf(torch.exp(z))
    pos = x.advantages > 0
    tau = torch.where(pos, torch.full_like(z, tp), torch.full_like(z, tn))
    ratio = torch.exp(torch.where(overflow, torch.zeros_like(log_ratio), log_ratio))
    gate_arg = tau * (ratio - 1.0)
    f = (4.0 / tau) * torch.sigmoid(gate_arg)
    f = torch.where(overflow, 4.0 / tau, f)
    term = -f * x.advantages
    loss = aggregate(term, x.mask, aggregation, constant=constant, denominator=denominator)
    metrics = policy_metrics(z, x.advantages, x.mask)
    with torch.no_grad():
        p = torch.sigmoid(gate_arg.detach())
        gate = torch.where(overflow, torch.zeros_like(p), 4.0 * p * (1.0 - p))
        dt = metrics["tokens"].dtype

        def mean_over(sel: torch.Tensor) -> torch.Tensor:
            sel = sel & x.mask
            return torch.where(sel, gate, torch.zeros_like(gate)).sum().to(dt) / sel.sum().clamp_min(1).to(dt)

        metrics["gate/mean"] = mean_over(x.mask)
        metrics["gate/pos_mean"] = mean_over(pos)
        metrics["gate/neg_mean"] = mean_over(~pos)
    return LossResult(loss, metrics)


__all__ = ["sapo_loss"]
