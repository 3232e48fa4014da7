r"""PPO's clipped surrogate, with asymmetric (clip-higher) and dual clipping (spec §7, §8).

The clipped surrogate :math:`\min(\rho A, \operatorname{clip}(\rho, 1-\epsilon_l,
1+\epsilon_h)A)` is evaluated here case by case (the §8 tables) rather than with a
``minimum`` of two branches. The values are identical; the difference is that wherever
the gradient is zero (a saturated side, a dual-clipped token, :math:`A=0`) the ratio is
not formed from the log-ratio at all, so an overflowing :math:`e^{z}` cannot turn into a
``0 * inf = NaN`` gradient. At the boundaries themselves the §8 convention holds: the
surrogate is :math:`\rho A` for :math:`\rho\le1+\epsilon_h` (:math:`A>0`) and for
:math:`\rho\ge1-\epsilon_l` (:math:`A<0`); every comparison is made in log space.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from ..diagnostics import _log_bound
from ..types import LossResult
from ._common import aggregate_tokens, prepare, ratio_metrics, token_weights, weighted


def _clip_bounds(eps_low: float, eps_high: Optional[float]) -> Tuple[float, float, float, float]:
    """Validate the clip range; return ``(eps_low, eps_high, log(1-eps_low), log(1+eps_high))``."""
    eps_high = eps_low if eps_high is None else eps_high
    lo_b = _log_bound("eps_low", eps_low, "low")
    hi_b = _log_bound("eps_high", eps_high, "high")
    return float(eps_low), float(eps_high), lo_b, hi_b


_FAR = 1e4  # a log-ratio bound that never binds (e^{1e4} overflows every float dtype)


def _clipped_surrogate(
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float,
    eps_high: float,
    lo_b: float,
    hi_b: float,
    dual_clip: Optional[float] = None,
) -> torch.Tensor:
    r"""Elementwise PPO surrogate :math:`\min(\rho A,\operatorname{clip}(\rho)A)` (dual-clipped).

    ``log_ratio`` (attached) and ``adv`` (detached) are finite tensors of one shape.
    Written as :math:`A\,e^{\operatorname{clamp}(z,\,l_A,\,u_A)}` with per-token log
    bounds chosen by the sign of :math:`A`:

    * :math:`A\ge0`: :math:`u=\log(1+\epsilon_h)`, no lower bound — for :math:`A>0` this
      is §8's first table; for :math:`A=0` the value and the gradient are 0 either way, and
      the bound keeps :math:`e^{z}` finite;
    * :math:`A<0`: :math:`l=\log(1-\epsilon_l)`, and :math:`u=\log c` with a dual clip.

    ``clamp`` passes the gradient at equality, so a ratio exactly on a bound is active
    (the §8 convention: :math:`\rho A` for :math:`\rho\le1+\epsilon_h` when
    :math:`A>0`, for :math:`\rho\ge1-\epsilon_l` when :math:`A<0`). Outside the bounds
    the surrogate is the constant :math:`(1+\epsilon_h)A`, :math:`(1-\epsilon_l)A` or
    :math:`cA` (computed as :math:`Ae^{\log(\cdot)}`, equal up to one rounding) with
    gradient 0, and the ratio is never formed beyond the bound, so no ``0 * inf`` arises.
    Only arithmetic is used (no ``torch.where``): the bounds are exact because each is
    ``bound + 0`` where it applies.
    """
    with torch.no_grad():
        negf = torch.sign(adv).clamp_(max=0.0).neg_()  # 1 where A < 0, else 0
        upper = (negf * _FAR).add_(hi_b)
        lower = (negf - 1.0).mul_(_FAR).add_(lo_b)
        if dual_clip is not None:
            # A < 0: min(upper, log c) = log c exactly; A >= 0: upper
            upper = torch.minimum(upper, (1.0 - negf).mul_(_FAR).add_(math.log(dual_clip)))
    z = torch.clamp(log_ratio, min=lower, max=upper)
    return adv * torch.exp(z)


def _check_dual_clip(dual_clip: Optional[float]) -> Optional[float]:
    if dual_clip is None:
        return None
    c = float(dual_clip)
    if not (c > 1.0) or not math.isfinite(c):
        raise ValueError(f"dual_clip: must be a finite number > 1, got {dual_clip}")
    return c


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""PPO clipped-surrogate loss (Schulman et al., 2017; spec §8), token ratios (§7).

    With :math:`\rho_{i,t}=\exp(\ell^\theta_{i,t}-\ell^{old}_{i,t})`:

    .. math::
        s_{i,t} = \min\big(\rho_{i,t}\hat A_{i,t},\;
                  \operatorname{clip}(\rho_{i,t},1-\epsilon_l,1+\epsilon_h)\hat A_{i,t}\big),
        \qquad \mathcal L = -\operatorname{agg}_{i,t}\,s_{i,t}.

    By advantage sign (§8):

    * :math:`A>0`: :math:`s=\rho A` for :math:`\rho\le1+\epsilon_h`, else
      :math:`(1+\epsilon_h)A` (gradient 0: no reward for pushing further up).
    * :math:`A<0`: :math:`s=(1-\epsilon_l)A` for :math:`\rho<1-\epsilon_l` (gradient 0),
      else :math:`\rho A` (increasing a bad action stays penalized, unboundedly).

    In the active region the gradient of one token's surrogate is
    :math:`\hat A\,\rho\,\nabla_\theta\ell^\theta`.

    **Asymmetric clip** (DAPO's clip-higher, Yu et al. 2025): ``eps_high > eps_low``
    leaves more room to raise low-probability tokens. ``eps_high`` defaults to ``eps_low``.

    **Dual clip** (Ye et al., 2020, "Mastering Complex Control in MOBA Games"): for
    :math:`A<0` the surrogate becomes :math:`\max(\min(\rho A,\operatorname{clip}(\rho)A),
    cA)` with :math:`c>1`, i.e. :math:`cA` (gradient 0) once :math:`\rho>c`, bounding the
    otherwise unbounded penalty on a stale token whose ratio exploded.

    Clipping does not bound the KL (§8); see the metrics.

    Args:
      logp: ``[B, L]`` current log-probs (attached).
      old_logp: ``[B, L]`` log-probs under the policy that sampled (detached here).
      advantages: ``[B, L]`` or ``[B]`` (detached here).
      mask: ``[B, L]`` action mask.
      eps_low: lower clip :math:`\epsilon_l\in(0,1]`.
      eps_high: upper clip :math:`\epsilon_h>0`; default ``eps_low``.
      dual_clip: :math:`c>1`, or ``None`` for no dual clip.
      weights: optional ``[B, L]`` detached multiplier of the per-token term before
        aggregation (e.g. :attr:`trajgrad.correction.Correction.weight`); a weight-0 token
        leaves the numerator and keeps its place in the denominator.
      aggregation: default ``"token_mean"`` (the §8/§23 code: ``masked_mean``; also DAPO's
        token-level loss). GRPO's paper uses ``"seq_mean_token_mean"``.
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; metrics from :func:`trajgrad.diagnostics.policy_metrics` (clip
      fractions by sign and side, ratio and log-ratio statistics, ``kl/k1`` and ``kl/k3``
      of :math:`\mathrm{KL}(\pi_{old}\Vert\pi_\theta)`, ``tokens``) plus
      ``clip_frac/dual`` (fraction of valid tokens dual-clipped; 0 without dual clip).
    """
    eps_low, eps_high, lo_b, hi_b = _clip_bounds(eps_low, eps_high)
    c = _check_dual_clip(dual_clip)
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    log_ratio = x.log_ratio()  # exactly 0 at masked positions
    surrogate = _clipped_surrogate(log_ratio, x.advantages, eps_low, eps_high, lo_b, hi_b, c)
    loss = -aggregate_tokens(weighted(surrogate, token_weights(weights, x)), x, aggregation, constant=constant, denominator=denominator)
    z = log_ratio.detach()
    metrics = ratio_metrics(z, x, lo_b=lo_b, hi_b=hi_b)
    with torch.no_grad():
        dt = metrics["tokens"].dtype
        if c is None:
            metrics["clip_frac/dual"] = torch.zeros((), dtype=dt, device=z.device)
        else:
            dual = (x.advantages < 0) & (z > math.log(c))
            metrics["clip_frac/dual"] = torch.count_nonzero(dual).to(dt) / metrics["tokens"].clamp_min(1)
    return LossResult(loss, metrics)


__all__ = ["ppo_clip_loss"]
