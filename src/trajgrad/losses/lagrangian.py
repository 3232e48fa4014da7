r"""The Lagrangian policy loss of a cost-constrained objective (spec §22).

.. math::
    \mathcal L_\pi=-\big(J_R-\mathrm{sg}[\lambda]\,(J_C-d)\big),\qquad\lambda\ge0,

minimized in :math:`\theta` with the multiplier held constant; :math:`\lambda` itself moves by
projected dual ascent, :math:`\lambda\leftarrow\max(0,\lambda+\eta(\bar C-d))`
(:class:`trajgrad.losses.LagrangeMultiplier`). :math:`J_R` and :math:`J_C` are the reward and
cost surrogates of the same batch (e.g. the negated losses of one estimator on the reward and
on the cost advantages). The budget :math:`d` shifts the value by :math:`-\lambda d` and leaves
the gradient :math:`-\nabla J_R+\lambda\nabla J_C` unchanged.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .. import _checks
from ..types import LossResult
from ..control.lagrange import LagrangeMultiplier

__all__ = ["lagrangian_loss"]


def _scalar(name: str, x) -> torch.Tensor:
    x = _checks.as_tensor(name, x)
    _checks.check_floating(name, x)
    if x.ndim != 0:
        raise ValueError(f"{name}: expected a 0-D surrogate, got shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x.detach())):
        raise ValueError(f"{name}: must be finite, got {x.item()}")
    return x


def _number(name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: expected a scalar, got shape {tuple(value.shape)}")
        value = value.detach().item()
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {type(value).__name__}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name}: must be finite, got {v}")
    return v


def lagrangian_loss(
    reward_surrogate: torch.Tensor,
    cost_surrogate: torch.Tensor,
    multiplier: Union[float, torch.Tensor, LagrangeMultiplier],
    *,
    budget: Optional[float] = None,
) -> LossResult:
    r"""§22's policy loss :math:`-(J_R-\mathrm{sg}[\lambda](J_C-d))`.

    Args:
      reward_surrogate: 0-D :math:`J_R` (attached), finite.
      cost_surrogate: 0-D :math:`J_C` (attached), finite.
      multiplier: :math:`\lambda\ge0`: a number, a 1-element tensor (detached here: no gradient
        reaches it), or a :class:`LagrangeMultiplier` (its current value).
      budget: :math:`d`. Required with a numeric multiplier; with a
        :class:`LagrangeMultiplier` it defaults to the multiplier's budget (a different value
        is an error).

    Returns:
      ``LossResult``; metrics (detached): ``lagrangian/lambda``, ``lagrangian/reward_surrogate``,
      ``lagrangian/cost_surrogate``, ``lagrangian/violation`` (:math:`J_C-d`).

    Worked example: :math:`J_R=0.5`, :math:`J_C=0.3`, :math:`\lambda=2`, :math:`d=0.1`: loss
    :math:`-(0.5-2\cdot0.2)=-0.1`; :math:`\partial\mathcal L/\partial J_R=-1`,
    :math:`\partial\mathcal L/\partial J_C=2`.
    """
    jr = _scalar("reward_surrogate", reward_surrogate)
    jc = _scalar("cost_surrogate", cost_surrogate)
    if isinstance(multiplier, LagrangeMultiplier):
        lam = multiplier.value
        if budget is not None and _number("budget", budget) != multiplier.budget:
            raise ValueError(f"budget: {budget} differs from the multiplier's budget {multiplier.budget}")
        d = multiplier.budget
    else:
        lam = _number("multiplier", multiplier)
        _checks.check_positive("multiplier", lam, allow_zero=True)
        if budget is None:
            raise ValueError("budget: required with a numeric multiplier (the cost budget d)")
        d = _number("budget", budget)
    violation = jc - d
    loss = -(jr - lam * violation)
    dt = loss.dtype
    metrics = {"lagrangian/lambda": torch.tensor(lam, dtype=dt, device=loss.device),
               "lagrangian/reward_surrogate": jr.detach().to(dt), "lagrangian/cost_surrogate": jc.detach().to(dt),
               "lagrangian/violation": violation.detach().to(dt)}
    return LossResult(loss, metrics)
