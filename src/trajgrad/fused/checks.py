"""Validation shared by the chunked kernels and the distillation losses (``ValueError`` names
the argument)."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .. import _checks
from .chunking import resolve_chunk_size, resolve_tiles

def check_finite_fast(name: str, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
    """Same contract as ``_checks.check_finite`` (``mask`` has ``x``'s leading shape), in one pass.

    A sum is NaN or infinite whenever one of its terms is, so a finite sum (over everything,
    or per last-dimension row when ``mask`` is given) proves finiteness with a single
    reduction and no temporary of ``x``'s size. Only a non-finite sum (a bad value, or a
    genuine overflow of huge finite values) triggers the exact element-wise check, on the
    suspicious rows only.
    """
    if not _checks.values_checked() or not x.is_floating_point() or x.numel() == 0:
        return
    with torch.no_grad():
        if mask is None:
            if bool(torch.isfinite(x.sum())):
                return
            _checks.check_finite(name, x)
            return
        row_sums = x.reshape(mask.shape + (-1,)).sum(-1)
        suspicious = ~torch.isfinite(row_sums) & mask
        if bool(suspicious.any()) and not bool(torch.isfinite(x.reshape(mask.shape + (-1,))[suspicious]).all()):
            raise ValueError(f"{name}: contains NaN or inf at a valid (mask=1) position")


def check_head(hidden_name: str, hidden, weight_name: str, weight, bias_name: str, bias,
               lead_shape=None, mask: Optional[torch.Tensor] = None):
    """Validate ``hidden [.., H]``, ``weight [V, H]``, ``bias [V]`` (ValueError names the argument)."""
    hidden = _checks.as_tensor(hidden_name, hidden)
    _checks.check_floating(hidden_name, hidden)
    if lead_shape is not None:
        if tuple(hidden.shape[:-1]) != tuple(lead_shape) or hidden.ndim != len(lead_shape) + 1:
            raise ValueError(
                f"{hidden_name}: expected shape {tuple(lead_shape)} + (H,) (the shape of mask + a hidden "
                f"dimension), got {tuple(hidden.shape)}")
    weight = _checks.as_tensor(weight_name, weight)
    _checks.check_ndim(weight_name, weight, 2)
    _checks.check_floating(weight_name, weight)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{weight_name}: expected shape (V, {hidden.shape[-1]}) to match the hidden size of "
                         f"{hidden_name}, got {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError(f"{weight_name}: the vocabulary is empty")
    if bias is not None:
        bias = _checks.as_tensor(bias_name, bias)
        _checks.check_floating(bias_name, bias)
        _checks.check_shape(bias_name, bias, (weight.shape[0],))
        check_finite_fast(bias_name, bias)
    check_finite_fast(weight_name, weight)
    check_finite_fast(hidden_name, hidden, mask)
    return hidden, weight, bias


def check_sizes(temperature: float, chunk_size, vocab_chunk_size: Union[int, str, None] = None) -> None:
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise ValueError(f"temperature: expected a positive number, got {temperature!r}") from None
    _checks.check_positive("temperature", t)
    if math.isinf(t):
        raise ValueError(f"temperature: must be finite, got {t}")
    resolve_chunk_size(chunk_size, 1, "logprob", torch.float32)     # "auto" or a positive int
    resolve_tiles(chunk_size, vocab_chunk_size, 1, "logprob", torch.float32, False)   # "auto", None or a positive int

