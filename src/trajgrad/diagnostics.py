r"""Diagnostics that say whether an update did what its estimator assumes (spec §8, §11, §20.3).

Every function here returns *detached* tensors and never a silent NaN.

==========================  ==============================================================
``policy_metrics``          ratio / log-ratio statistics, clip fractions by advantage sign
                            and side, sampled KL estimates k1 and k3 (§8: "log ratio
                            distributions, clip fractions by advantage sign, and KL
                            separately"); the losses report the same keys, log-ratio
                            quantiles only inside ``loss_quantiles()``
``explained_variance``      :math:`1-\mathrm{Var}(R-V)/\mathrm{Var}(R)` with the
                            ill-conditioned case guarded (§20.3)
``effective_sample_size``   :math:`(\sum w)^2/\sum w^2` of importance weights, computed in
                            log space
``zero_variance_fraction``  fraction of reward groups with no relative signal (§11)
``group_stats``             per-group (per-turn) sums, minima and maxima of per-token
                            quantities (:mod:`trajgrad.turn_stats`)
``mismatch_by_turn``        sampler–learner mismatch k1 and k3 per turn (:mod:`trajgrad.turn_stats`)
==========================  ==============================================================
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from . import _checks
from .turn_stats import group_stats, mismatch_by_turn  # noqa: F401  (per-turn statistics, kept importable here)
from ._policy_stats import (  # noqa: F401  (QUANTILES, QUANTILE_POSITIONS, loss_quantiles*: public here)
    QUANTILE_POSITIONS,
    QUANTILES,
    _fast_policy_metrics,
    _log_bound,
    _metric_dtype,
    list_policy_metrics,
    loss_quantiles,
    loss_quantiles_enabled,
    resolve_eps_high,
)

def policy_metrics(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: Optional[float] = None,
    eps_high: Optional[float] = None,
) -> Dict[str, torch.Tensor]:
    r"""Statistics of an importance ratio and of its clipping, over valid tokens (§8).

    With :math:`z = \log\rho` (``log_ratio``; :math:`\rho=\pi_\theta/\mu`, tokens sampled
    from the behaviour :math:`\mu`) the sampled KL estimates are those of
    :math:`\mathrm{KL}(\mu\,\Vert\,\pi_\theta)` (Schulman, "Approximating KL divergence"):

    .. math::
        k_1 = \overline{-z}, \qquad k_3 = \overline{e^{z} - 1 - z}\ (\ge 0).

    Clip fractions (only when ``eps_low`` is given; ``eps_high`` defaults to ``eps_low``),
    each a fraction of *all* valid tokens:

    ===========================  ====================================================
    ``clip_frac/pos_high``       :math:`A>0,\ \rho>1+\epsilon_h` (PPO clips: gradient 0)
    ``clip_frac/neg_low``        :math:`A<0,\ \rho<1-\epsilon_l` (PPO clips: gradient 0)
    ``clip_frac/pos_low``        :math:`A>0,\ \rho<1-\epsilon_l` (outside, still active)
    ``clip_frac/neg_high``       :math:`A<0,\ \rho>1+\epsilon_h` (outside, still active)
    ``clip_frac``                ``pos_high + neg_low``: tokens whose gradient is cut
    ``ratio/out_of_range_frac``  :math:`\rho\notin[1-\epsilon_l,1+\epsilon_h]`, any sign
    ===========================  ====================================================

    The comparisons are made in log space (:math:`z>\log(1+\epsilon_h)`), exactly as the
    losses of :mod:`trajgrad.losses` decide them.

    Also returned: ``tokens`` (valid count), ``ratio/mean|min|max``, ``kl/k1``, ``kl/k3``
    (exact over every valid token) and ``log_ratio/q01|q50|q99`` (linear-interpolation
    quantiles). **Quantiles are exact when the tensor has at most**
    :data:`QUANTILE_POSITIONS` **(4,096) positions**; beyond that they are the quantiles of
    the valid entries among 4,096 positions drawn once with a fixed seed (the same
    positions for every call of that shape), because sorting every token costs more
    than the loss itself (about 17 ms for 160k tokens on one CPU core). With no valid
    token every statistic is the value of an unchanged policy (ratio 1, log-ratio 0,
    fractions and KL 0) and ``tokens`` is 0.

    Args:
      log_ratio: ``[B, L]`` log importance ratio (detached here).
      advantages: ``[B, L]`` or ``[B]`` advantages (detached here).
      mask: ``[B, L]`` action mask; masked entries (even NaN/inf) are ignored.
      eps_low, eps_high: clip range; ``eps_low`` in ``(0, 1]``, ``eps_high > 0``.
    Returns:
      ``dict[str, Tensor]`` of detached 0-D tensors.
    """
    log_ratio = _checks.as_tensor("log_ratio", log_ratio)
    _checks.check_ndim("log_ratio", log_ratio, 2)
    _checks.check_floating("log_ratio", log_ratio)
    mask = _checks.check_mask("mask", mask, log_ratio.shape)
    if eps_low is None and eps_high is not None:
        raise ValueError("eps_low: required when eps_high is given")
    lo_b = hi_b = None
    if eps_low is not None:
        lo_b = _log_bound("eps_low", eps_low, "low")
        hi_b = _log_bound("eps_high", resolve_eps_high(eps_low, eps_high), "high")
    with torch.no_grad():
        z = _checks.per_token("log_ratio", log_ratio.detach(), log_ratio.shape, mask)
        adv = _checks.per_token(
            "advantages", _checks.as_tensor("advantages", advantages).detach(), log_ratio.shape, mask,
            allow_per_sequence=True,
        )
        z = _metric_dtype(z)
        mf = mask.to(z.dtype)
        return _fast_policy_metrics(z, adv, mask, mf, mf.sum(), lo_b=lo_b, hi_b=hi_b, quantiles=True)


def _valid_pair(returns, values, mask):
    returns = _checks.as_tensor("returns", returns)
    _checks.check_floating("returns", returns)
    values = _checks.as_tensor("values", values)
    _checks.check_floating("values", values)
    _checks.check_shape("values", values, returns.shape, against="returns")
    if mask is None:
        m = torch.ones(returns.shape, dtype=torch.bool, device=returns.device)
    else:
        m = _checks.check_mask("mask", mask, returns.shape)
    _checks.check_finite("returns", returns, m)
    _checks.check_finite("values", values, m)
    r = _metric_dtype(returns.detach())[m]
    v = _metric_dtype(values.detach())[m]
    return r, v


def _explained_variance(returns, values, mask, eps):
    _checks.check_positive("eps", float(eps))
    with torch.no_grad():
        r, v = _valid_pair(returns, values, mask)
        if r.numel() < 2:
            return None, r.new_zeros(())
        var_r = r.var(unbiased=False)
        if bool(var_r <= eps * r.square().mean()):
            return None, r.new_zeros(())
        ev = 1.0 - (r - v).var(unbiased=False) / var_r
        return ev, ev


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask=None, *, eps: float = 1e-8) -> torch.Tensor:
    r"""Explained variance of a critic, :math:`1-\mathrm{Var}(R-V)/\mathrm{Var}(R)` (§20.3).

    1 is a perfect prediction, 0 no better than a constant, negative worse than a
    constant. Variances are population variances over the valid entries.

    **Guard.** When :math:`\mathrm{Var}(R)\le\mathrm{eps}\cdot\overline{R^2}` (returns
    constant up to rounding, including all-zero returns) or fewer than two entries are
    valid, the statistic is ill-conditioned and this function returns ``0.0`` ("no
    evidence that the critic explains anything"), never NaN. Use
    :func:`explained_variance_or_none` to tell the guarded case apart.

    Args:
      returns: ``[...]`` targets :math:`R` (detached).
      values: same shape, predictions :math:`V_\phi` (detached).
      mask: optional 0/1 mask of the same shape; masked entries may be NaN/inf.
      eps: relative variance threshold of the guard.
    Returns:
      0-D detached tensor.
    """
    return _explained_variance(returns, values, mask, eps)[1]


def explained_variance_or_none(returns, values, mask=None, *, eps: float = 1e-8) -> Optional[torch.Tensor]:
    """:func:`explained_variance`, but ``None`` where that function's guard returns 0.0."""
    return _explained_variance(returns, values, mask, eps)[0]


def effective_sample_size(
    log_weights: torch.Tensor,
    mask=None,
    *,
    normalized: bool = False,
    dim: Optional[int] = None,
) -> torch.Tensor:
    r"""Kish effective sample size of importance weights :math:`w=e^{\log w}`.

    .. math::
        \mathrm{ESS}=\frac{(\sum_k w_k)^2}{\sum_k w_k^2}
        =\exp\big(2\,\mathrm{LSE}(\log w)-\mathrm{LSE}(2\log w)\big),

    computed with log-sum-exp so that huge or tiny weights neither overflow nor underflow.
    :math:`1\le\mathrm{ESS}\le N` for :math:`N` valid weights, with :math:`N` iff all weights
    are equal. ``normalized=True`` returns :math:`\mathrm{ESS}/N\in(0,1]`.

    Args:
      log_weights: log importance weights, any shape (detached). ``-inf`` (weight 0) is
        allowed; NaN and ``+inf`` at valid entries raise.
      mask: optional 0/1 mask of the same shape (masked entries ignored).
      normalized: divide by the number of valid weights.
      dim: reduce along this dimension only (e.g. ``-1`` for one ESS per sequence);
        ``None`` reduces over every valid entry.
    Returns:
      Detached tensor (0-D, or the shape with ``dim`` removed). Where no weight is valid or
      all valid weights are 0, the result is 0.
    """
    lw = _checks.as_tensor("log_weights", log_weights)
    _checks.check_floating("log_weights", lw)
    if mask is None:
        m = torch.ones(lw.shape, dtype=torch.bool, device=lw.device)
    else:
        m = _checks.check_mask("mask", mask, lw.shape)
    if _checks.values_checked():
        bad = m & (torch.isnan(lw) | (lw == math.inf))
        if bool(bad.any()):
            raise ValueError("log_weights: contains NaN or +inf at a valid position")
    with torch.no_grad():
        lw = _metric_dtype(lw.detach())
        lw = torch.where(m, lw, torch.full_like(lw, -math.inf))
        if dim is None:
            lw = lw.reshape(-1)
            m = m.reshape(-1)
            dim = 0
        lse1 = torch.logsumexp(lw, dim=dim)
        lse2 = torch.logsumexp(2 * lw, dim=dim)
        empty = torch.isneginf(lse1)
        log_ess = torch.where(empty, torch.zeros_like(lse1), 2 * lse1 - lse2)
        ess = torch.where(empty, torch.zeros_like(lse1), log_ess.exp())
        if normalized:
            n = m.sum(dim=dim).to(ess.dtype)
            ess = torch.where(n > 0, ess / n.clamp_min(1), torch.zeros_like(ess))
        return ess


def zero_variance_fraction(rewards: torch.Tensor) -> torch.Tensor:
    r"""Fraction of groups whose rewards are all equal (zero standard deviation, §11).

    Such a group gives every member a zero centered advantage: it carries no relative
    signal and only costs generation (dynamic sampling resamples it).

    Args:
      rewards: ``[N, G]`` rewards, one row per prompt group (``G >= 1``); must be finite.
    Returns:
      0-D detached tensor in ``[0, 1]``.
    """
    rewards = _checks.as_tensor("rewards", rewards)
    _checks.check_ndim("rewards", rewards, 2)
    _checks.check_floating("rewards", rewards)
    if rewards.shape[0] == 0 or rewards.shape[1] == 0:
        raise ValueError(f"rewards: empty group or batch, got shape {tuple(rewards.shape)}")
    _checks.check_finite("rewards", rewards)
    with torch.no_grad():
        r = rewards.detach()
        flat = r.amax(-1) == r.amin(-1)
        return flat.to(_metric_dtype(r).dtype).mean()


__all__ = [
    "policy_metrics",
    "loss_quantiles",
    "explained_variance",
    "explained_variance_or_none",
    "effective_sample_size",
    "zero_variance_fraction",
]
