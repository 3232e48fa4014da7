"""trajgrad: exact, gradient-proven RL estimators for LLM agents, and a trainer that uses them.

The core (``logprobs``: log-probs and ratios; ``advantages``: advantages and returns; ``losses``;
``aggregate``; ``control``: the Lagrange multiplier and teacher router; ``fused``; ``diagnostics``)
is pure PyTorch. See the README for the estimator table and the layout.
"""
import sys as _sys
import types as _types

from . import _moved
from ._checks import validation
from .api import train
from .api import train as _api_train
from .types import LossResult


class _TrainPackage(_types.ModuleType):
    """The ``trajgrad.train`` package, callable as :func:`trajgrad.api.train`."""

    def __call__(self, *args, **kwargs):
        return _api_train(*args, **kwargs)


class _Package(_types.ModuleType):
    # ``trajgrad.train`` is both the training package and the ``train(...)`` entry point:
    # importing the package binds it here, so it is made callable as it is bound.
    def __setattr__(self, name, value):
        if name == "train" and isinstance(value, _types.ModuleType) and not isinstance(value, _TrainPackage):
            value.__class__ = _TrainPackage
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
_moved.install()

__version__ = "0.1.0"

__all__ = ["LossResult", "train", "validation", "__version__"]
