r"""Linear recurrences over time, solved without a Python loop over steps.

Every backward recursion in :mod:`trajgrad.advantages.returns` is the affine recurrence

.. math:: A_t = d_t + c_tA_{t+1},\qquad A_T = 0,

along the last axis of a ``[..., T]`` tensor. :func:`suffix_affine_scan_` solves it with a
work-efficient, log-depth parallel scan: steps ``2i`` and ``2i+1`` compose into one affine
map, the half-length problem is solved recursively, and the odd steps are filled in from
their even successors. It only multiplies coefficients in :math:`[0,1]` and adds bounded
terms, so it neither overflows nor underflows at any length (131,072 steps with
:math:`c=0.95` included), unlike a closed form through :math:`c^t` and a reversed cumulative
sum, whose :math:`c^{-t}` overflows after a few thousand steps. When the coefficient is one
number (no flags, no padding) the products of coefficients are numbers too, which halves the
work of every level.

This module is private: its functions take already validated, finite tensors.
"""
from __future__ import annotations

from typing import Union

import torch

Coefficient = Union[float, torch.Tensor]

__all__ = [
    "suffix_affine_scan",
    "suffix_affine_scan_",
    "shift_left",
    "windowed_affine_sum",
    "next_valid_index",
    "pack_left",
    "unpack",
]


def suffix_affine_scan(d: torch.Tensor, c: Coefficient) -> torch.Tensor:
    r"""Solve :math:`A_t=d_t+c_tA_{t+1}` along the last axis, :math:`A_T=0`; a new tensor.

    ``c`` is a tensor shaped like ``d`` or one number (the same coefficient at every step).
    Neither input is modified.
    """
    if isinstance(c, torch.Tensor):
        c = c.clone()
    return suffix_affine_scan_(d.clone(), c)


def suffix_affine_scan_(d: torch.Tensor, c: Coefficient) -> torch.Tensor:
    r"""In-place :func:`suffix_affine_scan`: overwrite ``d`` with the solution and return it.

    A coefficient tensor ``c`` is used as scratch space and left holding partial products.

    Steps ``2i`` and ``2i+1`` compose into
    :math:`A_{2i}=(d_{2i}+c_{2i}d_{2i+1})+c_{2i}c_{2i+1}A_{2i+2}`, written over the even
    entries of ``d`` and ``c``; the half-length problem on those (strided) entries gives
    every even step in place, and each odd step follows from the next even one,
    :math:`A_{2i+1}=d_{2i+1}+c_{2i+1}A_{2i+2}`. For an odd length the last step is its own
    solution (:math:`A_{T-1}=d_{T-1}`) and is folded into the step before it. Work is linear
    in ``T``, depth :math:`\lceil\log_2T\rceil`, and nothing is allocated: on a machine
    where fresh memory costs a page fault per 4 KiB, temporaries cost more than the
    arithmetic.
    """
    if isinstance(c, torch.Tensor):
        return _tensor_scan_(d, c)
    return _number_scan_(d, float(c))


# Once the even entries of a level lie this many elements apart, every one of them sits on
# its own cache line: the deeper levels run on a contiguous copy instead (a 1/8-size buffer).
_REPACK_STRIDE = 8
_REPACK_MIN_LENGTH = 64


def _repacked(d: torch.Tensor, length: int) -> bool:
    return d.stride(-1) >= _REPACK_STRIDE and length >= _REPACK_MIN_LENGTH


def _tensor_scan_(d: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    length = d.shape[-1]
    if length <= 1:
        return d
    if _repacked(d, length):
        return d.copy_(_tensor_scan_(d.contiguous(), c.contiguous()))
    if length % 2:
        # The lone last step is its own solution; fold it into the step before and solve
        # the even-length prefix, whose last coefficient then multiplies A = 0.
        d[..., length - 2].addcmul_(c[..., length - 2], d[..., length - 1])
        _tensor_scan_(d[..., : length - 1], c[..., : length - 1])
        return d
    d_even, d_odd = d[..., 0::2], d[..., 1::2]
    c_even, c_odd = c[..., 0::2], c[..., 1::2]
    d_even.addcmul_(c_even, d_odd)
    c_even.mul_(c_odd)
    _tensor_scan_(d_even, c_even)
    d_odd[..., :-1].addcmul_(c_odd[..., :-1], d_even[..., 1:])
    return d


def _number_scan_(d: torch.Tensor, c: float) -> torch.Tensor:
    """:func:`suffix_affine_scan_` with the same coefficient ``c`` at every step."""
    length = d.shape[-1]
    if length <= 1 or c == 0.0:
        return d
    if _repacked(d, length):
        return d.copy_(_number_scan_(d.contiguous(), c))
    if length % 2:
        d[..., length - 2].add_(d[..., length - 1], alpha=c)
        _number_scan_(d[..., : length - 1], c)
        return d
    d_even, d_odd = d[..., 0::2], d[..., 1::2]
    d_even.add_(d_odd, alpha=c)
    _number_scan_(d_even, c * c)
    d_odd[..., :-1].add_(d_even[..., 1:], alpha=c)
    return d


def shift_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """``y[..., t] = x[..., t + k]``, zero beyond the end."""
    length = x.shape[-1]
    if k >= length:
        return torch.zeros_like(x)
    return torch.cat([x[..., k:], x.new_zeros(x.shape[:-1] + (k,))], -1)


def windowed_affine_sum(d: torch.Tensor, c: torch.Tensor, n: int) -> torch.Tensor:
    r""":math:`W_t=\sum_{l<n}\big(\prod_{j<l}c_{t+j}\big)d_{t+l}` (zero beyond the end).

    The first ``n`` steps of the recursion in :func:`suffix_affine_scan`, composed by binary
    doubling of the window: :math:`O(T\log n)` work, no subtraction of two long sums.
    """
    length = d.shape[-1]
    n = min(n, length)
    acc_d = torch.zeros_like(d)
    acc_c = torch.ones_like(c)
    acc_len = 0
    pow_d, pow_c, pow_len = d, c, 1
    while n:
        if n & 1:
            acc_d = torch.addcmul(acc_d, acc_c, shift_left(pow_d, acc_len))
            acc_c = acc_c * shift_left(pow_c, acc_len)
            acc_len += pow_len
        n >>= 1
        if n:
            pow_d = torch.addcmul(pow_d, pow_c, shift_left(pow_d, pow_len))
            pow_c = pow_c * shift_left(pow_c, pow_len)
            pow_len *= 2
    return acc_d


def next_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """For each step, the index of the next valid step of the row (``T`` if none)."""
    length = mask.shape[-1]
    idx = torch.arange(length, device=mask.device).expand_as(mask)
    idx = torch.where(mask, idx, torch.full_like(idx, length))
    suffix_min = torch.cummin(idx.flip(-1), -1).values.flip(-1)
    return torch.cat([suffix_min[..., 1:], torch.full_like(suffix_min[..., :1], length)], -1)


def pack_left(mask: torch.Tensor):
    """Permutation that moves the valid steps of every row to the front (stable)."""
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)
    packed_mask = torch.gather(mask, -1, order)
    return order, packed_mask


def unpack(packed: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_left` applied to a packed tensor."""
    return torch.zeros_like(packed).scatter(-1, order, packed)
