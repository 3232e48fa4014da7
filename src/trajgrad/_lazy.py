"""Lazy package attributes (PEP 562): a package's ``_LAZY`` table, read by its module ``__getattr__``."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict


def lazy_attributes(package: str, table: Dict[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``table`` maps an attribute to the submodule that defines it
    (the submodule itself when both have the same name), imported on first access."""

    def __getattr__(name: str) -> Any:
        if name in table:
            module = importlib.import_module(f".{table[name]}", package)
            return module if table[name] == name else getattr(module, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
