r"""Lagrange multiplier for an expected-cost constraint (spec §22).

Constrained objective :math:`\max_\theta J_R(\theta)` s.t. :math:`J_C(\theta)=\mathbb E[C(\tau)]\le d`,
through the Lagrangian

.. math::
    \mathcal L(\theta,\lambda)=J_R(\theta)-\lambda\,(J_C(\theta)-d),\qquad\lambda\ge0,

ascended in :math:`\theta` (the policy sees the advantage :math:`A_R-\lambda A_C`) and
descended in :math:`\lambda` by projected gradient steps
:math:`\lambda\leftarrow\max(0,\lambda+\eta(\bar C-d))`.

This controls an *expectation*, not worst-case behaviour; hard constraints (tool
authorization, sandboxing, confirmation of irreversible actions) stay outside the loss.
"""
from __future__ import annotations

import math
from typing import Any, Dict

import torch

from .. import _checks


def _finite_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: expected a scalar, got shape {tuple(value.shape)}")
        value = value.detach().item()
    try:
        v = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: expected a number, got {type(value).__name__}") from exc
    if not math.isfinite(v):
        raise ValueError(f"{name}: must be finite, got {v}")
    return v


class LagrangeMultiplier:
    r"""A non-negative multiplier :math:`\lambda` updated by projected dual ascent (§22).

    Args:
      init: initial :math:`\lambda\ge0`.
      lr: dual step size :math:`\eta>0`.
      budget: the cost budget :math:`d` (any finite number).

    Usage::

        lam = LagrangeMultiplier(lr=0.05, budget=0.1)
        adv = lam.penalized_advantages(reward_adv, cost_adv)   # lambda is a constant here
        loss = ppo_clip_loss(logp, old_logp, adv, mask).loss
        ...
        lam.update(batch_costs.mean())                        # after the policy step
    """

    def __init__(self, init: float = 0.0, lr: float = 0.01, budget: float = 0.0) -> None:
        init = _finite_float("init", init)
        _checks.check_positive("init", init, allow_zero=True)
        lr = _finite_float("lr", lr)
        _checks.check_positive("lr", lr)
        self._value = init
        self.lr = lr
        self.budget = _finite_float("budget", budget)

    @property
    def value(self) -> float:
        """Current :math:`\\lambda` (a Python float, always ``>= 0``)."""
        return self._value

    def __float__(self) -> float:
        return self._value

    def __repr__(self) -> str:
        return f"LagrangeMultiplier(value={self._value}, lr={self.lr}, budget={self.budget})"

    def update(self, mean_cost) -> float:
        r"""One dual step :math:`\lambda\leftarrow\max(0,\lambda+\eta(\bar C-d))`; returns the new value.

        :math:`\lambda` grows while the observed mean cost exceeds the budget and shrinks
        (never below 0) while it is under budget.

        Args:
          mean_cost: observed :math:`\bar C` (float or 1-element tensor), finite.
        """
        c = _finite_float("mean_cost", mean_cost)
        self._value = max(0.0, self._value + self.lr * (c - self.budget))
        return self._value

    def penalized_advantages(self, reward_adv: torch.Tensor, cost_adv: torch.Tensor) -> torch.Tensor:
        r"""Advantage of the Lagrangian, :math:`A_R-\lambda A_C`, with :math:`\lambda` a constant.

        By linearity, a policy loss on these advantages equals
        ``-(reward_surrogate - lambda * cost_surrogate)`` of §22 for ratio-linear
        surrogates (REINFORCE, the unclipped region of PPO).

        Args:
          reward_adv: reward advantages, any shape (``[B, L]`` or ``[B]``).
          cost_adv: cost advantages, the same shape.
        Returns:
          A tensor of that shape (no gradient flows to :math:`\lambda`).
        """
        reward_adv = _checks.as_tensor("reward_adv", reward_adv)
        _checks.check_floating("reward_adv", reward_adv)
        cost_adv = _checks.as_tensor("cost_adv", cost_adv)
        _checks.check_floating("cost_adv", cost_adv)
        _checks.check_shape("cost_adv", cost_adv, reward_adv.shape, against="reward_adv")
        return reward_adv - self._value * cost_adv

    def bind(self, objective):
        r"""``objective`` with this multiplier's current :math:`\lambda` as its ``lagrangian_lambda``.

        For a recipe on the ``lagrangian`` policy term (§22): call it for every update, after
        :meth:`update` moved :math:`\lambda`, so that the loss uses the value of this update
        (``explain`` of the result prints it). The recipe's ``lagrangian_budget`` must equal this
        multiplier's budget (one :math:`d` in the loss and in the dual step).

        Raises:
          ValueError naming ``lagrangian_budget`` when the budgets differ, or ``lagrangian_lambda``
          when the recipe's term does not read it.
        """
        if getattr(objective, "lagrangian_budget", None) != self.budget:
            raise ValueError(f"lagrangian_budget: the recipe's budget {getattr(objective, 'lagrangian_budget', None)} "
                             f"differs from the multiplier's {self.budget}; give both the same d")
        return objective.replace(lagrangian_lambda=self._value)

    def state_dict(self) -> Dict[str, float]:
        return {"value": self._value, "lr": self.lr, "budget": self.budget}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"state: expected a dict, got {type(state).__name__}")
        missing = {"value", "lr", "budget"} - set(state)
        if missing:
            raise ValueError(f"state: missing keys {sorted(missing)}")
        value = _finite_float("value", state["value"])
        _checks.check_positive("value", value, allow_zero=True)
        lr = _finite_float("lr", state["lr"])
        _checks.check_positive("lr", lr)
        self._value = value
        self.lr = lr
        self.budget = _finite_float("budget", state["budget"])


__all__ = ["LagrangeMultiplier"]
