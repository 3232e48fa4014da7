r"""The §13 aggregation switch, written once: the modes, their checks, numerator and denominator.

:func:`trajgrad.aggregate.aggregate` (any ``[B, L]`` term) and the losses' fast paths
(``trajgrad.losses._common.aggregate_tokens`` / ``aggregate_sequences``, whose terms are
already 0 at masked slots or given per row) all reduce through :func:`numerator` and
:func:`normalizer`; each passes the sums in the form it has, so every caller keeps its own
(bit-identical) order of floating-point operations.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from . import _checks

MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_constant", "token_sum")


def validate_mode(mode: str, constant: Optional[float]) -> None:
    """``mode`` is one of :data:`MODES`; ``constant`` only with ``seq_sum_constant``, positive and finite."""
    _checks.check_choice("mode", mode, MODES)
    if constant is not None:
        if mode != "seq_sum_constant":
            raise ValueError(f"constant: only used by mode 'seq_sum_constant', got mode {mode!r}")
        c = float(constant)
        _checks.check_positive("constant", c)
        if not math.isfinite(c):
            raise ValueError(f"constant: must be finite, got {constant}")


def check_denominator(denominator, dtype, device) -> torch.Tensor:
    """A caller's global denominator as a positive, finite scalar tensor."""
    d = torch.as_tensor(denominator, dtype=dtype, device=device)
    if d.ndim != 0:
        raise ValueError(f"denominator: must be a scalar, got shape {tuple(d.shape)}")
    if not bool(d > 0):
        raise ValueError(f"denominator: must be positive, got {d.item()}")
    if not bool(torch.isfinite(d)):
        raise ValueError(f"denominator: must be finite, got {d.item()}")
    return d


def numerator(mode: str, *, row_means: Callable[[], torch.Tensor], total: Callable[[], torch.Tensor], width: int,
              constant: Optional[float] = None) -> torch.Tensor:
    r"""The numerator of ``mode``: :math:`\sum_i \frac1{L_i}\sum_t m x` (``row_means()``) for
    ``seq_mean_token_mean``, :math:`\sum m x / C` for ``seq_sum_constant`` (``C = constant`` or the
    padded ``width``), :math:`\sum m x` (``total()``) otherwise."""
    if mode == "seq_mean_token_mean":
        return row_means()
    if mode == "seq_sum_constant":
        return total() / (float(constant) if constant is not None else float(width))
    return total()


def normalizer(mode: str, denominator, like: torch.Tensor, *, tokens: Callable[[], torch.Tensor],
               rows: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The denominator :math:`D` of ``mode`` in ``like``'s dtype: the caller's global ``denominator``,
    else the valid tokens (``token_mean``), 1 (``token_sum``) or the non-empty rows, at least 1."""
    if denominator is not None:
        return check_denominator(denominator, like.dtype, like.device)
    if mode == "token_mean":
        return tokens().to(like.dtype).clamp_min(1.0)
    if mode == "token_sum":
        return torch.ones((), dtype=like.dtype, device=like.device)
    return rows().to(like.dtype).clamp_min(1.0)


def aggregate_valid(per_token: torch.Tensor, mask: torch.Tensor, mode: str, *, constant: Optional[float] = None,
                    denominator=None, name: str = "per_token") -> torch.Tensor:
    r""":math:`\operatorname{agg}_{mode}` of ``per_token`` over an already-validated mask (§13).

    The caller has checked the arguments once, at its boundary: ``per_token`` a floating ``[B, L]``
    tensor, ``mask`` a ``bool`` tensor of its shape, ``mode``/``constant`` by :func:`validate_mode`.
    Only the values read here are checked: a NaN/inf of ``per_token`` at a valid position raises
    ``ValueError`` naming ``name``; masked positions are selected away (never multiplied by 0).
    """
    _checks.check_finite(name, per_token, mask)
    x = _checks.fill_masked(per_token, mask)
    lengths = mask.sum(-1)
    num = numerator(mode, row_means=lambda: (x.sum(-1) / lengths.clamp_min(1).to(x.dtype)).sum(), total=x.sum,
                    width=mask.shape[-1], constant=constant)
    d = normalizer(mode, denominator, x, tokens=lambda: mask.sum().to(torch.float64),
                   rows=lambda: mask.any(-1).sum().to(torch.float64))
    return num / d
