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
from .._policy_stats import _log_bound, _rereads, _valid_extrema_floats
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


def _unified_mask(z: torch.Tensor, adv: torch.Tensor, lo_b: Optional[float], hi_b: Optional[float]):
    """``(high, low)`` bool ``[B, L]``: the tokens the unified mask drops on each side (``None`` when off).

    ``z`` is 0 at masked slots and both bounds are nonzero there, so no masked slot is dropped."""
    if lo_b is None and hi_b is None:
        return None
    none = torch.zeros_like(z, dtype=torch.bool)
    high = (adv > 0) & (z > hi_b) if hi_b is not None else none
    low = (adv < 0) & (z < lo_b) if lo_b is not None else none
    return high.expand_as(z), low.expand_as(z)


def _check_mask_eps(name: str, side: str):
    def check(v) -> None:
        if v is not None:
            finite_positive(name, v)
            if side == "low":
                _checks.check_in_range(name, v, 0.0, 1.0, inclusive=(False, True))
    return check


_MASK_DOC = ("CISPO's unified PPO mask (MiniMax-M1 §3.1): a token with A > 0 and r > 1 + ``mask_eps_high``, or with "
             "A < 0 and r < 1 − ``mask_eps_low`` (strict), has a zero term and a zero gradient and stays in the "
             "denominator; ``None`` turns that side off (default: both off, plain CISPO).")
MASK_EPS_LOW = Param("mask_eps_low", None, _MASK_DOC, Optional[float], _check_mask_eps("mask_eps_low", "low"))
MASK_EPS_HIGH = Param("mask_eps_high", None, _MASK_DOC, Optional[float], _check_mask_eps("mask_eps_high", "high"))


def _mask_text(o) -> str:
    sides = ([f"(A_it > 0 and r_it > {1 + o.mask_eps_high:g})"] if o.mask_eps_high is not None else []) + \
            ([f"(A_it < 0 and r_it < {1 - o.mask_eps_low:g})"] if o.mask_eps_low is not None else [])
    return (f"\n    M_it = 0 if {' or '.join(sides)}, else 1   (unified PPO mask, strict, MiniMax-M1 §3.1)\n"
            "    x_it ← M_it · x_it: a masked token has no term and no gradient and stays in the denominator")


def _cispo_text(o) -> str:
    lo = "0" if o.weight_eps_low >= 1 else f"{1 - o.weight_eps_low:g}"
    masked = o.mask_eps_low is not None or o.mask_eps_high is not None
    return ("r_it = exp(log π_θ(y_it) − log π_old(y_it))\n"
            f"x_it = − sg[clip(r_it, {lo}, {1 + o.eps_high_:g})] · A_it · log π_θ(y_it)   (clipped IS weight, MiniMax-M1)\n"
            "    every token keeps a gradient, weighted by the clipped ratio (PPO would zero the clipped ones)"
            + (_mask_text(o) if masked else ""))


