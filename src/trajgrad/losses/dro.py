r"""DRO's policy term: the policy gradient with a quadratic log-ratio penalty (spec §7, §9).

Richemond et al. 2024, "Offline Regularised Reinforcement Learning for Large Language Models
Alignment" (DRO, arXiv:2405.19107), in the on-policy form verl 0.9.1 calls ``dro``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks
from ..registry import policy_term
from ..types import LossResult
from .dpo import BETA
from ._common import aggregate_tokens, prepare, ratio_metrics, token_weights, weighted


@policy_term(
    "dro", fields=("beta",), ratio="old", detached=("old log-probs",), aggregation="token_mean", params=(BETA,),
    text=lambda o: ("z_it = log π_θ(y_it) − sg[log π_old(y_it)]\n"
                    f"x_it = − A_it · log π_θ(y_it) + ({o.beta:g}/2) · z_it²   (quadratic log-ratio penalty, DRO)\n"
                    f"    gradient ({o.beta:g} z_it − A_it) ∇log π_θ: REINFORCE at z = 0, pulled back to π_old beyond"),
    call=lambda o, x: dro_loss(x.logp, x.ratio_logp, x.advantages, x.mask, beta=o.beta, **x.agg),
)
def dro_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.1,
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""DRO policy loss: :math:`-A\,\ell^\theta` plus :math:`\frac\beta2` times the squared log ratio.

    With :math:`z_{i,t}=\ell^\theta_{i,t}-\mathrm{sg}[\ell^{old}_{i,t}]`:

    .. math::
        \mathcal L=\operatorname{agg}_{i,t}\Big[-\hat A_{i,t}\,\ell^\theta_{i,t}
        +\tfrac{\beta}{2}z_{i,t}^2\Big],\qquad
        \nabla_\theta\mathcal L=\operatorname{agg}_{i,t}\big[(\beta z_{i,t}-\hat A_{i,t})
        \nabla_\theta\ell^\theta_{i,t}\big].

    DRO fits :math:`\frac12(R-V(x)-\beta\log\frac{\pi_\theta}{\pi_{ref}})^2`; its gradient in
    :math:`\theta` is :math:`\beta(\beta z-(R-V))\nabla\ell^\theta` with :math:`z` the log
    ratio to the reference. This term is that gradient divided by :math:`\beta`, with the
    advantage :math:`\hat A` in place of :math:`R-V` and the policy of the batch
    :math:`\pi_{old}` in place of :math:`\pi_{ref}` (verl's ``dro``): the penalty pulls
    :math:`\pi_\theta` back to :math:`\pi_{old}` with a force growing linearly in :math:`z`,
    a soft trust region in place of PPO's clip (§8). At :math:`z=0` the gradient is
    REINFORCE's (§2).

    Args:
      logp: ``[B, L]`` current log-probs (attached).
      old_logp: ``[B, L]`` log-probs of the policy that sampled the batch (detached).
      advantages: ``[B, L]`` or ``[B]`` (detached).
      mask: ``[B, L]`` action mask.
      beta: :math:`\beta>0`, the penalty strength (verl's ``policy_loss.dro_beta``, no default there).
      weights: optional ``[B, L]`` detached multiplier of the per-token term.
      aggregation: default ``"token_mean"``.
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; :func:`trajgrad.diagnostics.policy_metrics` (ratio statistics) plus
      ``dro/penalty`` (valid-token mean of :math:`\frac\beta2z^2`).
    """
    b = float(beta)
    _checks.check_positive("beta", b)
    if not math.isfinite(b):
        raise ValueError(f"beta: must be finite, got {beta}")
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    z = x.log_ratio()
    penalty = 0.5 * b * z.square()
    term = penalty - x.advantages * x.logp_factor
    loss = aggregate_tokens(weighted(term, token_weights(weights, x)), x, aggregation, constant=constant,
                            denominator=denominator)
    metrics = ratio_metrics(z.detach(), x)
    with torch.no_grad():
        metrics["dro/penalty"] = (penalty.detach() * x.maskf).sum().to(metrics["tokens"].dtype) / metrics["tokens"].clamp_min(1)
    return LossResult(loss, metrics)


__all__ = ["dro_loss"]
