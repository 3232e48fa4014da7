r"""The clip range shared by the ratio-clipping terms (PPO, GSPO, SAO, Clip-Cov, CISPO): its two
fields, as ``Objective`` declares them, and the clipped surrogate (spec §8).

``eps_high``'s "``None`` means ``eps_low``" is resolved in one place,
:func:`trajgrad.losses.resolve_eps_high` (``Objective.eps_high_``, :func:`_clip_bounds` and
:func:`trajgrad.diagnostics.policy_metrics` call it).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .._policy_stats import _log_bound, resolve_eps_high
from ..registry import Param, finite_positive

_EPS_DOC = ("clip range of the ratio (PPO/GRPO/DAPO/GSPO) or the trust interval (SAO); ``eps_high`` ``None`` "
            "means ``eps_low``. ``eps_low`` lies in (0, 1).")


def _check_eps_high(v) -> None:
    if v is not None:
        finite_positive("eps_high", v)


EPS_LOW = Param("eps_low", 0.2, _EPS_DOC, float, lambda v: finite_positive("eps_low", v))
EPS_HIGH = Param("eps_high", None, _EPS_DOC, Optional[float], _check_eps_high)


def check_eps_low_below_one(o) -> None:
    """A term whose lower bound is ``1 − eps_low`` needs ``eps_low < 1``."""
    if not o.eps_low < 1:
        raise ValueError(f"eps_low: must lie in (0, 1) (the lower bound 1 − eps_low must be positive), got {o.eps_low}")


def _clip_bounds(eps_low: float, eps_high: Optional[float]) -> Tuple[float, float, float, float]:
    """Validate the clip range; return ``(eps_low, eps_high, log(1-eps_low), log(1+eps_high))``."""
    eps_high = resolve_eps_high(eps_low, eps_high)
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


