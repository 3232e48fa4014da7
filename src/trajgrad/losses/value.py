r"""Critic regression loss, optionally PPO-style value clipping (spec §6, §19, §20.3)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks
from ..aggregate import MODES, aggregate
from ..diagnostics import explained_variance
from ..types import LossResult


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_values: Optional[torch.Tensor] = None,
    clip_range: Optional[float] = None,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""Squared-error value loss :math:`\tfrac12(V_\phi-R)^2`, per token.

    .. math::
        \mathcal L=\operatorname{agg}_{i,t}\,\tfrac12\big(V_{i,t}-R_{i,t}\big)^2,
        \qquad \nabla_{V_{i,t}}=\tfrac1D(V_{i,t}-R_{i,t})\ \text{(token mean)}.

    With ``clip_range`` :math:`c` (PPO's value clipping, as in common PPO
    implementations) the per-token term is the *larger* of the unclipped and clipped
    errors,

    .. math::
        V^{clip}=\begin{cases}V^{old}+c & V-V^{old}>c\\ V^{old}-c & V-V^{old}<-c\\
        V & \text{otherwise}\end{cases},\qquad
        \tfrac12\max\big((V-R)^2,(V^{clip}-R)^2\big),

    so the critic cannot profit from moving farther than :math:`c` from its rollout-time
    prediction (where the clipped error is the larger, the gradient is 0). :math:`V^{clip}`
    is *selected* (``torch.where``), not rebuilt as :math:`V^{old}+\operatorname{clip}(V-V^{old})`:
    inside the range it is exactly :math:`V`, so ``value/clip_frac`` counts only tokens that
    are really clipped (the rebuilt form rounds, and counted up to a third more tokens in
    float32). This is the same value as verl's ``clip_by_value(V, V^{old}-c, V^{old}+c)``.

    ``returns`` are the regression targets (Monte Carlo returns, :math:`\lambda`-returns,
    or GAE advantages plus old values; for SAO the token-wise targets of §20.4), detached
    here, as are ``old_values``.

    Args:
      values: ``[B, L]`` predictions :math:`V_\phi` (attached).
      returns: ``[B, L]`` targets (detached here).
      mask: ``[B, L]`` positions that carry a value loss (action tokens, §20.4).
      old_values: ``[B, L]`` predictions at rollout time (detached here); required with
        ``clip_range``, otherwise unused.
      clip_range: :math:`c>0`, or ``None`` for no clipping.
      aggregation: default ``"token_mean"`` (token-wise value training, as SAO).
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; metrics ``value/explained_variance``
      (:func:`trajgrad.diagnostics.explained_variance`, 0.0 when ill-conditioned),
      ``value/clip_frac`` (valid tokens where the clipped error is strictly larger),
      ``value/mse``, ``value/mean``, ``returns/mean``, ``tokens``.
    """
    _checks.check_choice("aggregation", aggregation, MODES)
    values = _checks.as_tensor("values", values)
    _checks.check_ndim("values", values, 2)
    _checks.check_floating("values", values)
    mask = _checks.check_mask("mask", mask, values.shape)
    shape = tuple(values.shape)
    v = _checks.per_token("values", values, shape, mask)
    r = _checks.per_token("returns", _checks.as_tensor("returns", returns).detach(), shape, mask)
    err = v - r
    term = 0.5 * err.square()
    clipped_more = torch.zeros(shape, dtype=torch.bool, device=v.device)
    if clip_range is not None:
        c = float(clip_range)
        _checks.check_positive("clip_range", c)
        if not math.isfinite(c):
            raise ValueError(f"clip_range: must be finite, got {clip_range}")
        if old_values is None:
            raise ValueError("old_values: required when clip_range is given")
        vo = _checks.per_token("old_values", _checks.as_tensor("old_values", old_values).detach(), shape, mask)
        # Select, do not rebuild: inside the range V^clip is V itself (bit for bit), so the
        # clipped error equals the unclipped one there and no in-range token counts as clipped.
        # (vo + clamp(v - vo, -c, c) rounds to a value that differs from v in the last bit.)
        delta = (v - vo).detach()
        above, below = delta > c, delta < -c
        v_clip = torch.where(above, vo + c, torch.where(below, vo - c, v))
        term_clip = 0.5 * (v_clip - r).square()
        clipped_more = (term_clip.detach() > term.detach()) & mask
        term = torch.maximum(term, term_clip)
    elif old_values is not None:
        _checks.per_token("old_values", _checks.as_tensor("old_values", old_values), shape, mask)
    loss = aggregate(term, mask, aggregation, constant=constant, denominator=denominator)
    with torch.no_grad():
        dt = v.dtype
        n = mask.sum().to(dt)
        d = n.clamp_min(1)
        metrics = {
            "tokens": n,
            "value/explained_variance": explained_variance(r, v.detach(), mask).to(dt),
            "value/clip_frac": clipped_more.sum().to(dt) / d,
            "value/mse": (err.detach().square().sum() / d),
            "value/mean": v.detach().sum() / d,
            "returns/mean": r.sum() / d,
        }
    return LossResult(loss, metrics)


__all__ = ["value_loss"]
