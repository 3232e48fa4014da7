"""trajgrad: exact, gradient-proven RL estimators for LLM agents, and a trainer that uses them.

The core (``logprobs``: log-probs and ratios; ``advantages``: advantages and returns; ``losses``;
``aggregate``; ``control``: the Lagrange multiplier and teacher router; ``fused``; ``diagnostics``)
is pure PyTorch. See the README for the estimator table and the layout.

``import trajgrad`` loads the core's checks and result type only; the subpackages named in
``_LAZY`` (the trainer, the server, the environments, ...) load on first attribute access
(PEP 562), so that the command line's ``--help`` and a script that only computes losses do
not import the trainer.
"""
import sys as _sys
import types as _types

from . import _moved
from ._checks import validation
from ._lazy import lazy_attributes as _lazy_attributes
from .types import LossResult

# attribute -> submodule that defines it (the submodule itself when both are the same name)
_LAZY = {
    "api": "api",
    "envs": "envs",
    "losses": "losses",
    "objective": "objective",
    "peers": "peers",
    "serve": "serve",
    "train": "train",
    "verify": "verify",
    "view": "view",
}


__getattr__ = _lazy_attributes(__name__, _LAZY)


class _TrainPackage(_types.ModuleType):
    """The ``trajgrad.train`` package, callable as :func:`trajgrad.api.train`."""

    def __call__(self, *args, **kwargs):
        return __getattr__("api").train(*args, **kwargs)


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
