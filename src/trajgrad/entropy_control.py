r"""Adaptive entropy control: the entropy bonus's coefficient steered toward a target entropy.

.. math::
    c_{t+1} = \operatorname{clip}\big(c_t + \eta\,(\mathcal H^\star - \bar{\mathcal H}_t),\; 0,\; c_{\max}\big)

:math:`\bar{\mathcal H}_t` is the token mean of the sampling distribution's entropy over step
:math:`t`'s action tokens (nats per token), measured before the step; :math:`\mathcal H^\star`
the target. Below the target the bonus :math:`-c\,\operatorname{agg}(\mathcal H)` grows, above
it shrinks, never below 0. This is the adaptive entropy control of Skywork-OR1 (He et al. 2025,
"Skywork Open Reasoner 1 Technical Report", arXiv:2505.22312), with a step proportional to the
gap as in SAC's temperature update (Haarnoja et al. 2018). The coefficient is a state of the
run, not a parameter: it is not differentiated (:meth:`trajgrad.objective.Objective.next_entropy_coef`,
:mod:`trajgrad.train.updates`).
"""
from __future__ import annotations

import math


def next_entropy_coef(coef: float, entropy: float, *, target: float, lr: float, coef_max: float) -> float:
    r"""``clip(coef + lr · (target − entropy), 0, coef_max)`` (see the module docstring).

    Args:
      coef: :math:`c_t \ge 0`, the coefficient of the step just taken.
      entropy: :math:`\bar{\mathcal H}_t`, finite, ``>= 0`` (nats per token).
      target, lr, coef_max: :math:`\mathcal H^\star`, :math:`\eta > 0`, :math:`c_{\max} > 0`.
    """
    for name, v in (("coef", coef), ("entropy", entropy), ("target", target), ("lr", lr), ("coef_max", coef_max)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")
    for name, v in (("lr", lr), ("coef_max", coef_max)):
        if not v > 0:
            raise ValueError(f"{name}: must be > 0, got {v!r}")
    return float(min(max(coef + lr * (target - float(entropy)), 0.0), coef_max))


__all__ = ["next_entropy_coef"]
