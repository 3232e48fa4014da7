"""Deprecated alias of :mod:`trajgrad.runtime.allocator` (kept for one release)."""
import warnings

from ..runtime.allocator import *  # noqa: F401,F403
from ..runtime.allocator import __all__  # noqa: F401

warnings.warn("trajgrad.train.allocator moved to trajgrad.runtime.allocator; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)