@policy_term(
    "cispo", zero_without_advantage=True, fields=("eps_high", "weight_eps_low", "mask_eps_low", "mask_eps_high"),
    ratio="old", detached=lambda o: ("old log-probs", "the clipped IS weight") + (
        ("the mask",) if o.mask_eps_low is not None or o.mask_eps_high is not None else ()),
    aggregation="token_mean", text=_cispo_text, params=(EPS_LOW, EPS_HIGH, WEIGHT_EPS_LOW, MASK_EPS_LOW, MASK_EPS_HIGH),
    call=lambda o, x: cispo_loss(x.logp, x.ratio_logp, x.advantages, x.mask,
                                 eps_low=None if o.weight_eps_low >= 1 else o.weight_eps_low, eps_high=o.eps_high_,
                                 mask_eps_low=o.mask_eps_low, mask_eps_high=o.mask_eps_high, **x.agg),
)
def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: Optional[float] = None,
    eps_high: float = 0.28,
    mask_eps_low: Optional[float] = None,
    mask_eps_high: Optional[float] = None,
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

    **Unified PPO mask** (MiniMax-M1 §3.1, off by default): with ``mask_eps_high`` /
    ``mask_eps_low`` (:math:`\delta_h`, :math:`\delta_l`, separate from the weight's clip) each
    term is multiplied by

    .. math::
        M_{i,t}=\begin{cases}0 & \hat A_{i,t}>0,\ r_{i,t}>1+\delta_h\\
        0 & \hat A_{i,t}<0,\ r_{i,t}<1-\delta_l\\ 1 & \text{otherwise,}\end{cases}
        \qquad J=\frac{1}{\sum_i|o_i|}\sum_{i,t}\mathrm{sg}[\hat r_{i,t}]\hat A_{i,t}
        \ell^\theta_{i,t}M_{i,t},

    which drops exactly the tokens PPO's clipped objective gives no gradient (the paper's
    general formulation: CISPO's weight with PPO's trust region). The inequalities are strict
    (a ratio on the boundary keeps its token) and compared in log space,
    :math:`z>\log(1+\delta_h)`, :math:`z<\log(1-\delta_l)`. A masked token keeps its
    place in the denominator :math:`\sum_i|o_i|`. ``None`` turns a side off.

    Worked example (one response, ``token_mean``, :math:`\epsilon_h=0.28`, no lower weight
    clip, :math:`\delta_l=\delta_h=0.2`), :math:`A=(1,1,-1,-1)`, :math:`r=(1.5,1.1,0.5,0.9)`,
    :math:`\ell^\theta=(-1,-1,-1,-1)`: :math:`\hat r=(1.28,1.1,0.5,0.9)`,
    :math:`M=(0,1,0,1)` (1.5 > 1.2 with A > 0; 0.5 < 0.8 with A < 0), so
    :math:`\mathcal L=-\frac14(1.1\cdot1\cdot(-1)+0.9\cdot(-1)\cdot(-1))=0.05` and
    :math:`\partial\mathcal L/\partial\ell^\theta=(0,-0.275,0,0.225)`; without the mask
    :math:`\mathcal L=-\frac14(-1.28-1.1+0.5+0.9)=0.245`, gradient
    :math:`(-0.32,-0.275,0.125,0.225)`.

    Args:
      logp: ``[B, L]`` current log-probs (attached).
      old_logp: ``[B, L]`` log-probs of the policy the ratio is taken against (detached).
      advantages: ``[B, L]`` or ``[B]`` (detached).
      mask: ``[B, L]`` action mask.
      eps_low: lower clip :math:`\epsilon_l\in(0,1]`, or ``None`` for none (default).
      eps_high: upper clip :math:`\epsilon_h>0`.
      mask_eps_low, mask_eps_high: the unified mask's :math:`\delta_l\in(0,1]`,
        :math:`\delta_h>0`, or ``None`` (default) for that side off.
      weights: optional ``[B, L]`` detached multiplier of the per-token term (e.g. a
        rollout correction); a weight-0 token keeps its place in the denominator.
      aggregation: default ``"token_mean"`` (the paper's).
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; metrics from :func:`trajgrad.diagnostics.policy_metrics` (ratio
      statistics, KL of old vs current) plus ``weight/clipped_high`` and
      ``weight/clipped_low`` (fractions of valid tokens whose weight was clipped) and
      ``weight/mean``; with the mask, ``mask/dropped_high`` and ``mask/dropped_low`` (fractions
      of valid tokens dropped on each side).
    """
    lo_b = -math.inf if eps_low is None else _log_bound("eps_low", eps_low, "low")
    hi_b = _log_bound("eps_high", eps_high, "high")
    m_lo = None if mask_eps_low is None else _log_bound("mask_eps_low", mask_eps_low, "low")
    m_hi = None if mask_eps_high is None else _log_bound("mask_eps_high", mask_eps_high, "high")
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
        drop = _unified_mask(z, _advantage_factor(x), m_lo, m_hi)  # before the counts below consume z
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
        means = {"weight/clipped_high": high, "weight/clipped_low": low, "weight/mean": r_sum}
        if drop is not None:  # M = 0: no term, no gradient; the token stays in the denominator
            coef.masked_fill_(drop[0] | drop[1], 0.0)
            means.update({"mask/dropped_high": drop[0].sum(), "mask/dropped_low": drop[1].sum()})
    loss = linear_in_logp(coef, x, aggregation, weights=w, constant=constant, denominator=denominator)
    metrics = ratio_metrics(z, x, sum_z=sum_z, sum_em1=sum_em1, extrema=extrema, means=means)
    return LossResult(loss, metrics)


__all__ = ["cispo_loss"]
