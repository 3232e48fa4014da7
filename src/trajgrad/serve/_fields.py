"""Field checks shared by the completions and chat request plans: one :class:`RequestError` naming the field."""
from __future__ import annotations

import math
from typing import Any, Sequence

from .errors import RequestError


def finite_field(name: str, v) -> float:
    try:
        x = float(v)
    except OverflowError:
        raise RequestError(f"{name}: must be finite, got a number too large for a float", param=name) from None
    if not math.isfinite(x):
        raise RequestError(f"{name}: must be finite, got {v!r}", param=name)
    return x


def neutral_field(req, name: str, neutral: Sequence[Any]) -> None:
    v = getattr(req, name)
    if v is not None and v not in neutral:
        raise RequestError(
            f"{name}: not supported (the reported log-probs would not describe the distribution); "
            f"omit it or use {neutral[0]!r}",
            param=name,
        )
