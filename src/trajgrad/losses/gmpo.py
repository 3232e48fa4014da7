r"""GMPO: maximize the geometric mean of token-clipped surrogates (spec §8, §17).

Zhao et al., 2025, "Geometric-Mean Policy Optimization" (arXiv:2507.20673).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _checks
from .._policy_stats import _fast_policy_metrics
from ..registry import Param, PolicyTerm, finite_positive, register_policy_term
from ..types import LossResult
from ._common import aggregate_sequences, aggregate_tokens, prepare, sequence_advantages, token_weights

_FAR = 1e4
CLIP_LEVELS = ("token", "sequence")


def _check_log_clip(name: str, value: float) -> float:
    v = float(value)
    if not (v > 0.0) or v != v or v == float("inf"):
        raise ValueError(f"{name}: must be a finite positive log-space clip, got {value}")
    return v


def gmpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    clip_level: str = "token",
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "seq_mean_token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""GMPO loss: the geometric mean of PPO-clipped token ratios, clipped in log space.

    GMPO maximizes, per response :math:`i` with one advantage :math:`\hat A_i`,

    .. math::
        J_i=\Big\{\prod_t\big|\min\big(r_{i,t}\hat A_i,\ \operatorname{clip}(r_{i,t},
        e^{-c_l},e^{c_h})\hat A_i\big)\big|\Big\}^{1/L_i}\operatorname{sign}(\hat A_i)
        =\hat A_i\exp\Big(\frac1{L_i}\sum_t\tilde z_{i,t}\Big),

    where :math:`z=\ell^\theta-\ell^{old}` and the clipping is **per token, in log space,
    by the sign of the advantage** (the paper's token-level clipping, §3):

    .. math::
        \tilde z_{i,t}=\operatorname{sign}(\hat A_i)\min\big(\operatorname{sign}(\hat A_i)
        z_{i,t},\ \operatorname{sign}(\hat A_i)\operatorname{clamp}(z_{i,t},-c_l,c_h)\big),

    i.e. :math:`\tilde z=\min(z,c_h)` for :math:`\hat A>0` and :math:`\tilde z=\max(z,-c_l)`
    for :math:`\hat A<0`, like §8's tables but on :math:`\log r`. The loss is
    :math:`-\frac1G\sum_iJ_i` (default ``"seq_mean_token_mean"``). Gradient, with
    :math:`s_i=\exp(\frac1{L_i}\sum_t\tilde z_{i,t})`:

    .. math::
        \nabla_\theta J_i=\hat A_i\,s_i\,\frac1{L_i}\sum_t\mathbb 1[\text{token }t
        \text{ not clipped}]\ \nabla_\theta\ell^\theta_{i,t}:

    every unclipped token of a response gets the same weight :math:`\hat A_is_i/L_i`
    (like GSPO, §17), but an outlier token is clipped *alone* rather than silencing the
    whole response, and the geometric mean is far less sensitive to one extreme ratio
    than the arithmetic mean of GRPO. A ratio exactly on a bound is active (§8). The
    paper's default range is :math:`(e^{-0.4}, e^{0.4})`.

    **Sequence-level clipping** (``clip_level="sequence"``, the paper's §3 alternative): the
    *mean* log-ratio is clipped instead, by the same sign rule,

    .. math::
        J_i=\hat A_i\exp(\tilde z_i),\qquad \tilde z_i=\operatorname{sign}(\hat A_i)
        \min\big(\operatorname{sign}(\hat A_i)\bar z_i,\ \operatorname{sign}(\hat A_i)
        \operatorname{clamp}(\bar z_i,-c_l,c_h)\big),\quad \bar z_i=\frac1{L_i}\sum_tz_{i,t},

    so a clipped response gets no gradient at all (GSPO-like) and an unclipped one the same
    gradient as at token level with nothing clipped.

    Worked example (one response, :math:`\hat A=1`, :math:`z=(0.7, 0.3)`,
    :math:`c_l=c_h=0.4`, default aggregation): token level clips token 0 alone,
    :math:`\tilde z=(0.4, 0.3)`, :math:`J=e^{0.35}=1.419068`, loss :math:`-1.419068`,
    :math:`\partial L/\partial\ell^\theta=(0, -e^{0.35}/2)=(0, -0.709534)`; sequence level
    clips :math:`\bar z=0.5` to 0.4, :math:`J=e^{0.4}=1.491825`, loss :math:`-1.491825`,
    gradient :math:`(0, 0)`.

    Args:
      logp: ``[B, L]`` current log-probs (attached).
      old_logp: ``[B, L]`` old log-probs (detached).
      advantages: ``[B]`` or ``[B, L]`` constant per response (detached).
      mask: ``[B, L]`` action mask.
      clip_low, clip_high: :math:`c_l, c_h>0`, bounds on :math:`\log r` (paper: 0.4).
      clip_level: ``"token"`` (default: each :math:`z_{i,t}` is clipped) or ``"sequence"``
        (the mean :math:`\bar z_i` is clipped).
      weights: optional ``[B, L]`` detached per-token multiplier (e.g. a rollout
        correction). With weights the response term is spread over its tokens,
        :math:`-w_{i,t}J_i` at each valid token, and aggregated per token.
      aggregation: default ``"seq_mean_token_mean"`` (:math:`\frac1G\sum_i`).
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; metrics: ``clip_frac`` (valid tokens whose log ratio was clipped; at
      sequence level, the valid tokens of responses whose mean was clipped),
      ``clip_frac/pos_high`` / ``clip_frac/neg_low`` (by side), the
      :func:`trajgrad.diagnostics.policy_metrics` statistics of the per-response clipped
      geometric-mean ratio :math:`s_i` (``ratio/*``, ``log_ratio/*``, ``kl/*``),
      ``sequences`` and ``tokens``.
    """
    cl = _check_log_clip("clip_low", clip_low)
    ch = _check_log_clip("clip_high", clip_high)
    if clip_level not in CLIP_LEVELS:
        raise ValueError(f"clip_level: must be one of {CLIP_LEVELS}, got {clip_level!r}")
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    w = token_weights(weights, x)
    seq_adv = sequence_advantages(x, loss="GMPO")  # [B], 0 on empty rows
    with torch.no_grad():
        negf = -torch.sign(seq_adv).clamp(max=0.0)[:, None]  # 1 where A_i < 0
        upper = negf * _FAR + ch  # A >= 0: c_h (A = 0 only keeps exp finite)
        lower = (negf - 1.0) * _FAR - cl  # A < 0: -c_l
    z = x.log_ratio()
    if clip_level == "token":
        z_tilde = torch.clamp(z, min=lower, max=upper)  # 0 at masked slots (z = 0 lies inside)
        log_s = z_tilde.sum(-1) / x.lengths.clamp_min(1)  # [B]
    else:
        z_bar = z.sum(-1) / x.lengths.clamp_min(1)  # [B], 0 on empty rows
        log_s = torch.clamp(z_bar, min=lower[:, 0], max=upper[:, 0])
    j = seq_adv * torch.exp(log_s)  # 0 on empty rows (A = 0)
    if w is None:
        loss = aggregate_sequences(-j, x, aggregation, constant=constant, denominator=denominator)
    else:
        loss = aggregate_tokens(-j[:, None] * w, x, aggregation, constant=constant, denominator=denominator)
    with torch.no_grad():
        zd = z.detach() if clip_level == "token" else z_bar.detach()[:, None].expand_as(z) * x.mask
        pos = seq_adv[:, None] > 0
        neg = seq_adv[:, None] < 0
        high = pos & (zd > ch) & x.mask
        low = neg & (zd < -cl) & x.mask
        dt = x.tokens.dtype
        n = x.tokens.clamp_min(1)
        nonempty = (x.lengths > 0)[:, None]
        nf = nonempty.to(dt)
        metrics = _fast_policy_metrics(log_s.detach()[:, None], seq_adv[:, None], nonempty, nf, nf.sum())
        metrics["sequences"] = metrics.pop("tokens")
        metrics["tokens"] = x.tokens.detach()
        metrics["clip_frac/pos_high"] = torch.count_nonzero(high).to(dt) / n
        metrics["clip_frac/neg_low"] = torch.count_nonzero(low).to(dt) / n
        metrics["clip_frac"] = metrics["clip_frac/pos_high"] + metrics["clip_frac/neg_low"]
    return LossResult(loss, metrics)


