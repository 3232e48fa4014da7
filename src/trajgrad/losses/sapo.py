r"""SAPO: a smooth, sign-dependent trust gate instead of a hard clip (spec §18).

Gao et al., 2025, "Soft Adaptive Policy Optimization".
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks
from .._policy_stats import _fast_policy_metrics
from ..registry import Param, finite_positive, policy_term
from ..types import LossResult
from ._common import (
    aggregate_sequences, aggregate_tokens, prepare, ratio_metrics, sequence_advantages, token_weights, weighted,
)


def _check_tau(name: str, tau: float) -> float:
    t = float(tau)
    _checks.check_positive(name, t)
    if not math.isfinite(t):
        raise ValueError(f"{name}: must be finite, got {tau}")
    return t


LEVELS = ("token", "sequence")


def _gate(log_ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    r""":math:`p=\sigma(\tau(r-1))`, :math:`r=e^z` kept finite.

    ``z`` is clamped at the largest finite exponent (only if some entry exceeds it): beyond
    it :math:`\sigma` has saturated to 1 in every float dtype, so the value is unchanged and
    the gradient 0 (the true gradient :math:`4p(1-p)r` has underflowed to 0 long before).
    """
    zmax = math.log(torch.finfo(log_ratio.dtype).max) - 1.0
    if log_ratio.numel() and float(log_ratio.detach().amax()) > zmax:
        log_ratio = torch.clamp(log_ratio, max=zmax)
    ratio = torch.exp(log_ratio)
    return torch.sigmoid((ratio - 1.0).mul_(tau))


_TAU_DOC = "SAPO temperatures (§18)."
TAU_POS = Param("tau_pos", 1.0, _TAU_DOC, float, lambda v: finite_positive("tau_pos", v))
TAU_NEG = Param("tau_neg", 1.05, _TAU_DOC, float, lambda v: finite_positive("tau_neg", v))
SAPO_LEVELS = ("token", "sequence")
SAPO_LEVEL = Param("sapo_level", "token", "SAPO's gate on token ratios (``\"token\"``) or on GSPO's sequence ratio "
                   "(``\"sequence\"``).", str, lambda v: _checks.check_choice("sapo_level", v, SAPO_LEVELS))


def _sapo_text(o) -> str:
    if o.sapo_level == "sequence":
        return ("s_i = exp((1/L_i) Σ_t [log π_θ(y_it) − sg[log π_old(y_it)]])   (GSPO's sequence ratio, NOT detached)\n"
                f"τ_i = {o.tau_pos:g} if A_i > 0 else {o.tau_neg:g}\n"
                "x_it = − (4/τ_i) σ(τ_i (s_i − 1)) A_i   at every token of response i   (sequence-level SAPO)\n"
                "    gradient 4p(1−p) s_i A_i (1/L_i) Σ_t ∇log π_θ(y_it): one soft-gated weight per response")
    return ("r_it = exp(log π_θ(y_it) − sg[log π_old(y_it)])   (NOT detached: its gradient is the update)\n"
            f"τ_it = {o.tau_pos:g} if A_it > 0 else {o.tau_neg:g}\n"
            "x_it = − (4/τ_it) σ(τ_it (r_it − 1)) A_it          (§18)\n"
            "    gradient gate 4p(1−p) r A ∇log π_θ, gate = 1 at r = 1 for any τ")


def _sapo_validate(o) -> None:
    if o.sapo_level == "sequence" and o.estimator.level == "token":
        raise ValueError("sapo_level: 'sequence' needs one advantage per response; "
                         f"advantage {o.advantage!r} is per token")


@policy_term(
    "sapo", zero_without_advantage=True, fields=("tau_pos", "tau_neg", "sapo_level"), ratio="old",
    detached=("old log-probs",), aggregation="seq_mean_token_mean", text=_sapo_text, validate=_sapo_validate,
    params=(TAU_POS, TAU_NEG, SAPO_LEVEL),
    call=lambda o, x: sapo_loss(x.logp, x.ratio_logp, x.advantages, x.mask, tau_pos=o.tau_pos, tau_neg=o.tau_neg,
                                level=o.sapo_level, **x.agg),
)
def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    level: str = "token",
    weights: Optional[torch.Tensor] = None,
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

    **Sequence level** (``level="sequence"``): the gate is applied to GSPO's
    geometric-mean ratio :math:`s_i=\exp[\frac1{L_i}\sum_t(\ell^\theta_{i,t}-
    \ell^{old}_{i,t})]` (§17) with one advantage per response,

    .. math::
        J_i=f_i(s_i)\hat A_i,\qquad
        \nabla_\theta J_i=4p_i(1-p_i)\,s_i\hat A_i\,\frac1{L_i}\sum_t\nabla_\theta
        \ell^\theta_{i,t},\quad p_i=\sigma[\tau_i(s_i-1)]:

    every token of a response gets the same soft-gated weight (the regime where the §18
    bound says token-level SAPO approximates it: small steps, low within-sequence
    variance of the log ratio). Advantages must be ``[B]`` or constant per sequence, and
    the per-token term is :math:`-J_i` at each valid token, so the default
    ``"seq_mean_token_mean"`` is :math:`-\frac1G\sum_iJ_i`.

    **The ratio is NOT detached.** The surrogate has no explicit
    :math:`\log\pi_\theta` factor, so a detached :math:`r` would make the gradient
    exactly zero. Advantages and ``old_logp`` are detached evidence.

    The loss value at :math:`r=1` is :math:`-2\hat A/\tau` averaged: it depends on
    :math:`\tau` although the gradient does not, so do not compare raw SAPO losses across
    temperatures (§18).

    Where :math:`e^{z}` would overflow, :math:`z` is clamped (the gate is exactly 0 there
    and the term the constant :math:`-\frac4\tau\hat A`), so no ``0 * inf`` NaN arises.

    Args:
      logp: ``[B, L]`` current log-probs (attached).
      old_logp: ``[B, L]`` behaviour log-probs (detached here).
      advantages: ``[B, L]`` or ``[B]`` (detached here).
      mask: ``[B, L]`` action mask.
      tau_pos, tau_neg: positive temperatures (paper defaults 1.0 / 1.05).
      level: ``"token"`` (the paper's SAPO, default) or ``"sequence"`` (gate on
        :math:`s_i`).
      weights: optional ``[B, L]`` detached multiplier of the per-token term before
        aggregation (e.g. :attr:`trajgrad.logprobs.correction.Correction.weight`); a weight-0 token
        leaves the numerator and keeps its place in the denominator.
      aggregation: default ``"seq_mean_token_mean"`` (the paper's objective above).
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; metrics from :func:`trajgrad.diagnostics.policy_metrics` (on
      tokens, or on sequences for ``level="sequence"``, with ``sequences`` then) plus
      ``gate/mean`` (mean of :math:`4p(1-p)` over valid tokens, or over non-empty
      sequences), ``gate/pos_mean`` and ``gate/neg_mean`` (over :math:`\hat A>0` /
      :math:`\hat A\le0`).
    """
    tp = _check_tau("tau_pos", tau_pos)
    tn = _check_tau("tau_neg", tau_neg)
    _checks.check_choice("level", level, LEVELS)
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    if level == "sequence":
        adv = sequence_advantages(x, loss="sequence-level SAPO")  # [B]
        log_ratio = x.log_ratio().sum(-1) / x.lengths.clamp_min(1)  # [B] attached
        valid_f = (x.lengths > 0).to(adv.dtype)
    else:
        adv = x.advantages
        log_ratio = x.log_ratio()
        valid_f = x.maskf
    with torch.no_grad():
        posf = torch.sign(adv).clamp_(min=0.0)  # 1 where A > 0 (0 at masked slots)
        tau = (posf * (tp - tn)).add_(tn)  # tau_neg exactly where A <= 0; tau_pos up to one rounding
        coef = torch.div(adv, tau).mul_(4.0)  # 4 A / tau, detached evidence
    p = _gate(log_ratio, tau)
    term = p * coef  # f(r) A; 0 at masked slots / empty rows (A = 0 there); negated on the scalar
    w = token_weights(weights, x)
    if level == "sequence":
        if w is None:
            loss = -aggregate_sequences(term, x, aggregation, constant=constant, denominator=denominator)
        else:  # the response term spread over its tokens, each weighted
            loss = -aggregate_tokens(term[:, None] * w, x, aggregation, constant=constant, denominator=denominator)
        with torch.no_grad():
            nonempty = (x.lengths > 0)[:, None]
            metrics = _fast_policy_metrics(log_ratio.detach()[:, None], adv[:, None], nonempty, valid_f[:, None],
                                           valid_f.sum())
        metrics["sequences"] = metrics.pop("tokens")
        metrics["tokens"] = x.tokens.detach()
        count = metrics["sequences"]
    else:
        loss = -aggregate_tokens(weighted(term, w), x, aggregation, constant=constant, denominator=denominator)
        metrics = ratio_metrics(log_ratio.detach(), x)
        count = metrics["tokens"]
    with torch.no_grad():
        pd = p.detach()
        gate = (1.0 - pd).mul_(pd).mul_(4.0)
        dt = count.dtype
        g = gate.reshape(-1).to(dt)
        pf = posf.reshape(-1).to(dt)
        n_pos = pf.sum()
        g_all = torch.dot(g, valid_f.reshape(-1).to(dt))
        g_pos = torch.dot(g, pf)
        metrics["gate/mean"] = g_all / count.clamp_min(1)
        metrics["gate/pos_mean"] = g_pos / n_pos.clamp_min(1)
        metrics["gate/neg_mean"] = (g_all - g_pos) / (count - n_pos).clamp_min(1)
    return LossResult(loss, metrics)


__all__ = ["sapo_loss", "LEVELS"]
