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
from typing import Optional

import torch

from ..types import LossResult
from ..registry import Param, finite_positive, policy_term
from ._clip import EPS_HIGH, EPS_LOW, _clip_bounds, _clipped_surrogate, check_eps_low_below_one
from ._common import aggregate_tokens, prepare, ratio_metrics, token_weights, weighted


def _check_dual_clip(dual_clip: Optional[float]) -> Optional[float]:
    if dual_clip is None:
        return None
    c = float(dual_clip)
    if not (c > 1.0) or not math.isfinite(c):
        raise ValueError(f"dual_clip: must be a finite number > 1, got {dual_clip}")
    return c


def _check_dual_clip_field(v) -> None:
    if v is not None:
        finite_positive("dual_clip", v)
        if not v > 1:
            raise ValueError(f"dual_clip: must be > 1, got {v}")


DUAL_CLIP = Param("dual_clip", None, "dual-clip constant c > 1 for negative advantages (``None`` = off).",
                  Optional[float], _check_dual_clip_field)


def _ppo_text(o) -> str:
    el, eh = o.eps_low, o.eps_high_
    s = (f"ρ_it = exp(log π_θ(y_it) − sg[log π_old(y_it)])   (per-token ratio, §7)\n"
         f"x_it = − min(ρ_it A_it, clip(ρ_it, 1 − {el:g}, 1 + {eh:g}) A_it)   (§8)\n"
         f"    A > 0: no gain once ρ > {1 + eh:g};  A < 0: no gain once ρ < {1 - el:g}")
    if o.dual_clip is not None:
        s += f"\n    dual clip: for A < 0, x_it = − max(min(...), {o.dual_clip:g} · A_it)"
    return s


@policy_term(
    "ppo", zero_without_advantage=True, fields=("eps_low", "eps_high", "dual_clip"), ratio="old",
    detached=("old log-probs",), aggregation="token_mean", text=_ppo_text, validate=check_eps_low_below_one,
    params=(EPS_LOW, EPS_HIGH, DUAL_CLIP),
    call=lambda o, x: ppo_clip_loss(x.logp, x.ratio_logp, x.advantages, x.mask, dual_clip=o.dual_clip,
                                    eps_low=o.eps_low, eps_high=o.eps_high_, **x.agg),
)
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
        aggregation (e.g. :attr:`trajgrad.logprobs.correction.Correction.weight`); a weight-0 token
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
