"""Former location of the policy builder and the KL reference snapshot; they live in
:mod:`trajgrad.model.build` and :mod:`trajgrad.weights.reference` now.

Kept as re-exports for old imports (remove once nothing imports ``trajgrad.train.models``).
"""
from ..model.build import build_policy_model
from ..weights.reference import ReferenceWeights

__all__ = ["ReferenceWeights", "build_policy_model"]
