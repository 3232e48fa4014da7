r"""GSPO and GSPO-token: clipping a length-normalized sequence ratio (spec §17).

Zheng et al., 2025, "Group Sequence Policy Optimization". The sequence ratio is the
geometric mean of the token ratios,
:math:`s_i=\exp[\frac1{L_i}\sum_t(\ell^\theta_{i,t}-\ell^{old}_{i,t})]`
(:func:`trajgrad.logprobs.gspo_sequence_ratio`), *not* the full-sequence density ratio.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .._policy_stats import _fast_policy_metrics, list_policy_metrics, loss_quantiles_enabled
from ..registry import policy_term
from ..types import LossResult
from ._common import (
    SequenceTerm, _count, aggregate_sequences, aggregate_tokens, check_aggregation, prepare, ratio_metrics,
    sequence_advantages, token_weights, weighted,
)
from ._clip import EPS_HIGH, EPS_LOW, _clip_bounds, _clipped_surrogate, check_eps_low_below_one


def _gspo_text(o) -> str:
    return (f"s_i = exp((1/L_i) Σ_t [log π_θ(y_it) − sg[log π_old(y_it)]])   (geometric-mean sequence ratio, §17;\n"
            "    NOT the full-sequence density ratio)\n"
            f"x_it = − min(s_i A_i, clip(s_i, 1 − {o.eps_low:g}, 1 + {o.eps_high_:g}) A_i)   at every token of response i\n"
            "    gradient: (s_i A_i / L_i) Σ_t ∇log π_θ(y_it) away from clipping")


@policy_term(
    "gspo", zero_without_advantage=True, fields=("eps_low", "eps_high"), ratio="old", detached=("old log-probs",),
    aggregation="seq_mean_token_mean", text=_gspo_text, sequence_advantages=True, verify_noise=2e-3,
    validate=check_eps_low_below_one, params=(EPS_LOW, EPS_HIGH),
    call=lambda o, x: gspo_loss(x.logp, x.ratio_logp, x.advantages, x.mask, eps_low=o.eps_low, eps_high=o.eps_high_,
                                **x.agg),
)
def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "seq_mean_token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""GSPO loss: PPO clipping applied to the sequence ratio :math:`s_i` (§17).

    .. math::
        J_i = \min\big(s_i\hat A_i,\ \operatorname{clip}(s_i,1-\epsilon_l,1+\epsilon_h)
        \hat A_i\big),\qquad
        J_{\mathrm{GSPO}} = \frac1G\sum_i J_i,\qquad \mathcal L=-J.

    Away from clipping (:math:`\nabla s_i = \frac{s_i}{L_i}\sum_t\nabla\ell^\theta_{i,t}`)

    .. math::
        \nabla_\theta J_i = \frac{s_i\hat A_i}{L_i}\sum_t\nabla_\theta\ell^\theta_{i,t}:

    every action token of response :math:`i` gets the same scalar weight. When
    :math:`s_i` is clipped (by the sign of :math:`\hat A_i`, as in §8), the whole response
    gets zero gradient.

    Implementation: the per-token term is :math:`-J_i` at every valid token of sequence
    :math:`i`, so the default ``"seq_mean_token_mean"`` returns exactly
    :math:`-\frac1G\sum_i J_i` (:math:`G` = number of non-empty sequences), and the other
    aggregations weigh :math:`J_i` by its token count etc.

    Args:
      logp: ``[B, L]`` current log-probs (attached; gradient through :math:`s_i`).
      old_logp: ``[B, L]`` behaviour log-probs (detached here).
      advantages: ``[B]``, or ``[B, L]`` constant over each sequence's valid tokens
        (to a relative tolerance of 1e-6; the first valid token's value is used);
        detached here. Anything else raises ``ValueError`` (use
        :func:`gspo_token_loss`). The constancy check reads values, so it is skipped
        under ``trajgrad.validation(False)``.
      mask: ``[B, L]`` action mask.
      eps_low, eps_high: clip range on :math:`s_i`; defaults ``3e-4`` / ``4e-4`` are the
        GSPO paper's (tiny, because :math:`s_i` is a per-token geometric mean).
      weights: optional ``[B, L]`` detached multiplier of the per-token term before
        aggregation (e.g. :attr:`trajgrad.logprobs.correction.Correction.weight`); a weight-0 token
        leaves the numerator and keeps its place in the denominator.
      aggregation: default ``"seq_mean_token_mean"`` (the paper's :math:`\frac1G\sum_i`).
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    A batch with no valid token (all-zero mask, or ``L = 0``) gives loss 0 (attached, zero
    gradient) and the metrics of an unchanged policy, like every other loss here.

    Returns:
      ``LossResult``; metrics from :func:`trajgrad.diagnostics.policy_metrics` computed
      on the *sequences* (one entry per non-empty sequence: ``log_ratio/*`` are quantiles
      of :math:`\log s_i`, ``clip_frac/*`` fractions of sequences), with ``sequences``
      (non-empty count) and ``tokens`` (valid tokens).
    """
    eps_low, eps_high, lo_b, hi_b = _clip_bounds(eps_low, eps_high)
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp",
                row_ratio=True)
    seq_adv = sequence_advantages(x)  # [B], 0 on empty rows
    w = token_weights(weights, x)
    attached_d = isinstance(denominator, torch.Tensor) and denominator.requires_grad
    lists = None
    if w is None and not attached_d:
        loss, log_s, lists = _sequence_loss(x, seq_adv, lo_b, hi_b, aggregation, constant, denominator)
    else:
        log_s = x.row_log_ratio() / x.lengths.clamp_min(1)  # [B], attached; 0 on empty rows
        j = _clipped_surrogate(log_s, seq_adv, eps_low, eps_high, lo_b, hi_b)  # 0 on empty rows
        if w is None:
            loss = aggregate_sequences(-j, x, aggregation, constant=constant, denominator=denominator)
        else:  # the response term spread over its tokens, each weighted
            loss = aggregate_tokens(-j[:, None] * w, x, aggregation, constant=constant, denominator=denominator)
    if lists is not None and not loss_quantiles_enabled():
        # the per-sequence values the loss read as Python numbers: the same metrics without reading them again
        ls, ns, advs = lists
        metrics = list_policy_metrics(ls, [1.0 if n > 0 else 0.0 for n in ns], advs, lo_b, hi_b, log_s.dtype,
                                      log_s.device)
    else:
        with torch.no_grad():
            nonempty = (x.lengths > 0)[:, None]
            nf = nonempty.to(x.lengths.dtype)
            metrics = _fast_policy_metrics(
                log_s.detach()[:, None], seq_adv[:, None], nonempty, nf, nf.sum(), lo_b=lo_b, hi_b=hi_b
            )
    metrics["sequences"] = metrics.pop("tokens")
    metrics["tokens"] = x.tokens.detach().to(metrics["sequences"].dtype)
    return LossResult(loss, metrics)


