"""One-release aliases of the modules that moved into packages.

``import trajgrad.returns`` (and ``from trajgrad.returns import gae``) still works for one
release: it emits a :class:`DeprecationWarning` naming the new path and binds the *same*
module object as the new path, so every name, private or public, resolves as before. The
aliases are served by a finder on :data:`sys.meta_path` instead of stub files at the old
paths. Internal code imports the new paths only (``tests/test_layout.py`` checks it).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module path -> new module path
MOVED = {
    "trajgrad.returns": "trajgrad.advantages.returns",
    "trajgrad.gae": "trajgrad.advantages.td",
    "trajgrad.baselines": "trajgrad.advantages.baselines",
    "trajgrad.group_baselines": "trajgrad.advantages.group_baselines",
    "trajgrad.credit": "trajgrad.advantages.credit",
    "trajgrad.ratios": "trajgrad.logprobs.ratios",
    "trajgrad.correction": "trajgrad.logprobs.correction",
    "trajgrad.losses.lagrange": "trajgrad.control.lagrange",
    "trajgrad.losses.teacher_router": "trajgrad.control.teacher_router",
}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED` and loads each as its new module, with a warning."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path is removed in the next release",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import system overwrites __spec__ next
        return module

    def exec_module(self, module):
        """The module is the new path's, already executed: only its own ``__spec__`` is put back
        (relative imports inside its functions resolve against it)."""
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Put the alias finder first on :data:`sys.meta_path` (once)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
