"""Input handling shared by the distillation losses: one side (logits or hidden states + head),
the aggregation weights of each position, the vocabulary checks."""
from __future__ import annotations

from typing import Union

import torch

from .. import _checks
from ..aggregate import MODES, aggregate
from ..fused import Head, check_finite_fast, check_head, check_sizes

Number = Union[float, int, torch.Tensor]


def _check_mask(mask) -> torch.Tensor:
    if mask is None:
        raise ValueError("mask: required ([B, L] 0/1 action mask)")
    mask = _checks.check_mask("mask", mask)
    _checks.check_ndim("mask", mask, 2)
    return mask


def _side(prefix: str, logits, hidden, weight, bias, mask: torch.Tensor, *, detach: bool) -> Head:
    """Validate one side (``<prefix>_logits`` or ``<prefix>_hidden`` + ``<prefix>_weight``)."""
    ln, hn, wn, bn = f"{prefix}_logits", f"{prefix}_hidden", f"{prefix}_weight", f"{prefix}_bias"
    if logits is not None and (hidden is not None or weight is not None):
        raise ValueError(f"{ln}: give either {ln} or {hn} with {wn}, not both")
    if logits is None and hidden is None and weight is None:
        raise ValueError(f"{ln}: missing; give {ln} [B, L, V] or {hn} [B, L, H] with {wn} [V, H]")
    if logits is None and hidden is None:
        raise ValueError(f"{hn}: required together with {wn}")
    if logits is None and weight is None:
        raise ValueError(f"{wn}: required together with {hn}")
    if logits is not None and bias is not None:
        raise ValueError(f"{bn}: only used with {hn}/{wn}, not with {ln}")
    return _make_head(ln, hn, wn, bn, logits, hidden, weight, bias, mask, detach=detach)


def _make_head(ln, hn, wn, bn, logits, hidden, weight, bias, mask, *, detach: bool) -> Head:
    B, L = mask.shape
    if logits is not None:
        logits = _checks.as_tensor(ln, logits)
        _checks.check_floating(ln, logits)
        _checks.check_ndim(ln, logits, 3)
        if tuple(logits.shape[:2]) != (B, L):
            raise ValueError(f"{ln}: expected shape ({B}, {L}, V) (the shape of mask + a vocabulary "
                             f"dimension), got {tuple(logits.shape)}")
        if logits.shape[2] < 1:
            raise ValueError(f"{ln}: the vocabulary is empty")
        check_finite_fast(ln, logits, mask)
        if detach:
            logits = logits.detach()
        return Head(logits.reshape(B * L, logits.shape[2]))
    hidden, weight, bias = check_head(hn, hidden, wn, weight, bn, bias, lead_shape=(B, L), mask=mask)
    if detach:
        hidden, weight = hidden.detach(), weight.detach()
        bias = None if bias is None else bias.detach()
    return Head(hidden.reshape(B * L, hidden.shape[2]), weight, bias)


def _token_weights(mask: torch.Tensor, aggregation: str, constant, denominator, dtype, device) -> torch.Tensor:
    r""":math:`\omega = \partial\,\mathrm{aggregate}(x)/\partial x` (``[B, L]``), from ``aggregate`` itself.

    Every mode is linear in the per-token terms, so this gradient is the exact weight of
    each position in the aggregated loss.
    """
    _checks.check_choice("aggregation", aggregation, MODES)
    probe = torch.zeros(mask.shape, dtype=dtype, device=device, requires_grad=True)
    with torch.enable_grad():
        total = aggregate(probe, mask, aggregation, constant=constant, denominator=denominator)
        (omega,) = torch.autograd.grad(total, probe)
    return omega


def _common_checks(temperature, chunk_size, aggregation) -> None:
    check_sizes(temperature, chunk_size)
    _checks.check_choice("aggregation", aggregation, MODES)


def _vocab_match(student: Head, teacher: Head, teacher_name: str) -> None:
    if student.vocab != teacher.vocab:
        raise ValueError(f"{teacher_name}: the teacher vocabulary has {teacher.vocab} entries but the student's "
                         f"has {student.vocab}; the divergences need one vocabulary")


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.sum() / max(int(x.numel()), 1)

