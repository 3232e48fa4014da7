r"""CISPO: clip the importance-sampling *weight*, keep every token's gradient (spec §7, §8).

MiniMax, 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
Attention" (arXiv:2506.13585), §3.1.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ..diagnostics import _log_bound
from ..types import LossResult
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
    metrics = ratio_metrics(z, x, em1=em1, sum_z=sum_z)  # reads em1 before it is clipped in place
    with torch.no_grad():
        em1c = em1.clamp_(min=math.expm1(lo_b), max=math.expm1(hi_b))
        # masked slots hold z = 0, expm1 = 0: the valid sum of r_hat is the sum plus the valid count
        r_sum = em1c.sum() + x.tokens
        adv = x.advantages  # 0 at masked slots
        coef = torch.addcmul(adv, em1c, adv)  # A * (1 + clip(expm1 z)) = A * r_hat
    loss = linear_in_logp(coef, x, aggregation, weights=w, constant=constant, denominator=denominator)
    with torch.no_grad():
        dt = metrics["tokens"].dtype
        n = metrics["tokens"].clamp_min(1)
        zero = torch.zeros((), dtype=dt, device=z.device)
        # count of z > hi_b; none when the largest ratio is below the bound (with a margin for its rounding)
        none_high = bool(metrics["ratio/max"] < math.exp(hi_b) * (1 - 1e-5))
        metrics["weight/clipped_high"] = zero if none_high else _count_positive(z - hi_b, hi_b).to(dt) / n
        metrics["weight/clipped_low"] = _count_positive(lo_b - z, lo_b).to(dt) / n if lo_b > -math.inf else zero
        metrics["weight/mean"] = r_sum.to(dt) / n
    return LossResult(loss, metrics)


__all__ = ["cispo_loss"]
