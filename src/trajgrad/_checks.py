"""Input validation shared by every public function (DESIGN.md, "Bad input").

Every check raises ``ValueError`` whose message starts with the argument name, so that a
user sees *which* input is wrong, never a silent NaN or a broadcast to a wrong shape.

Validation that needs a device sync (finiteness at valid positions, 0/1 masks) can be
switched off for production throughput with :func:`trajgrad.validation`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

_ENABLED = True


@contextlib.contextmanager
def validation(enabled: bool) -> Iterator[None]:
    """Context manager that turns the value-dependent checks on or off.

    Shape checks always run; the checks that read tensor values (finite at valid positions,
    mask is 0/1) are skipped while ``enabled`` is False.
    """
    global _ENABLED
    previous = _ENABLED
    _ENABLED = bool(enabled)
    try:
        yield
    finally:
        _ENABLED = previous


def values_checked() -> bool:
    return _ENABLED


def as_tensor(name: str, x, *, dtype=None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x if dtype is None else x.to(dtype)
    try:
        return torch.as_tensor(x, dtype=dtype if dtype is not None else torch.get_default_dtype())
    except Exception as exc:  # pragma: no cover - message path
        raise ValueError(f"{name}: cannot convert {type(x).__name__} to a tensor ({exc})") from exc


def check_ndim(name: str, x: torch.Tensor, ndims: int | Sequence[int]) -> None:
    allowed = (ndims,) if isinstance(ndims, int) else tuple(ndims)
    if x.ndim not in allowed:
        want = " or ".join(f"{d}-D" for d in allowed)
        raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(x.shape)}")


def check_shape(name: str, x: torch.Tensor, shape: Sequence[int], *, against: str = "") -> None:
    if tuple(x.shape) != tuple(shape):
        extra = f" (the shape of {against})" if against else ""
        raise ValueError(f"{name}: expected shape {tuple(shape)}{extra}, got {tuple(x.shape)}")


def check_floating(name: str, x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")


def check_mask(name: str, mask, shape: Sequence[int] | None = None) -> torch.Tensor:
    """Validate a 0/1 mask and return it as a ``bool`` tensor."""
    mask = as_tensor(name, mask)
    if shape is not None:
        check_shape(name, mask, shape)
    if mask.dtype == torch.bool:
        return mask
    if _ENABLED:
        if mask.is_floating_point() and not torch.isfinite(mask).all():
            raise ValueError(f"{name}: must contain only 0 and 1, found NaN/inf")
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            value = mask[bad].flatten()[0].item()
            raise ValueError(f"{name}: must contain only 0 and 1, found {value}")
    return mask != 0


def check_finite(name: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise if ``x`` has NaN/inf where ``mask`` is True (everywhere when mask is None)."""
    if not _ENABLED or not x.is_floating_point():
        return
    with torch.no_grad():
        finite = torch.isfinite(x)
        if mask is not None:
            finite = finite | ~mask
        if not bool(finite.all()):
            where = "at a valid (mask=1) position" if mask is not None else ""
            raise ValueError(f"{name}: contains NaN or inf {where}".rstrip())


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok or value != value:
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name}: must be {kind}, got {value}")


def check_in_range(name: str, value: float, low: float, high: float, *, inclusive=(True, True)) -> None:
    lo_ok = value >= low if inclusive[0] else value > low
    hi_ok = value <= high if inclusive[1] else value < high
    if not (lo_ok and hi_ok) or value != value:
        lb = "[" if inclusive[0] else "("
        rb = "]" if inclusive[1] else ")"
        raise ValueError(f"{name}: must lie in {lb}{low}, {high}{rb}, got {value}")


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: must be one of {', '.join(map(repr, choices))}, got {value!r}")


def fill_masked(x: torch.Tensor, mask: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """``x`` where ``mask`` else ``value``, by selection (never multiplication).

    Call this on every per-token input *before* any nonlinear operation so that a NaN/inf
    stored at a masked position can reach neither the loss nor the gradient: the backward of
    ``torch.where`` routes zero to the unselected branch without multiplying by it.
    """
    return torch.where(mask, x, torch.as_tensor(value, dtype=x.dtype, device=x.device))


def per_token(name: str, x, shape: Sequence[int], mask: torch.Tensor, *, allow_per_sequence=False) -> torch.Tensor:
    """Validate a per-token tensor aligned with ``mask`` and zero its masked positions.

    With ``allow_per_sequence`` a ``[B]`` tensor is broadcast to ``[B, L]`` (one value per
    sequence, e.g. a response advantage).
    """
    x = as_tensor(name, x)
    check_floating(name, x)
    if allow_per_sequence and x.ndim == 1:
        check_shape(name, x, shape[:1])
        check_finite(name, x, mask.any(-1) if mask.ndim == 2 else None)
        x = x[:, None].expand(*shape)
    else:
        check_shape(name, x, shape, against="mask")
    check_finite(name, x, mask)
    return fill_masked(x, mask)


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    r"""``x`` in float32 when it is a 16-bit float (an attached cast), else ``x`` itself.

    Ratios are :math:`e^{z}` of log-ratios: float16 overflows from :math:`z\approx11.1`
    (:math:`e^{z}>65504`), so every loss and ratio computes in at least float32.
    """
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
