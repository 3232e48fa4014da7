"""trajgrad: exact, gradient-proven RL estimators for LLM agents, and a trainer that uses them.

The core (``logprobs``, ``returns``, ``baselines``, ``ratios``, ``aggregate``, ``losses``,
``diagnostics``) is pure PyTorch. See the README for the estimator table.
"""
from ._checks import validation
from .types import LossResult

__version__ = "0.1.0"

__all__ = ["LossResult", "validation", "__version__"]
