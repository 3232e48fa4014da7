r"""REINFORCE: the likelihood-ratio policy gradient as a loss (spec §2, §4, §5).

Also holds the input preparation shared by every policy loss in this package: validate,
detach the evidence, and zero the masked slots *before* any nonlinear operation.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _checks
from ..aggregate import MODES, aggregate
from ..types import LossResult


class _Inputs(NamedTuple):
    logp: torch.Tensor  # [B, L] attached, 0 at masked positions
    mask: torch.Tensor  # [B, L] bool
    advantages: torch.Tensor  # [B, L] detached, 0 at masked positions
    behaviour: Optional[torch.Tensor]  # [B, L] detached, 0 at masked positions


def _prepare(
    logp,
    mask,
    advantages,
    *,
    aggregation: str,
    behaviour=None,
    behaviour_name: Optional[str] = None,
) -> _Inputs:
    """Validate and sanitize the inputs of a policy loss (see module docstring)."""
    _checks.check_choice("aggregation", aggregation, MODES)
    logp = _checks.as_tensor("logp", logp)
    _checks.check_ndim("logp", logp, 2)
    _checks.check_floating("logp", logp)
    mask = _checks.check_mask("mask", mask, logp.shape)
    shape = tuple(logp.shape)
    logp = _checks.per_token("logp", logp, shape, mask)
    adv = _checks.as_tensor("advantages", advantages).detach()
    _checks.check_ndim("advantages", adv, (1, 2))
    adv = _checks.per_token("advantages", adv, shape, mask, allow_per_sequence=True)
    beh = None
    if behaviour_name is not None:
        if behaviour is None:
            raise ValueError(f"{behaviour_name}: required, got None")
        beh = _checks.as_tensor(behaviour_name, behaviour).detach()
        beh = _checks.per_token(behaviour_name, beh, shape, mask)
    return _Inputs(logp, mask, adv, beh)


def _token_count(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return mask.sum().to(dtype)


def reinforce_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""REINFORCE / vanilla policy-gradient loss (Williams, 1992; spec §2, §4).

    .. math::
        \mathcal L(\theta) = \operatorname{agg}_{i,t}\big[-\hat A_{i,t}\,
        \ell^\theta_{i,t}\big],\qquad
        \nabla_\theta\mathcal L = -\operatorname{agg}_{i,t}\big[\hat A_{i,t}\,
        \nabla_\theta\ell^\theta_{i,t}\big],

    where :math:`\ell^\theta_{i,t}=\log\pi_\theta(x_{i,t}\mid h_{i,t})` is the log-prob
    of the sampled action token and :math:`\hat A` is any advantage (return, reward-to-go,
    baselined return, GAE, group-relative, ...). The estimator is unbiased for
    :math:`\nabla J` only on-policy (tokens sampled by :math:`\pi_\theta` itself); use a
    ratio loss (:func:`~trajgrad.losses.ppo_clip_loss`) for stale samples.

    The loss *value* is not an estimate of anything; only its gradient is meaningful.

    Args:
      logp: ``[B, L]`` log-probs of the target tokens under the trained policy (attached).
      advantages: ``[B, L]`` per token or ``[B]`` per sequence (broadcast); detached here.
      mask: ``[B, L]`` 0/1, 1 = action token sampled by the policy (§4).
      aggregation: see :mod:`trajgrad.aggregate`. Default ``"token_mean"``: the §4 code
        (``sum / action_mask.sum()``), every action token weighs the same.
      constant: :math:`C` for ``"seq_sum_constant"``.
      denominator: global count replacing the local one (micro-batches / ranks, §13).

    Returns:
      ``LossResult(loss, metrics)``; metrics ``tokens``, ``advantage/mean``,
      ``logp/mean`` (valid-token means, detached).
    """
    x = _prepare(logp, mask, advantages, aggregation=aggregation)
    term = -x.advantages * x.logp
    loss = aggregate(term, x.mask, aggregation, constant=constant, denominator=denominator)
    with torch.no_grad():
        n = _token_count(x.mask, x.logp.dtype)
        d = n.clamp_min(1)
        metrics = {
            "tokens": n,
            "advantage/mean": x.advantages.sum() / d,
            "logp/mean": x.logp.detach().sum() / d,
        }
    return LossResult(loss, metrics)


__all__ = ["reinforce_loss"]