__all__ = ["gmpo_loss", "CLIP_LEVELS"]


# ---------------------------------------------------------------------- the recipe's fields and registry entry
_LOG_CLIP_DOC = "GMPO's clip range on the token *log* ratio."
LOG_CLIP_LOW = Param("log_clip_low", 0.4, _LOG_CLIP_DOC, float, lambda v: finite_positive("log_clip_low", v))
LOG_CLIP_HIGH = Param("log_clip_high", 0.4, _LOG_CLIP_DOC, float, lambda v: finite_positive("log_clip_high", v))
GMPO_CLIP_LEVEL = Param("gmpo_clip_level", "token", "GMPO's clipping: ``\"token\"`` clips each token's log ratio "
                        "(the paper's default) or ``\"sequence\"`` clips the response's mean log ratio (the paper's "
                        "§3 alternative; a clipped response has no gradient). ``gmpo_loss(clip_level=)``.", str,
                        lambda v: _checks.check_choice("gmpo_clip_level", v, CLIP_LEVELS))


def _gmpo_text(o) -> str:
    cl, ch = o.log_clip_low, o.log_clip_high
    if o.gmpo_clip_level == "sequence":
        return ("z_it = log π_θ(y_it) − sg[log π_old(y_it)],  z̄_i = (1/L_i) Σ_t z_it\n"
                f"z̃_i = min(z̄_i, {ch:g}) if A_i > 0;  max(z̄_i, −{cl:g}) if A_i < 0   "
                "(sequence-level clip of the mean log ratio)\n"
                "x_it = − A_i · exp(z̃_i)   at every token of response i   (geometric mean of the ratios, clipped)\n"
                "    gradient (A_i s̃_i / L_i) ∇log π_θ(y_it) at every token of an unclipped response, 0 for every token "
                "of a clipped one")
    return ("z_it = log π_θ(y_it) − sg[log π_old(y_it)]\n"
            f"z̃_it = min(z_it, {ch:g}) if A_i > 0;  max(z_it, −{cl:g}) if A_i < 0   (token-level clip in log space)\n"
            "x_it = − A_i · exp((1/L_i) Σ_t z̃_it)   at every token of response i   (geometric mean of clipped ratios)\n"
            "    gradient (A_i s̃_i / L_i) ∇log π_θ(y_it) on unclipped tokens, 0 on clipped ones")


register_policy_term(PolicyTerm(
    name="gmpo", zero_without_advantage=True, fn=gmpo_loss, fields=("log_clip_low", "log_clip_high", "gmpo_clip_level"),
    ratio="old",
    detached=("old log-probs",), aggregation="seq_mean_token_mean", text=_gmpo_text, sequence_advantages=True,
    params=(LOG_CLIP_LOW, LOG_CLIP_HIGH, GMPO_CLIP_LEVEL),
    call=lambda o, x: gmpo_loss(x.logp, x.ratio_logp, x.advantages, x.mask, clip_low=o.log_clip_low,
                                clip_high=o.log_clip_high, clip_level=o.gmpo_clip_level, **x.agg),
))
