r"""SAO's Direct double-sided Importance Sampling (DIS) policy loss (spec §20.2).

Hou et al., "Single-Rollout Asynchronous Optimization for Agentic Reinforcement
Learning". The ratio is taken directly against the rollout engine's recorded
log-probabilities (no intermediate old-policy checkpoint), and tokens whose ratio falls
outside a wide trust interval are *rejected* (weight 0), not clipped to the boundary.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks
from ..registry import Param, policy_term
from ..types import LossResult
from ._common import linear_in_logp, prepare, ratio_metrics, token_weights
from ._clip import EPS_HIGH, EPS_LOW, _clip_bounds, check_eps_low_below_one

RATIO_GRADIENTS = ("detached", "attached")


RATIO_GRADIENT = Param("ratio_gradient", "detached", "SAO's ``\"detached\"`` or ``\"attached\"`` ratio (§20.2).",
                       str, lambda v: _checks.check_choice("ratio_gradient", v, ("detached", "attached")))


def _sao_text(o) -> str:
    detached = o.ratio_gradient == "detached"
    w = "sg[r_t · 1{trusted}]" if detached else "r_t · 1{trusted}  (attached)"
    g = "A r ∇log π" if detached else "A r (1 + log π) ∇log π"
    return (f"r_t = exp(log π_θ(a_t) − log π_rollout(a_t))   (direct to the rollout engine's log-probs, §20.2)\n"
            f"trusted = {1 - o.eps_low:g} < r_t < {1 + o.eps_high_:g}   (strict; both tails rejected, not clipped)\n"
            f"x_t = − {w} · A_t · log π_θ(a_t)\n"
            f"    gradient inside the interval: {g}; zero outside")


@policy_term(
    "sao", zero_without_advantage=True, fields=("eps_low", "eps_high", "ratio_gradient"), ratio="behaviour",
    detached=lambda o: ("rollout log-probs",) + (("the trusted ratio weight",) if o.ratio_gradient == "detached" else ()),
    aggregation="token_mean", text=_sao_text, verify_noise=0.6, validate=check_eps_low_below_one,
    params=(EPS_LOW, EPS_HIGH, RATIO_GRADIENT),
    call=lambda o, x: sao_dis_loss(x.logp, x.ratio_logp, x.advantages, x.mask, ratio_gradient=o.ratio_gradient,
                                   eps_low=o.eps_low, eps_high=o.eps_high_, **x.agg),
)
def sao_dis_loss(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
    ratio_gradient: str = "detached",
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""SAO DIS loss: double-sided trust *rejection* with a direct rollout ratio (§20.2).

    .. math::
        r_t=\exp(\ell^\theta_t-\ell^{rollout}_t),\qquad
        f(r_t)=\begin{cases}r_t,&1-\epsilon_l<r_t<1+\epsilon_h\\0,&\text{otherwise}
        \end{cases},\qquad
        \mathcal L=-\operatorname{agg}_t\big[f(r_t)\,\hat A_t\,\ell^\theta_t\big].

    The inequalities are strict, as in the paper: a token exactly on a boundary is
    rejected (weight 0, gradient 0). Rejection happens on *both* tails, unlike PPO,
    which saturates only one side per advantage sign:

    ==========================  =============  =============  ===========
    condition                   PPO, A>0       PPO, A<0       SAO DIS
    ==========================  =============  =============  ===========
    :math:`r<1-\epsilon_l`      active         saturated      zero
    inside                      active         active         active
    :math:`r>1+\epsilon_h`      saturated      active         zero
    ==========================  =============  =============  ===========

    **Source-level ambiguity, made explicit by** ``ratio_gradient``. The paper prints the
    objective :math:`f(r)\hat A\log\pi_\theta` without a stop-gradient operator:

    * ``"detached"`` (default, the conventional importance-weighted policy gradient and
      the spec's minimal code): :math:`\mathrm{sg}[f(r)]\hat A\ell^\theta`, whose gradient
      inside the interval is

      .. math:: \nabla = \hat A\,r\,\nabla_\theta\ell^\theta.

    * ``"attached"`` (the printed equation read literally): :math:`f(r)` stays in the
      graph, :math:`\nabla(r\hat A\ell^\theta)=\hat A(r\nabla\ell^\theta+\ell^\theta
      r\nabla\ell^\theta)`, i.e.

      .. math:: \nabla = \hat A\,r\,(1+\ell^\theta)\,\nabla_\theta\ell^\theta,

      which is *not* the importance-weighted policy gradient (the factor
      :math:`1+\ell^\theta` changes sign at :math:`\pi_\theta=e^{-1}`).

    Outside the interval both give exactly 0. The trust test is made on the log ratio,
    :math:`\log(1-\epsilon_l)<z<\log(1+\epsilon_h)`.

    Args:
      logp: ``[B, L]`` current log-probs (attached).
      rollout_logp: ``[B, L]`` log-probs recorded by the rollout engine for the sampled
        tokens, under the distribution that actually sampled them (detached here).
      advantages: ``[B, L]`` or ``[B]`` (detached here; SAO uses critic/GAE advantages).
      mask: ``[B, L]`` action mask.
      eps_low: :math:`\epsilon_l\in(0,1]`; eps_high: :math:`\epsilon_h>0`. Defaults
        0.3 / 5.0 are the paper's reasoning setting (coding: 0.8 / 3.0); these wide
        intervals are not PPO clip values.
      ratio_gradient: ``"detached"`` or ``"attached"`` (see above).
      weights: optional ``[B, L]`` detached multiplier of the per-token term before
        aggregation (e.g. :attr:`trajgrad.logprobs.correction.Correction.weight`); a weight-0 token
        leaves the numerator and keeps its place in the denominator.
      aggregation: default ``"token_mean"`` (the spec's minimal code divides by
        ``action_mask.sum()``; SAO trains token-level with a critic).
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; metrics from :func:`trajgrad.diagnostics.policy_metrics` (ratio
      statistics, ``kl/*`` of :math:`\mathrm{KL}(\pi_{rollout}\Vert\pi_\theta)`) plus
      ``trust/accepted``, ``trust/rejected_low`` (:math:`r\le1-\epsilon_l`),
      ``trust/rejected_high`` (:math:`r\ge1+\epsilon_h`), fractions of valid tokens.
    """
    _checks.check_choice("ratio_gradient", ratio_gradient, RATIO_GRADIENTS)
    eps_low, eps_high, lo_b, hi_b = _clip_bounds(eps_low, eps_high)
    x = prepare(
        logp, mask, advantages, aggregation=aggregation, behaviour=rollout_logp, behaviour_name="rollout_logp"
    )
    log_ratio = x.log_ratio()  # finite, 0 at masked positions
    z = log_ratio.detach()
    with torch.no_grad():
        # 1 exactly where lo_b < z (resp. z < hi_b): relu(sign(x)) = 1[x > 0]; masked slots
        # (z = 0) are trusted, and their A = 0
        above_low = (z - lo_b).sign_().relu_()
        trusted_f = (hi_b - z).sign_().relu_().mul_(above_low)
    # The ratio is never formed above the trust region (the clamp keeps e^z finite), and a
    # rejected token's weight is a finite value times 0.
    em1 = None
    if ratio_gradient == "attached":
        # the ratio formed as 1 + expm1(z), as in the detached reading: the two give the same value
        coef = (torch.expm1(torch.clamp(log_ratio, max=hi_b)) + 1.0) * (trusted_f * x.advantages)
    else:
        with torch.no_grad():
            # one transcendental pass for the weight and the metrics: r = 1 + expm1(z), bounded by
            # 1 + eps_high (finite where it overflows; those tokens are rejected anyway)
            em1 = torch.expm1(z)
            coef = em1.add(1.0).clamp_(max=math.exp(hi_b)).mul_(trusted_f).mul_(x.advantages)
    loss = linear_in_logp(coef, x, aggregation, weights=token_weights(weights, x), constant=constant,
                          denominator=denominator)
    metrics = ratio_metrics(z, x, em1=em1)
    with torch.no_grad():
        dt = metrics["tokens"].dtype
        n = metrics["tokens"].clamp_min(1)
        n_masked = x.maskf.numel() - metrics["tokens"]
        accepted = trusted_f.sum().to(dt) - n_masked
        rej_low = metrics["tokens"] - (above_low.sum().to(dt) - n_masked)  # masked slots are never rejected
        metrics["trust/accepted"] = accepted / n
        metrics["trust/rejected_low"] = rej_low / n
        metrics["trust/rejected_high"] = (metrics["tokens"] - accepted - rej_low) / n
    return LossResult(loss, metrics)


__all__ = ["sao_dis_loss", "RATIO_GRADIENTS"]