def _exp(v: float) -> float:
    return math.exp(v) if v < 709.0 else math.inf


def _sequence_loss(x, seq_adv, lo_b, hi_b, mode, constant, denominator):
    r"""GSPO's loss and ``log s`` without weights: the per-sequence part
    (:math:`B` numbers) in float64 by the interpreter, and one autograd node whose backward pass is the
    closed form :math:`\partial\mathcal L/\partial\ell_{i,t}=m_{i,t}\,w_i\,(-\partial J_i/\partial\log s_i)
    /(L_i D)` with :math:`\partial J_i/\partial\log s_i=\hat A_i s_i` where the clamp of
    :func:`trajgrad.losses._clip._clipped_surrogate` is inactive (bounds included), else 0. Equal to
    the tensor path (tested) up to float rounding."""
    check_aggregation(mode, constant)
    with torch.no_grad():
        rows = x.rows if x.rows is not None else x.log_ratio().detach().sum(-1)  # None: not the fast path
        log_s = rows / x.lengths.clamp_min(1)  # [B]; 0 on empty rows
        ls, ns, advs = log_s.tolist(), x.lengths.tolist(), seq_adv.tolist()
        if denominator is not None:
            d = float(_count(x, mode, denominator, log_s))
        elif mode == "token_mean":
            d = max(float(sum(ns)), 1.0)
        elif mode == "token_sum":
            d = 1.0
        else:  # the non-empty sequences
            d = max(float(sum(1 for n in ns if n > 0)), 1.0)
        if mode == "seq_mean_token_mean":
            ws = [1.0] * len(ns)
        elif mode == "seq_sum_constant":
            c = float(constant) if constant is not None else float(x.maskf.shape[-1])
            ws = [n / c for n in ns]
        else:
            ws = ns
        total = 0.0
        coefs = []
        for z, n, a, wi in zip(ls, ns, advs, ws):
            if a >= 0.0:  # upper bound only (A = 0: value and gradient 0)
                zc, active = min(z, hi_b), z <= hi_b
            else:
                zc, active = max(z, lo_b), z >= lo_b
            total += wi * a * _exp(zc)
            coefs.append(-wi * a * _exp(z) / (max(n, 1.0) * d) if active else 0.0)
        dt, dev = x.raw_logp.dtype, x.raw_logp.device
        value = torch.tensor(-total / d, dtype=dt, device=dev)
        coef = torch.tensor(coefs, dtype=dt, device=dev)
    return SequenceTerm.apply(x.raw_logp, value, coef, x.maskf), log_s, (ls, ns, advs)


