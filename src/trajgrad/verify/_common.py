"""Shared pieces of the verify battery: the report, adapters' return values, random ragged batches."""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

@dataclass
class Check:
    name: str
    passed: Optional[bool]  # None = skipped
    max_deviation: float = 0.0
    detail: str = ""


@dataclass
class VerifyReport:
    reference: str
    checks: List[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    def table(self) -> str:
        rows = [f"{'check':<16} {'result':<8} {'max deviation':>14}  detail"]
        for c in self.checks:
            res = "skip" if c.passed is None else ("PASS" if c.passed else "FAIL")
            rows.append(f"{c.name:<16} {res:<8} {c.max_deviation:>14.3e}  {c.detail}")
        rows.append(f"overall: {'PASS' if self.passed else 'FAIL'} (reference: {self.reference})")
        return "\n".join(rows)


def _scalar(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        t = out
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        t = out[0]
    elif hasattr(out, "loss"):
        t = out.loss
    else:
        raise ValueError(f"loss_fn: must return a tensor, a LossResult or a tuple, got {type(out).__name__}")
    if t.ndim != 0:
        raise ValueError(f"loss_fn: must return a scalar loss, got shape {tuple(t.shape)}")
    return t


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _ragged_mask(gen: torch.Generator, B: int, L: int) -> torch.Tensor:
    """Prompt zeros, one or two action turns separated by an observation span, right padding."""
    mask = torch.zeros(B, L, dtype=torch.float64)
    for b in range(B):
        start = int(torch.randint(0, max(1, L // 4), (1,), generator=gen))
        end = int(torch.randint(start + 1, L + 1, (1,), generator=gen))
        mask[b, start:end] = 1
        if end - start >= 4:
            o0 = start + (end - start) // 3
            mask[b, o0 : o0 + max(1, (end - start) // 4)] = 0
    return mask


def _poison(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    vals = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=x.dtype)
    fill = vals[torch.arange(x.numel()).reshape(x.shape) % 3]
    return torch.where(mask.bool(), x, fill)


def max_deviation(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` over all elements (0.0 when empty): the ``max_deviation`` a :class:`Check` reports;
    ``inf`` when the shapes differ or any difference is not finite (a NaN never reads as agreement)."""
    if a.shape != b.shape:
        return float("inf")
    d = (a - b).abs()
    if not torch.isfinite(d).all():
        return float("inf")
    return float(d.max()) if d.numel() else 0.0
