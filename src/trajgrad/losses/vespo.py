r"""VESPO: a smooth Gamma-shaped weight on the sequence importance ratio, in place of clipping (spec §7, §17).

"VESPO: Variational Sequence-Level Soft Policy Optimization" (arXiv:2602.10693); TRL 1.16's
``loss_type="vespo"``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks
from ..registry import policy_term
from ..types import LossResult
from ._common import aggregate_tokens, prepare, ratio_metrics, token_weights, weighted

TOKEN_LOG_RATIO_CLAMP = 20.0                              # |z_t| ≤ 20 before the sum
SEQ_LOG_RATIO_RANGE = (math.log(1e-8), 20.0)              # log w ∈ [log 1e-8, 20]


def _vespo_text(o) -> str:
    return ("log w_i = clamp(Σ_t clamp(log π_θ(y_it) − log π_old(y_it), ±20), log 1e-8, 20)   (full sequence ratio)\n"
            "φ(w) = e^λ w^k e^(−λw)   (φ(1) = 1),  (k, λ) = (2, 3) if A_it ≥ 0, (3, 2) if A_it < 0   (the paper's)\n"
            "x_it = − sg[φ(w_i)] · A_it · log π_θ(y_it)   (a smooth weight on the sequence ratio, no clipping)")


@policy_term(
    "vespo", zero_without_advantage=True, fields=(), ratio="old", detached=("old log-probs", "the weight φ(w_i)"),
    aggregation="token_mean", text=_vespo_text,
    call=lambda o, x: vespo_loss(x.logp, x.ratio_logp, x.advantages, x.mask, **x.agg),
)
def vespo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""VESPO loss: :math:`-\mathrm{sg}[\varphi(w_i)]\,\hat A\,\log\pi_\theta`, :math:`\varphi` a Gamma-shaped weight.

    With the *full* sequence log ratio (a sum, not GSPO's mean, §17)

    .. math::
        \log w_i=\operatorname{clamp}\Big(\sum_t\operatorname{clamp}(z_{i,t},-20,20),\ \log10^{-8},\ 20\Big),
        \qquad z_{i,t}=\ell^\theta_{i,t}-\ell^{old}_{i,t},

    .. math::
        \varphi(w)=e^{\lambda}\,w^{k}\,e^{-\lambda w}\quad(\varphi(1)=1),\qquad
        \mathcal L=-\operatorname{agg}_{i,t}\big[\mathrm{sg}[\varphi(w_i)]\,\hat A_{i,t}\,\ell^\theta_{i,t}\big],

    :math:`(k,\lambda)=(k_+,\lambda_+)` where :math:`\hat A\ge0`, :math:`(k_-,\lambda_-)` where
    :math:`\hat A<0`. The weight is the density of a Gamma distribution in :math:`w`, scaled to
    1 at :math:`w=1`: it rises as :math:`w^k` for small ratios and decays as
    :math:`e^{-\lambda w}` for large ones, its mode at :math:`w=k/\lambda`. Far-off-policy
    sequences are down-weighted smoothly instead of being cut at a clip boundary; at
    :math:`w=1` the gradient is REINFORCE's, :math:`-\hat A\nabla\ell^\theta`. The weight is
    detached (a gradient coefficient), computed in log space
    (:math:`\log\varphi=\lambda+k\log w-\lambda w`).

    The two clamps are the paper's code's (and TRL's): per-token log ratios to :math:`\pm20`
    before summing, and :math:`\log w` to :math:`[\log10^{-8},20]` (so :math:`\varphi` is
    finite, and 0 to double precision above the upper end).

    Args:
      logp: ``[B, L]`` current log-probs (attached).
      old_logp: ``[B, L]`` log-probs of the policy that sampled (detached).
      advantages: ``[B, L]`` or ``[B]`` (detached); the sign picks :math:`(k,\lambda)` per token.
      mask: ``[B, L]`` action mask.
      k_pos, lambda_pos, k_neg, lambda_neg: the shapes, :math:`k\ge0`, :math:`\lambda>0`
        (paper and TRL defaults 2, 3, 3, 2).
      weights: optional ``[B, L]`` detached multiplier of the per-token term.
      aggregation: default ``"token_mean"`` (TRL normalizes by the batch's token count).
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; :func:`trajgrad.diagnostics.policy_metrics` on the token log ratios plus
      ``vespo/weight_mean`` (valid-token mean of :math:`\varphi`) and ``vespo/log_w_mean``
      (mean of :math:`\log w_i` over non-empty rows).
    """
    for name, v in (("k_pos", k_pos), ("k_neg", k_neg)):
        if not math.isfinite(float(v)):
            raise ValueError(f"{name}: must be finite, got {v}")
        _checks.check_positive(name, float(v), allow_zero=True)
    for name, v in (("lambda_pos", lambda_pos), ("lambda_neg", lambda_neg)):
        if not math.isfinite(float(v)):
            raise ValueError(f"{name}: must be finite, got {v}")
        _checks.check_positive(name, float(v))
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    with torch.no_grad():
        z = x.log_ratio().detach()  # 0 at masked slots
        lo, hi = SEQ_LOG_RATIO_RANGE
        log_w = z.clamp(-TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP).sum(-1).clamp(lo, hi)[:, None]
        pos = x.advantages >= 0
        k = torch.where(pos, float(k_pos), float(k_neg)).to(z.dtype)
        lam = torch.where(pos, float(lambda_pos), float(lambda_neg)).to(z.dtype)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())
        coef = phi * x.advantages
    term = coef * x.logp_factor  # the negation is applied to the scalar
    loss = -aggregate_tokens(weighted(term, token_weights(weights, x)), x, aggregation, constant=constant,
                             denominator=denominator)
    metrics = ratio_metrics(z, x)
    with torch.no_grad():
        dt = metrics["tokens"].dtype
        metrics["vespo/weight_mean"] = (phi * x.maskf).sum().to(dt) / metrics["tokens"].clamp_min(1)
        rows = (x.lengths > 0).to(dt)
        metrics["vespo/log_w_mean"] = (log_w[:, 0].to(dt) * rows).sum() / rows.sum().clamp_min(1)
    return LossResult(loss, metrics)


__all__ = ["vespo_loss"]
