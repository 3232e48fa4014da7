"""Per-step inputs of :mod:`trajgrad.advantages.returns` and :mod:`trajgrad.advantages.td`: validation and selection.

Each helper raises ``ValueError`` naming the argument (see :mod:`trajgrad._checks`) and
returns detached floating-point tensors. Masked steps may hold anything, NaN and ±inf
included; the helpers that zero them do so by selection, never by multiplication
(:class:`Padding` selects on the bits of the numbers).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _checks

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
    "any_true",
    "Padding",
    "select",
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


def any_true(x: torch.Tensor) -> bool:
    """Whether a bool tensor has a True entry.

    Read as bytes and reduced by ``amax``, a vectorized byte maximum: about 100x faster on
    the CPU than ``Tensor.any`` on a ``[16, 32768]`` bool tensor, which is not vectorized.
    """
    if x.numel() == 0:
        return False
    if x.dtype != torch.bool:
        return bool(x.any())
    return bool(x.view(torch.uint8).amax())


# Right padding of at most this many rows is cleared by one tail fill per row.
_TAIL_FILL_MAX_ROWS = 64
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


class Padding:
    """Selection at the padding steps by the bits of the numbers, without branches.

    ``keep`` holds all-one bits at valid steps and zero bits at padding, in the integer type
    as wide as the float type, so ``bits(x) & keep`` is ``x`` at a valid step and ``+0.0``
    at padding whatever was stored there (NaN and ±inf included): a selection, not
    arithmetic, and as fast as one multiply. Other dtypes fall back to ``masked_fill_``.
    """

    def __init__(self, mask: torch.Tensor, dtype: torch.dtype, ends: Optional[torch.Tensor] = None):
        self.mask = mask
        self.int = _BITS.get(dtype)
        self.dtype = dtype
        # Right padding of a few rows: one contiguous tail fill per row selects just as well.
        self.starts = None if ends is None or mask.shape[0] > _TAIL_FILL_MAX_ROWS else (ends + 1).tolist()
        self._pad = self._keep = None

    @property
    def pad(self) -> torch.Tensor:
        if self._pad is None:
            self._pad = ~self.mask
        return self._pad

    @property
    def keep(self) -> Optional[torch.Tensor]:
        if self._keep is None and self.int is not None:
            self._keep = self.mask.to(self.int).neg_()
        return self._keep

    def bits(self, value: float) -> int:
        return int(torch.tensor(value, dtype=self.dtype).view(self.int).item())

    def zero_(self, x: torch.Tensor) -> torch.Tensor:
        if self.starts is not None:
            length = x.shape[-1]
            for row, start in enumerate(self.starts):
                if start < length:
                    x[row, start:].zero_()
            return x
        if self.keep is None:
            return x.masked_fill_(self.pad, 0.0)
        x.view(self.int).bitwise_and_(self.keep)
        return x

    def coefficients_(self, out: torch.Tensor, carry: Optional[torch.Tensor], rate: float,
                      scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``out`` = ``rate`` where ``carry`` (all valid steps when ``None``), 0 at other valid
        steps, 1 at padding (which passes the carry through).

        ``carry`` lies inside the mask, so this is ``padding + rate * carry``, both flags read as
        bytes (a byte-to-float copy is vectorized, unlike a bool one or a mixed-dtype sum):
        three passes with a ``scratch`` tensor like ``out`` (overwritten), else a masked fill.
        Allocates nothing.
        """
        on = self.mask if carry is None else carry
        if on.dtype != torch.bool or out.dtype not in _BITS:
            out.copy_(on).mul_(rate)
            return out.masked_fill_(self.pad, 1.0)
        out.copy_(on.view(torch.uint8))
        if scratch is None:
            return out.mul_(rate).masked_fill_(self.pad, 1.0)
        scratch.copy_(self.pad.view(torch.uint8))
        return torch.add(scratch, out, alpha=rate, out=out)


def select(x: torch.Tensor, where: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` where ``where``, ``+0.0`` elsewhere, whatever is stored there (into ``out`` if given).

    A bitwise AND of the numbers with an all-ones / all-zeros mask of the same width (see
    :class:`Padding`); ``torch.where`` for dtypes without one. No arithmetic touches ``x``.
    """
    width = _BITS.get(x.dtype)
    if width is None:
        picked = _checks.fill_masked(x, where)
        return picked if out is None else out.copy_(picked)
    keep = where.to(width) if out is None else out.view(width).copy_(where)
    keep.neg_().bitwise_and_(x.view(width))
    return keep.view(x.dtype)
