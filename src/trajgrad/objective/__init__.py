r"""Recipes as data: an :class:`Objective` states every choice that defines an update.

``Objective`` (:mod:`trajgrad.objective._core`) is composed from the fields that the policy terms
and advantage estimators declare in their own modules (:mod:`trajgrad.registry`); ``RECIPES`` and
``get_recipe`` (:mod:`trajgrad.objective._recipes`) hold the named recipes with their papers'
defaults; ``explain``, ``explain_diff`` and ``sections`` (:mod:`trajgrad.objective._explain`)
print the estimator a recipe optimizes from the same entries and fields.
"""
from ..losses.cov import CLIP_COV_HIGH
from ..losses.dpo import DPO_LOSS_TYPES
from ..losses.sapo import SAPO_LEVELS
from ..registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_TERMS,
    AdvantageEstimator,
    Param,
    PolicyInputs,
    PolicyTerm,
    policy_term,
    register_advantage_estimator,
    register_policy_term,
)
from ._core import KL_KINDS, KL_PLACEMENTS, RECIPE_PARAMS, SCHEDULE_FIELDS, Objective
from ._explain import explain, explain_diff, sections
from ._recipes import RECIPES, get_recipe

__all__ = [
    "Objective",
    "RECIPES",
    "get_recipe",
    "explain",
    "explain_diff",
    "sections",
    "register_policy_term",
    "register_advantage_estimator",
    "policy_term",
    "Param",
    "PolicyTerm",
    "AdvantageEstimator",
    "PolicyInputs",
    "POLICY_TERMS",
    "ADVANTAGE_ESTIMATORS",
    "KL_PLACEMENTS",
    "KL_KINDS",
    "SCHEDULE_FIELDS",
    "RECIPE_PARAMS",
    "CLIP_COV_HIGH",
    "DPO_LOSS_TYPES",
    "SAPO_LEVELS",
]
