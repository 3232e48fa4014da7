r"""The sampled-token KL approximation of on-policy distillation (§14): a different objective."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _checks
from ..aggregate import MODES, aggregate
from ..types import LossResult
from ._distill_inputs import Number

__all__ = ["sampled_token_kl"]


def sampled_token_kl(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator: Optional[Number] = None,
) -> LossResult:
    r"""Sampled-token approximation :math:`k_1 = \log\pi_\theta(y_t|h_t) - \log\pi_E(y_t|h_t)` (§14).

    .. math::

       k_{1,t} = \log\pi_\theta(y_t\mid h_t) - \mathrm{sg}[\log\pi_E(y_t\mid h_t)],
       \qquad y_t\sim\pi_\theta(\cdot\mid h_t),\qquad
       \mathcal L = \mathrm{aggregate}(k_1, \text{mask})

    **This is a different objective from the exact reverse KL** (§14: "This is not the
    sampled-token approximation"). It uses only the sampled token: a single-sample (k1)
    Monte Carlo estimate of the *value* :math:`\mathrm{KL}(\pi_\theta\Vert\pi_E)`,
    unbiased when :math:`y_t\sim\pi_\theta`, with variance the exact computation does not
    have. Its *gradient as a loss* is not the reverse-KL gradient: differentiating through
    the log-probability gives :math:`\nabla\log\pi_\theta(y_t)`, whose expectation under
    :math:`y_t\sim\pi_\theta` is zero (the score-function identity), whereas
    :math:`\nabla\mathrm{KL}=\mathbb E_{y\sim\pi_\theta}[\nabla\log\pi_\theta(y)\,(\log\pi_\theta(y)-\log\pi_E(y))]`
    (the sampling distribution depends on :math:`\theta`). The on-policy distillation
    *reward* form uses :math:`A_t=-\mathrm{sg}[k_{1,t}]` as a per-token advantage in a
    policy-gradient loss :math:`-A_t\log\pi_\theta(y_t)`; that estimator's expectation
    *is* the reverse-KL gradient (of one token position, with the future-prefix terms
    dropped). Use :func:`reverse_kl_distill_loss` for the exact objective.

    Args:
      student_logp: ``[B, L]`` log-probs of the sampled tokens under the student (attached).
      teacher_logp: ``[B, L]`` teacher log-probs of the same tokens (detached here).
      mask: ``[B, L]`` 0/1 action mask.
      aggregation, constant, denominator: see :func:`trajgrad.aggregate.aggregate`;
        default ``token_mean`` as for the exact loss.

    Returns:
      ``LossResult(loss, metrics)``; metrics: ``sampled_kl`` (mean :math:`k_1` per valid
      token), ``token_count``.
    """
    student_logp = _checks.as_tensor("student_logp", student_logp)
    _checks.check_ndim("student_logp", student_logp, 2)
    _checks.check_floating("student_logp", student_logp)
    mask = _checks.check_mask("mask", mask, student_logp.shape)
    _checks.check_choice("aggregation", aggregation, MODES)
    logp = _checks.per_token("student_logp", student_logp, student_logp.shape, mask)
    teacher = _checks.per_token("teacher_logp", _checks.as_tensor("teacher_logp", teacher_logp).detach(),
                                student_logp.shape, mask)
    k1 = _checks.fill_masked(logp - teacher, mask)
    loss = aggregate(k1, mask, aggregation, constant=constant, denominator=denominator)
    count = mask.sum()
    metrics = {
        "sampled_kl": (k1.detach().sum() / count.clamp_min(1)).to(k1.dtype),
        "token_count": count.to(k1.dtype),
    }
    return LossResult(loss, metrics)

