"""Load-time checks of a loss term that reads cost advantages (the §22 Lagrangian term): the
``constraint:`` section must supply them and λ (one concept beside ``config_checks``)."""
from __future__ import annotations

from ..control import LagrangeMultiplier

__all__ = ["cost_advantages_supplied"]


def cost_advantages_supplied(cfg, obj, where: str, errors) -> bool:
    """A term reading cost advantages (§22's Lagrangian) gets the recipe's per-response estimator on the
    episodes' costs and λ from the ``constraint:`` multiplier, whose budget must be the recipe's."""
    if not cfg.constraint.enabled:
        errors.add("constraint.enabled", f"loss {obj.loss!r} takes λ from the cost constraint's multiplier and the "
                   "cost advantages from info['cost']; set constraint.enabled: true")
        return False
    if obj.estimator.level != "sequence":
        errors.add(where, f"loss {obj.loss!r} needs a per-response advantage estimator (the cost advantages are that "
                   f"estimator on the per-response costs); {obj.advantage!r} is not")
        return False
    if cfg.tasks:
        errors.add("tasks", f"loss {obj.loss!r} (cost advantages) trains one environment; leave tasks: unset")
        return False
    c = cfg.constraint
    try:
        start = LagrangeMultiplier(init=c.init, lr=c.lr, budget=c.budget).bind(obj)
    except ValueError as exc:
        errors.add("recipe.overrides.lagrangian_budget", " ".join(str(exc).split(": ", 1)[1].split()))
        return False
    if start != obj:  # the recipe's λ is the multiplier's start value, so that explain prints the λ of step 1
        errors.add("recipe.overrides.lagrangian_lambda", f"{obj.lagrangian_lambda:g} differs from constraint.init = "
                   f"{c.init:g}, where the trainer's λ starts; give both the same value")
        return False
    return True
