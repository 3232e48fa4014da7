r"""The Lagrangian policy loss of a cost-constrained objective (spec §22).

.. math::
    \mathcal L_\pi=-\big(J_R-\mathrm{sg}[\lambda]\,(J_C-d)\big),\qquad\lambda\ge0,

minimized in :math:`\theta` with the multiplier held constant; :math:`\lambda` itself moves by
projected dual ascent, :math:`\lambda\leftarrow\max(0,\lambda+\eta(\bar C-d))`
(:class:`trajgrad.losses.LagrangeMultiplier`). :math:`J_R` and :math:`J_C` are the reward and
cost surrogates of the same batch (e.g. the negated losses of one estimator on the reward and
on the cost advantages). The budget :math:`d` shifts the value by :math:`-\lambda d` and leaves
the gradient :math:`-\nabla J_R+\lambda\nabla J_C` unchanged.

:func:`lagrangian_loss` takes the two surrogates; :func:`lagrangian_policy_loss` forms them from
token log-probs and is the ``lagrangian`` policy term of a recipe (``recipe.overrides.loss:
lagrangian``): :math:`\lambda` is the recipe field ``lagrangian_lambda`` (the multiplier's value at
this update, set per update by :meth:`LagrangeMultiplier.bind`), :math:`d` the field
``lagrangian_budget``, and the cost advantages a batch input
(:meth:`trajgrad.objective.Objective.policy_loss`'s ``cost_advantages``). In the trainer the term needs
``constraint.enabled`` (the multiplier, whose ``budget`` and ``init`` must be the recipe's
``lagrangian_budget`` and ``lagrangian_lambda``) and a per-response advantage estimator: the cost
advantages are that estimator on each episode's summed ``info["cost"]``, the costs stay out of the
rewards, and each step's loss takes the multiplier's :math:`\lambda` of that step.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .. import _checks
from ..control.lagrange import LagrangeMultiplier
from ..registry import Param, finite_positive, policy_term
from ..types import LossResult
from ._common import aggregate_tokens, prepare, token_weights, weighted

__all__ = ["lagrangian_loss", "lagrangian_policy_loss"]

LAMBDA = Param("lagrangian_lambda", 0.0, "the ``lagrangian`` term's multiplier λ ≥ 0 at this update (§22; detached): "
               "the value of the cost constraint's :class:`~trajgrad.control.LagrangeMultiplier`, set per update by "
               "``LagrangeMultiplier.bind(objective)`` (the start value in a recipe).", float,
               lambda v: finite_positive("lagrangian_lambda", v, allow_zero=True))


def _check_budget(v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"lagrangian_budget: must be a finite number, got {v!r}")


BUDGET = Param("lagrangian_budget", 0.0, "the ``lagrangian`` term's cost budget d (§22): the loss is "
               "−(J_R − λ (J_C − d)); d shifts its value by λ d, never its gradient.", float, _check_budget)


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


def _lagrangian_text(o) -> str:
    lam, d = o.lagrangian_lambda, o.lagrangian_budget
    return (f"ρ_t = π_θ(y_t) / sg[π_old(y_t)]   (unclipped)\n"
            f"x_t = − ρ_t A^R_t + sg[λ] · (ρ_t A^C_t − d),   λ = {lam:g}, d = {d:g}\n"
            f"    aggregated: − (J_R − sg[λ] · (J_C − d)),  J_R = aggregate(ρ_t A^R_t), J_C = aggregate(ρ_t A^C_t)  (§22)\n"
            f"    A^R: the reward advantages; A^C: the cost advantages (a batch input, cost_advantages)\n"
            f"    λ = lagrangian_lambda = {lam:g}: the multiplier's value at this update (LagrangeMultiplier.bind "
            f"sets it per update;\n    after the step λ ← max(0, λ + η · (C̄ − {d:g})), C̄ the batch's mean cost); "
            f"d enters per token (aggregate(d) = d for token_mean)")


@policy_term(
    "lagrangian", fields=("lagrangian_lambda", "lagrangian_budget"), ratio="old",
    detached=("old log-probs", "λ (the multiplier)", "cost advantages"), aggregation="token_mean",
    text=_lagrangian_text, params=(LAMBDA, BUDGET), inputs=("cost_advantages",),
    call=lambda o, x: lagrangian_policy_loss(x.logp, x.ratio_logp, x.advantages, x.cost_advantages, x.mask,
                                             multiplier=o.lagrangian_lambda, budget=o.lagrangian_budget, **x.agg),
)
def lagrangian_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    cost_advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    multiplier: Union[float, torch.Tensor, LagrangeMultiplier],
    budget: Optional[float] = None,
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""§22's Lagrangian on token log-probs: :func:`lagrangian_loss` of the two importance-weighted surrogates.

    With :math:`\rho_t=\exp(\ell^\theta_t-\mathrm{sg}[\ell^{old}_t])` (unclipped) and the detached
    reward and cost advantages :math:`A^R`, :math:`A^C`:

    .. math::
        J_R=\operatorname{agg}(w_t\rho_tA^R_t),\quad J_C=\operatorname{agg}(w_t\rho_tA^C_t),\qquad
        \mathcal L=-\big(J_R-\mathrm{sg}[\lambda]\,(J_C-d\,\operatorname{agg}(1))\big),

    :math:`w_t` the optional rollout-correction weights. The budget enters per token, so that
    micro-batches with a global ``denominator`` sum to the full batch (§13):
    :math:`\operatorname{agg}(1)=1` for ``token_mean`` (and the per-response means when every
    response has an action token), so the value is :math:`-(J_R-\lambda(J_C-d))`. Gradient
    :math:`\partial\mathcal L/\partial\ell^\theta_t=\omega_t\,w_t\rho_t(-A^R_t+\lambda A^C_t)`
    (:math:`\omega_t` the aggregation weight): that of a policy-gradient loss on
    :math:`A^R-\lambda A^C` (:meth:`LagrangeMultiplier.penalized_advantages`). No gradient
    reaches :math:`\lambda`, the advantages or the old log-probs.

    Worked example, one response of two action tokens, ``token_mean``, on-policy (:math:`\rho=1`),
    :math:`A^R=(1, 1)`, :math:`A^C=(0.5, 0.5)`, :math:`\lambda=2`, :math:`d=0.1`:
    :math:`J_R=1`, :math:`J_C=0.5`, loss :math:`-(1-2\cdot(0.5-0.1))=-0.2`; the gradient per token is
    :math:`\tfrac12(-1+2\cdot0.5)=0`.

    Args:
      logp: ``[B, L]`` current log-probs (attached). old_logp: ``[B, L]`` (detached here).
      advantages: ``[B, L]`` or ``[B]`` reward advantages. cost_advantages: the same shape, the cost's.
      mask: ``[B, L]`` action mask.
      multiplier, budget: as in :func:`lagrangian_loss`.
      weights, aggregation, constant, denominator: as in :func:`trajgrad.losses.ppo_clip_loss`.

    Returns:
      ``LossResult``; the metrics of :func:`lagrangian_loss` (``lagrangian/violation`` is
      :math:`J_C-d\,\operatorname{agg}(1)`).

    Raises:
      ValueError naming the argument (``cost_advantages`` of another shape than ``advantages``, NaN at a
      valid position, a negative ``multiplier``, ...).
    """
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    cost = _checks.as_tensor("cost_advantages", cost_advantages)
    adv_shape = tuple(_checks.as_tensor("advantages", advantages).shape)
    _checks.check_shape("cost_advantages", cost, adv_shape, against="advantages")
    xc = prepare(logp, mask, cost, aggregation=aggregation, advantages_name="cost_advantages")
    ratio = torch.exp(x.log_ratio()) * x.maskf
    w = token_weights(weights, x)
    agg = dict(constant=constant, denominator=denominator)
    j_r = aggregate_tokens(weighted(ratio * x.advantages, w), x, aggregation, **agg)
    j_c = aggregate_tokens(weighted(ratio * xc.advantages, w), x, aggregation, **agg)
    if isinstance(multiplier, LagrangeMultiplier):
        if budget is not None and _number("budget", budget) != multiplier.budget:
            raise ValueError(f"budget: {budget} differs from the multiplier's budget {multiplier.budget}")
        budget, multiplier = multiplier.budget, multiplier.value
    if budget is None:
        raise ValueError("budget: required with a numeric multiplier (the cost budget d)")
    per_unit = aggregate_tokens(x.maskf.detach(), x, aggregation, **agg).detach()
    return lagrangian_loss(j_r, j_c, multiplier, budget=_number("budget", budget) * per_unit)
