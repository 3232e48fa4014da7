r"""REINFORCE: the likelihood-ratio policy gradient as a loss (spec §2, §4, §5).

Input preparation shared by every policy loss (validate, detach the evidence, zero the
masked slots *before* any nonlinear operation) lives in :mod:`._common`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..types import LossResult
from ..registry import policy_term
from ._common import linear_in_logp, prepare, token_weights


class _Inputs(NamedTuple):
    logp: torch.Tensor  # [B, L] attached, 0 at masked positions
    mask: torch.Tensor  # [B, L] bool
    advantages: torch.Tensor  # [B, L] detached, 0 at masked positions
    behaviour: Optional[torch.Tensor]  # [B, L] detached, 0 at masked positions


def _prepare(logp, mask, advantages, *, aggregation: str, behaviour=None, behaviour_name: Optional[str] = None):
    """Validated inputs with every tensor zeroed at masked slots (kept for modules that use it;
    the losses here use :func:`._common.prepare`, which forms these only on demand)."""
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=behaviour, behaviour_name=behaviour_name)
    return _Inputs(x.logp, x.mask, x.advantages, x.behaviour)


@policy_term(
    "reinforce", zero_without_advantage=True, fields=(), ratio="none", detached=(), aggregation="seq_mean_token_sum",
    text=lambda o: "x_it = − A_i · log π_θ(y_it)          (score function, §2/§4; no ratio, on-policy)",
    call=lambda o, x: reinforce_loss(x.logp, x.advantages, x.mask, **x.agg),
)
def reinforce_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    weights: Optional[torch.Tensor] = None,
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
      weights: optional ``[B, L]`` detached multiplier of the per-token term before
        aggregation (e.g. :attr:`trajgrad.logprobs.correction.Correction.weight`); a weight-0 token
        leaves the numerator and keeps its place in the denominator.
      aggregation: see :mod:`trajgrad.aggregate`. Default ``"token_mean"``: the §4 code
        (``sum / action_mask.sum()``), every action token weighs the same.
      constant: :math:`C` for ``"seq_sum_constant"``.
      denominator: global count replacing the local one (micro-batches / ranks, §13).

    Returns:
      ``LossResult(loss, metrics)``; metrics ``tokens``, ``advantage/mean``,
      ``logp/mean`` (valid-token means, detached).
    """
    x = prepare(logp, mask, advantages, aggregation=aggregation, valid_sums=True)
    w = token_weights(weights, x)
    coef = x.advantages if w is None else x.advantages * w  # detached, 0 at masked slots
    loss = linear_in_logp(coef, x, aggregation, constant=constant, denominator=denominator)
    with torch.no_grad():
        n = x.tokens
        d = n.clamp_min(1)
        # the valid sums the finiteness check already formed (sums of the sanitized tensors otherwise)
        metrics = {
            "tokens": n,
            "advantage/mean": x.valid_total("advantages") / d,
            "logp/mean": x.valid_total("logp") / d,
        }
    return LossResult(loss, metrics)


__all__ = ["reinforce_loss"]
