"""Validation of per-step inputs shared by :mod:`trajgrad.returns` and :mod:`trajgrad.gae`.

Each helper raises ``ValueError`` naming the argument (see :mod:`trajgrad._checks`) and
returns detached floating-point tensors. Masked steps may hold anything, NaN and ±inf
included; the helpers that zero them do so by selection, never by multiplication.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _checks

__all__ = [
    "as_float",
    "check_rate",
    "steps",
    "valid_mask",
    "per_step",
    "per_row",
    "prepare_rewards",
    "flag",
    "coefficients",
    "all_finite",
]


def as_float(name: str, x) -> torch.Tensor:
    """``x`` as a detached real floating-point tensor (integers and bools are converted)."""
    x = _checks.as_tensor(name, x)
    if not x.is_floating_point():
        if x.dtype == torch.bool or not x.is_complex():
            x = x.to(torch.get_default_dtype())
        else:
            raise ValueError(f"{name}: expected a real tensor, got dtype {x.dtype}")
    return x.detach()


def check_rate(name: str, value) -> float:
    """A discount or trace parameter: one number in ``[0, 1]``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: must be a scalar, got shape {tuple(value.shape)}")
        value = value.item()
    try:
        value = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: must be a number in [0, 1], got {value!r}") from exc
    _checks.check_in_range(name, value, 0.0, 1.0)
    return value


def steps(name: str, x, *, ndim=2) -> torch.Tensor:
    """A floating-point tensor with ``ndim`` dimensions."""
    x = as_float(name, x)
    _checks.check_ndim(name, x, ndim)
    return x


def valid_mask(mask, shape, device) -> torch.Tensor:
    """The ``mask`` argument as a bool tensor of ``shape`` (all valid when ``None``)."""
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return _checks.check_mask("mask", mask, shape).to(device)


def per_step(name: str, x, shape, mask: torch.Tensor, dtype) -> torch.Tensor:
    """Validate a ``[B, T]`` per-step input, detach it, and zero its masked steps."""
    x = as_float(name, x)
    _checks.check_shape(name, x, shape, against="rewards")
    _checks.check_finite(name, x, mask)
    return _checks.fill_masked(x.to(dtype), mask)


def per_row(name: str, x, rows: int, dtype, device, needed: Optional[torch.Tensor]) -> torch.Tensor:
    """A ``[B]`` (or scalar) per-row value; finite where ``needed`` (``[B]`` bool), 0 elsewhere."""
    if x is None:
        return torch.zeros(rows, dtype=dtype, device=device)
    x = as_float(name, x)
    if x.ndim == 0:
        x = x.expand(rows)
    _checks.check_shape(name, x, (rows,))
    _checks.check_finite(name, x, needed)
    x = x.to(dtype=dtype, device=device)
    if needed is not None:
        x = _checks.fill_masked(x, needed)
    return x


def prepare_rewards(rewards, mask):
    """``(rewards zeroed at masked steps, bool mask, shape)`` for a ``[B, T]`` reward tensor."""
    rewards = steps("rewards", rewards)
    shape = tuple(rewards.shape)
    m = valid_mask(mask, shape, rewards.device)
    _checks.check_finite("rewards", rewards, m)
    return _checks.fill_masked(rewards, m), m, shape


def flag(name: str, x, shape, mask: torch.Tensor) -> torch.Tensor:
    """A 0/1 per-step flag (terminated / truncated) as bool, False at masked steps."""
    if x is None:
        return torch.zeros(shape, dtype=torch.bool, device=mask.device)
    return _checks.check_mask(name, x, shape).to(mask.device) & mask


def coefficients(valid: torch.Tensor, carry: torch.Tensor, rate: float, dtype) -> torch.Tensor:
    """Scan coefficients: ``rate`` where a valid step carries, 0 where it does not, 1 at padding."""
    c = torch.full(valid.shape, rate, dtype=dtype, device=valid.device)
    c = c.masked_fill(~carry, 0.0)
    return c.masked_fill(~valid, 1.0)


def all_finite(x: torch.Tensor) -> bool:
    """Whether every entry of ``x`` is finite, decided by one reduction.

    NaN and ±inf propagate through a sum, so a finite sum proves every entry finite. A
    non-finite sum means a non-finite entry or an overflowing sum of finite ones: ``False``
    either way, and callers fall back to an exact, masked treatment.
    """
    if not x.is_floating_point() or x.numel() == 0:
        return True
    return bool(torch.isfinite(x.sum()))
