r"""CISPO: clip the importance-sampling *weight*, keep every token's gradient (spec §7, §8).

MiniMax, 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
Attention" (arXiv:2506.13585), §3.1.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .. import _checks
from ..diagnostics import _log_bound, _rereads, _valid_extrema_floats
from ..registry import Param, finite_positive, policy_term
from ..types import LossResult
from ._clip import EPS_HIGH, EPS_LOW
from ._common import linear_in_logp, prepare, ratio_metrics, token_weights


def _count_positive(diff: torch.Tensor, bound: float) -> torch.Tensor:
    r"""Number of positive entries of ``diff``, which is ``z - bound`` or ``bound - z`` for a finite ``z``
    (consumed in place).

    Three passes instead of four: two distinct floats one of which is the bound :math:`b \ne 0` differ by
    at least the smaller of the spacings of the floats just below and just above :math:`|b|`, so at
    least :math:`u`, half the spacing in the binade of :math:`|b|` (a power of two; the rounded
    difference too, rounding being monotone), so :math:`\operatorname{clamp}(d,0,u)` is exactly :math:`u` at the positive entries and 0
    elsewhere, and a sum of at most :math:`2^{24}` copies of :math:`u` is exact. Other dtypes, a zero
    bound or larger tensors count by ``relu(sign(d))``.
    """
    u = _half_spacing(float(bound), diff.dtype) if diff.numel() < 2 ** 24 else 0.0
    if u == 0.0:
        return diff.sign_().relu_().sum()
    return diff.clamp_(0.0, u).sum() / u


@functools.lru_cache(maxsize=64)
def _half_spacing(bound: float, dtype: torch.dtype) -> float:
    """``u`` of :func:`_count_positive` for ``bound`` rounded to ``dtype`` (0.0: count by sign)."""
    if dtype not in (torch.float32, torch.float64):
        return 0.0
    b = abs(float(torch.tensor(bound, dtype=dtype)))
    if b == 0.0 or not math.isfinite(b):
        return 0.0
    fin = torch.finfo(dtype)
    return max(math.ldexp(fin.eps, math.frexp(b)[1] - 2), fin.tiny * fin.eps)


def _advantage_factor(x) -> torch.Tensor:
    """Advantages to multiply a term that is already 0 at masked slots: the finite ones as given
    (``[B, L]`` or ``[B, 1]``) on the fast path, the sanitized ones otherwise."""
    if x.finite and x.raw_advantages is not None:
        return x.raw_advantages
    if x.adv_seq is not None:
        return x.adv_seq[:, None]
    return x.advantages


def _check_weight_eps_low(v) -> None:
    finite_positive("weight_eps_low", v)
    _checks.check_in_range("weight_eps_low", v, 0.0, 1.0, inclusive=(False, True))


WEIGHT_EPS_LOW = Param("weight_eps_low", 1.0, "CISPO's lower clip of the IS weight, bound ``1 − weight_eps_low`` "
                       "(``1.0``: no lower bound, the paper's); the upper one is ``1 + eps_high``.", float,
                       _check_weight_eps_low)


def _cispo_text(o) -> str:
    lo = "0" if o.weight_eps_low >= 1 else f"{1 - o.weight_eps_low:g}"
    return ("r_it = exp(log π_θ(y_it) − log π_old(y_it))\n"
            f"x_it = − sg[clip(r_it, {lo}, {1 + o.eps_high_:g})] · A_it · log π_θ(y_it)   (clipped IS weight, MiniMax-M1)\n"
            "    every token keeps a gradient, weighted by the clipped ratio (PPO would zero the clipped ones)")


@policy_term(
    "cispo", zero_without_advantage=True, fields=("eps_high", "weight_eps_low"), ratio="old",
    detached=("old log-probs", "the clipped IS weight"), aggregation="token_mean", text=_cispo_text,
    params=(EPS_LOW, EPS_HIGH, WEIGHT_EPS_LOW),
    call=lambda o, x: cispo_loss(x.logp, x.ratio_logp, x.advantages, x.mask,
                                 eps_low=None if o.weight_eps_low >= 1 else o.weight_eps_low, eps_high=o.eps_high_,
                                 **x.agg),
)
def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: Optional[float] = None,
    eps_high: float = 0.28,
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""CISPO loss: a detached, clipped IS weight times the log-prob (MiniMax-M1).

    With :math:`r_{i,t}=\exp(\ell^\theta_{i,t}-\ell^{old}_{i,t})` and
    :math:`\hat r_{i,t}=\operatorname{clip}(r_{i,t},\,1-\epsilon_l,\,1+\epsilon_h)`:

    .. math::
        J=\frac{1}{\sum_i|o_i|}\sum_i\sum_t\mathrm{sg}[\hat r_{i,t}]\,\hat A_{i,t}\,
        \ell^\theta_{i,t},\qquad \mathcal L=-J,\qquad
        \nabla_\theta\mathcal L=-\frac{1}{\sum_i|o_i|}\sum_{i,t}\hat r_{i,t}\hat A_{i,t}
        \nabla_\theta\ell^\theta_{i,t}.

    Unlike PPO (§8), *no token loses its gradient*: a token whose ratio left the range
    keeps a gradient weighted by the boundary value instead of 0 (PPO zeroes
    :math:`A>0,\rho>1+\epsilon_h` and :math:`A<0,\rho<1-\epsilon_l`). MiniMax's motivation:
    rare "fork" tokens (*However*, *Wait*) get large ratios after one update and PPO drops
    them for the rest of the batch.

    Conventions (the paper's):

    * the weight is stop-gradient (the loss is a REINFORCE-style surrogate; its value is
      not an objective estimate);
    * **no lower bound by default** (``eps_low=None``): "we did not impose a lower bound
      on the IS weight"; only :math:`\epsilon_h` is tuned. The paper does not publish
      :math:`\epsilon_h`; the default 0.28 is DAPO's clip-higher value, a common choice;
    * token-level normalization :math:`1/\sum_i|o_i|` (``"token_mean"``).

    The clip is applied in log space, :math:`\hat r=\exp(\operatorname{clamp}(z,
    \log(1-\epsilon_l),\log(1+\epsilon_h)))`, so an overflowing ratio is never formed.

    Args:
      logp: ``[B, L]`` current log-probs (attached).
      old_logp: ``[B, L]`` log-probs of the policy the ratio is taken against (detached).
      advantages: ``[B, L]`` or ``[B]`` (detached).
      mask: ``[B, L]`` action mask.
      eps_low: lower clip :math:`\epsilon_l\in(0,1]`, or ``None`` for none (default).
      eps_high: upper clip :math:`\epsilon_h>0`.
      weights: optional ``[B, L]`` detached multiplier of the per-token term (e.g. a
        rollout correction); a weight-0 token keeps its place in the denominator.
      aggregation: default ``"token_mean"`` (the paper's).
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; metrics from :func:`trajgrad.diagnostics.policy_metrics` (ratio
      statistics, KL of old vs current) plus ``weight/clipped_high`` and
      ``weight/clipped_low`` (fractions of valid tokens whose weight was clipped) and
      ``weight/mean``.
    """
    lo_b = -math.inf if eps_low is None else _log_bound("eps_low", eps_low, "low")
    hi_b = _log_bound("eps_high", eps_high, "high")
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp",
                log_ratio_sum=True)
    w = token_weights(weights, x)
    with torch.no_grad():
        if x.zd is not None:  # the finiteness check formed z and its valid sum
            z, sum_z = x.zd, x.sums["log_ratio"]
        else:
            z, sum_z = x.log_ratio().detach(), None  # 0 at masked positions
        # one transcendental pass serves the metrics (KL k3 = mean(e^z - 1 - z), accurate near z = 0) and
        # the weight r = 1 + expm1(z), clipped as expm1(z) to [expm1(log(1 - eps_l)), expm1(log(1 + eps_h))]
        # (an overflowing ratio is clipped to the finite upper bound)
        em1 = torch.expm1(z)
        sum_em1 = em1.sum()
        extrema = _valid_extrema_floats(z, x.maskf, float(x.tokens))
        # counts of z > hi_b (none when the largest entry is below the bound, with a margin for its rounding)
        # and of z < lo_b; the metrics do not read z again (unless _rereads), so the last count may consume
        # the buffer the input check formed
        own = z is x.zd and not _rereads(z)
        high = low = 0.0
        if extrema[1] > hi_b - 1e-5 * (1.0 + abs(hi_b)):
            lower = lo_b > -math.inf  # a lower count follows: keep z
            high = _count_positive(z - hi_b if lower or not own else z.sub_(hi_b), hi_b)
        if lo_b > -math.inf and extrema[0] < lo_b + 1e-5 * (1.0 + abs(lo_b)):
            low = _count_positive(z.neg_().add_(lo_b) if own else lo_b - z, lo_b)
        # masked slots hold z = 0, expm1 = 0: clip(expm1 z) + mask is r_hat at valid slots and 0 elsewhere
        r_hat = em1.clamp_(min=math.expm1(lo_b), max=math.expm1(hi_b)).add_(x.maskf)
        r_sum = r_hat.sum()
        coef = r_hat.mul_(_advantage_factor(x))  # A * r_hat, 0 at masked slots
    loss = linear_in_logp(coef, x, aggregation, weights=w, constant=constant, denominator=denominator)
    metrics = ratio_metrics(z, x, sum_z=sum_z, sum_em1=sum_em1, extrema=extrema,
                            means={"weight/clipped_high": high, "weight/clipped_low": low, "weight/mean": r_sum})
    return LossResult(loss, metrics)


__all__ = ["cispo_loss"]