def _gspo_token_text(o) -> str:
    return ("s_it = sg[s_i] · π_θ(y_it) / sg[π_θ(y_it)]    (value s_i, gradient s_i ∇log π_θ(y_it), §17)\n"
            f"x_it = − min(s_it A_it, clip(s_it, 1 − {o.eps_low:g}, 1 + {o.eps_high_:g}) A_it)\n"
            "    equals GSPO in value and gradient when A_it = A_i")


@policy_term(
    "gspo_token", zero_without_advantage=True, fields=("eps_low", "eps_high"), ratio="old",
    detached=("old log-probs", "the sequence ratio s_i inside s_it"), aggregation="seq_mean_token_mean",
    text=_gspo_token_text, verify_noise=2e-3, validate=check_eps_low_below_one, params=(EPS_LOW, EPS_HIGH),
    call=lambda o, x: gspo_token_loss(x.logp, x.ratio_logp, x.advantages, x.mask, eps_low=o.eps_low,
                                      eps_high=o.eps_high_, **x.agg),
)
def gspo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "seq_mean_token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""GSPO-token loss: per-token advantages on the GSPO ratio via a gradient carrier (§17).

    .. math::
        s_{i,t}=\mathrm{sg}[s_i]\,\frac{\pi_\theta(y_{i,t}\mid\cdot)}
        {\mathrm{sg}[\pi_\theta(y_{i,t}\mid\cdot)]},\qquad
        J = \frac1G\sum_i\frac1{L_i}\sum_t\min\big(s_{i,t}\hat A_{i,t},
        \operatorname{clip}(s_{i,t},1-\epsilon_l,1+\epsilon_h)\hat A_{i,t}\big).

    Numerically :math:`s_{i,t}=s_i` (so clipping decisions are per sequence and
    advantage sign), but :math:`\nabla s_{i,t}=s_i\nabla\ell^\theta_{i,t}`: away from
    clipping, token :math:`t` contributes :math:`\frac{1}{L_i}s_i\hat A_{i,t}
    \nabla\ell^\theta_{i,t}`. With :math:`\hat A_{i,t}=\hat A_i` this is exactly the
    :func:`gspo_loss` gradient; with distinct turn/token advantages each log-prob
    gradient is weighted locally.

    The stop-gradient on :math:`s_i` is essential and invisible in forward values: an
    attached :math:`s_i` times the carrier prints the same ratios but adds
    :math:`\frac{1}{L_i}\sum_t\hat A_{i,t}\cdot\frac{s_i}{L_i}\sum_{t'}\nabla\ell_{i,t'}`
    cross terms (§17, "matching forward values is insufficient").

    The ratio is formed in log space, :math:`\log s_{i,t}=\mathrm{sg}[\log s_i]+
    (\ell^\theta_{i,t}-\mathrm{sg}[\ell^\theta_{i,t}])`, whose exponential equals
    :func:`trajgrad.logprobs.gspo_token_ratio` in value and gradient.

    Args:
      logp, old_logp, mask: as in :func:`gspo_loss`.
      advantages: ``[B, L]`` per token or ``[B]`` (detached here).
      eps_low, eps_high: GSPO paper defaults ``3e-4`` / ``4e-4``.
      weights: optional ``[B, L]`` detached multiplier of the per-token term before
        aggregation (e.g. :attr:`trajgrad.logprobs.correction.Correction.weight`); a weight-0 token
        leaves the numerator and keeps its place in the denominator.
      aggregation: default ``"seq_mean_token_mean"`` (the paper's token average inside
        each response, then the mean over responses).
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; metrics from :func:`trajgrad.diagnostics.policy_metrics` on the
      per-token ratio :math:`s_{i,t}` and per-token advantages (token fractions).
    """
    eps_low, eps_high, lo_b, hi_b = _clip_bounds(eps_low, eps_high)
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    with torch.no_grad():
        log_s = x.log_ratio().sum(-1) / x.lengths.clamp_min(1)
        z = log_s[:, None] * x.maskf  # the value of log s_{i,t}: log s_i at valid tokens, 0 elsewhere
    lp = x.logp_factor
    log_ratio = z + (lp - lp.detach())  # carrier: value 0, gradient d logp (times A = 0 where masked)
    surrogate = _clipped_surrogate(log_ratio, x.advantages, eps_low, eps_high, lo_b, hi_b)
    loss = -aggregate_tokens(weighted(surrogate, token_weights(weights, x)), x, aggregation, constant=constant,
                             denominator=denominator)
    metrics = ratio_metrics(z, x, lo_b=lo_b, hi_b=hi_b)
    return LossResult(loss, metrics)


__all__ = ["gspo_loss", "gspo_token_loss"]
