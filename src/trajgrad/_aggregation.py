"""The aggregation modes of §13 and the checks of their arguments (shared by :mod:`trajgrad.aggregate`, the losses)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import _checks

MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_constant", "token_sum")


def check_mode(mode: str, constant: Optional[float]) -> None:
    """``mode`` is one of :data:`MODES`; ``constant`` is given only with ``seq_sum_constant``, positive and finite."""
    _checks.check_choice("mode", mode, MODES)
    if constant is not None:
        if mode != "seq_sum_constant":
            raise ValueError(f"constant: only used by mode 'seq_sum_constant', got mode {mode!r}")
        c = float(constant)
        _checks.check_positive("constant", c)
        if not math.isfinite(c):
            raise ValueError(f"constant: must be finite, got {constant}")


def check_denominator(denominator, dtype, device) -> torch.Tensor:
    """``denominator`` as a 0-D tensor of ``dtype`` on ``device``; ValueError unless scalar, positive and finite."""
    d = torch.as_tensor(denominator, dtype=dtype, device=device)
    if d.ndim != 0:
        raise ValueError(f"denominator: must be a scalar, got shape {tuple(d.shape)}")
    if not bool(d > 0):
        raise ValueError(f"denominator: must be positive, got {d.item()}")
    if not bool(torch.isfinite(d)):
        raise ValueError(f"denominator: must be finite, got {d.item()}")
    return d
