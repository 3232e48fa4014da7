"""Dotted config keys (``"train.steps"``) on nested dicts: the config loader's and the resume path's."""
from __future__ import annotations

from typing import Any, Dict


def set_dotted(d: Dict[str, Any], key: str, value: Any) -> None:
    """Set ``d[a][b][c] = value`` for ``key = "a.b.c"``, making (or replacing non-dict) sections on the way."""
    parts = key.split(".")
    cur = d
    for p in parts[:-1]:
        if p not in cur or not isinstance(cur[p], dict):
            cur[p] = {}
        cur = cur[p]
    cur[parts[-1]] = value
