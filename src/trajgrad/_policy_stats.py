r"""The policy-ratio statistics behind :func:`trajgrad.diagnostics.policy_metrics` and the losses' metrics.

One pass over the log-ratios of the valid tokens: ``tokens``, ``ratio/mean|min|max``, ``kl/k1``,
``kl/k3``, the clip fractions by advantage sign and side, and (when asked for) the log-ratio
quantiles; the clip bounds in log space (:func:`log_bound`); the valid extrema; the switch that
makes the losses report quantiles (:func:`loss_quantiles`). The formulas are documented on
:func:`trajgrad.diagnostics.policy_metrics`, which re-exports the public names.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from typing import Dict, Iterator, Optional

import torch

from . import _checks

# torch.quantile refuses inputs with more than 2**24 elements; larger inputs use a sort.
_QUANTILE_LIMIT = 1 << 24
QUANTILES = {"q01": 0.01, "q50": 0.50, "q99": 0.99}


def _metric_dtype(x: torch.Tensor) -> torch.Tensor:
    """Reduced-precision inputs are summarized in float32 (quantile needs float/double)."""
    if x.dtype in (torch.float32, torch.float64):
        return x
    return x.float()


def _quantiles(values: torch.Tensor) -> torch.Tensor:
    """Linear-interpolation quantiles ``QUANTILES`` of a 1-D tensor with at least 1 entry."""
    q = torch.tensor(list(QUANTILES.values()), dtype=values.dtype, device=values.device)
    if values.numel() <= _QUANTILE_LIMIT:
        return torch.quantile(values, q)
    ordered = torch.sort(values).values
    pos = q * (ordered.numel() - 1)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    frac = pos - lo.to(pos.dtype)
    return ordered[lo] + frac * (ordered[hi] - ordered[lo])


def log_bound(name: str, eps: float, side: str) -> float:
    """``log(1 - eps)`` (side 'low', -inf at eps = 1) or ``log(1 + eps)`` (side 'high')."""
    if side == "low":
        _checks.check_in_range(name, float(eps), 0.0, 1.0, inclusive=(False, True))
        return math.log1p(-float(eps)) if eps < 1.0 else -math.inf
    _checks.check_positive(name, float(eps))
    if not math.isfinite(float(eps)):
        raise ValueError(f"{name}: must be finite, got {eps}")
    return math.log1p(float(eps))




QUANTILE_POSITIONS = 4096
_SAMPLE_CACHE: Dict[tuple, torch.Tensor] = {}
_LOSS_QUANTILES = False


@contextlib.contextmanager
def loss_quantiles(enabled: bool = True) -> Iterator[None]:
    """Context manager: the policy losses' metrics also report ``log_ratio/q01|q50|q99``.

    Off by default: a loss's metrics are sums and extrema only (each costs one read of the
    batch), while quantiles need a selection of the valid tokens. :func:`policy_metrics`
    always reports them. Usage: ``with trajgrad.diagnostics.loss_quantiles(): loss = ...``.
    """
    global _LOSS_QUANTILES
    previous = _LOSS_QUANTILES
    _LOSS_QUANTILES = bool(enabled)
    try:
        yield
    finally:
        _LOSS_QUANTILES = previous


def loss_quantiles_enabled() -> bool:
    """Whether the policy losses' metrics report log-ratio quantiles now (:func:`loss_quantiles`)."""
    return _LOSS_QUANTILES


def rereads(z: torch.Tensor) -> bool:
    """Whether the losses' metrics of ``z`` read its values even when given its sums and valid extrema
    (quantiles asked for by :func:`loss_quantiles`, or a small CPU tensor summarized by the interpreter)."""
    return _LOSS_QUANTILES or (z.numel() <= _SMALL and z.device.type == "cpu")


def _sample_positions(numel: int, device) -> torch.Tensor:
    """A fixed (seeded) sample of ``QUANTILE_POSITIONS`` flat positions of a tensor."""
    key = (numel, str(device))
    idx = _SAMPLE_CACHE.get(key)
    if idx is None:
        g = torch.Generator().manual_seed(0x7A11)
        idx = torch.randperm(numel, generator=g)[:QUANTILE_POSITIONS].sort().values.to(device)
        if len(_SAMPLE_CACHE) > 16:
            _SAMPLE_CACHE.clear()
        _SAMPLE_CACHE[key] = idx
    return idx


def _sampled_quantiles(z: torch.Tensor, maskf: torch.Tensor) -> Optional[torch.Tensor]:
    flat_z = z.reshape(-1)
    flat_m = maskf.reshape(-1)
    if flat_z.numel() > QUANTILE_POSITIONS:
        idx = _sample_positions(flat_z.numel(), flat_z.device)
        valid = torch.take(flat_z, idx)[torch.take(flat_m, idx) != 0]
        if valid.numel() == 0:  # the sample missed every valid token: use them all
            valid = flat_z[flat_m != 0]
    else:
        valid = flat_z[flat_m != 0]
    return _quantiles(valid) if valid.numel() else None


def _masked_extrema(z: torch.Tensor, maskf: torch.Tensor) -> tuple:
    """``(min, max)`` of ``z`` over the valid slots as Python floats (``(0.0, 0.0)`` when there is none)."""
    mask = maskf != 0
    if not bool(mask.any()):
        return 0.0, 0.0
    inf = torch.full((), float("inf"), dtype=z.dtype, device=z.device)
    return tuple(torch.stack([torch.where(mask, z, inf).amin(), torch.where(mask, z, -inf).amax()]).tolist())


def valid_extrema(z: torch.Tensor, maskf: torch.Tensor, n: torch.Tensor):
    """(min, max) of ``z`` over valid slots as 0-D tensors; ``z`` is 0 at masked slots.

    The extrema of the whole tensor are those of the valid entries unless a masked 0 could
    be the extremum (all valid entries on one side of 0): only then is the mask applied.
    """
    if z.numel() == 0:
        zero = torch.zeros((), dtype=z.dtype, device=z.device)
        return zero, zero
    lo, hi = torch.aminmax(z)
    full = int(n.item()) == z.numel()
    if not full and (float(lo) == 0.0 or float(hi) == 0.0):
        lo, hi = (torch.tensor(v, dtype=z.dtype, device=z.device) for v in _masked_extrema(z, maskf))
    return lo, hi


def valid_extrema_floats(z: torch.Tensor, maskf: torch.Tensor, n: float) -> tuple:
    """``(min, max)`` of ``z`` (0 at masked slots) over the ``n`` valid slots, as Python floats: those of
    the whole tensor unless a masked 0 could be the extremum."""
    if z.numel() == 0:
        return 0.0, 0.0
    lo, hi = _floats(torch.aminmax(z))
    if n != z.numel() and (lo == 0.0 or hi == 0.0):
        return _masked_extrema(z, maskf.to(z.dtype))
    return lo, hi


def _floats(parts, device: Optional[torch.device] = None) -> list:
    """Python floats of 0-D tensors (on ``device``, default that of the first): read one by one on the CPU
    (a read costs less than a stack), in one transfer from an accelerator."""
    if not parts:
        return []
    if (parts[0].device if device is None else device).type == "cpu":
        return [float(p) for p in parts]
    return torch.stack([p.detach().reshape(()).to(torch.float64) for p in parts]).tolist()


def _exp(v: float) -> float:
    """``math.exp`` that overflows to ``inf`` as the tensor op does."""
    return math.exp(v) if v < 709.0 else math.inf


def fast_policy_metrics(
    z: torch.Tensor,
    adv: Optional[torch.Tensor],
    mask: torch.Tensor,
    maskf: torch.Tensor,
    tokens: torch.Tensor,
    *,
    ratio: Optional[torch.Tensor] = None,
    lo_b: Optional[float] = None,
    hi_b: Optional[float] = None,
    prefix: str = "",
    quantiles: Optional[bool] = None,
    sum_z: Optional[torch.Tensor] = None,
    em1: Optional[torch.Tensor] = None,
    sum_em1: Optional[torch.Tensor] = None,
    extrema: Optional[tuple] = None,
    means: Optional[Dict[str, object]] = None,
) -> Dict[str, torch.Tensor]:
    """:func:`policy_metrics` on sanitized inputs: ``z`` and ``adv`` exactly 0 at masked slots.

    ``maskf`` is the 0/1 mask as floats (``mask``, the bool one, is not read), ``tokens`` its sum;
    ``adv`` is read only for the clip fractions (``lo_b`` given). What the caller has already formed
    saves a pass: ``sum_z`` (the sum of ``z``), ``em1`` (``torch.expm1(z)`` in ``z``'s dtype; a loss
    whose weight is the ratio derives it from this one transcendental pass) or ``sum_em1`` (its sum),
    ``extrema``: ``(min, max)`` of the whole ``z`` as 0-D tensors, or of its valid entries as Python
    floats (:func:`valid_extrema_floats`; ``z`` is then not read again unless quantiles are asked
    for, and the caller may reuse its memory). ``means``: more keys,
    each given as a sum over the valid tokens (0-D tensor or float) and reported as its mean.

    Every statistic over ``[B, L]`` is one sum or extremum (no boolean indexing, no sort of all
    tokens); the scalars are gathered in one transfer and combined by the interpreter in float64
    (a few dozen operations on 0-D tensors cost more than a pass over the batch), then returned as
    0-D tensors of ``z``'s dtype.
    """
    with torch.no_grad():
        z = _metric_dtype(z.detach())
        want_q = _LOSS_QUANTILES if quantiles is None else quantiles
        if z.numel() <= _SMALL and z.device.type == "cpu" and not want_q:
            out = _small_policy_metrics(z, adv, maskf, lo_b, hi_b)
            if means:
                d = max(float(out["tokens"]), 1.0)
                out.update((k, torch.tensor(float(v) / d, dtype=z.dtype)) for k, v in means.items())
            return {prefix + k: v for k, v in out.items()} if prefix else out
        dt, dev = z.dtype, z.device
        if sum_em1 is None:
            sum_em1 = (torch.expm1(z) if em1 is None else em1.detach()).sum()
        parts = [tokens, z.sum() if sum_z is None else sum_z.detach(), sum_em1]
        if extrema is None:
            extrema = torch.aminmax(z) if z.numel() else (0.0, 0.0)
        floats = not isinstance(extrema[0], torch.Tensor)
        parts += [v for v in extrema if isinstance(v, torch.Tensor)]
        if lo_b is not None:
            # indicators by arithmetic (a comparison kernel costs ~4 multiplies here):
            # relu(sign(x)) is 1 exactly where x > 0, so the strict inequalities hold at the bounds
            sgn = torch.sign(adv.to(dt))
            pos = sgn.clamp(min=0.0).reshape(-1)
            neg = sgn.neg_().clamp_(min=0.0).reshape(-1)
            high = (z - hi_b).sign_().relu_().reshape(-1)  # masked slots hold z = 0, inside every range
            low = (lo_b - z).sign_().relu_().reshape(-1)
            parts += [torch.dot(pos, high), torch.dot(pos, low), torch.dot(neg, high), torch.dot(neg, low),
                      high.sum(), low.sum()]
        extra = [(k, v) for k, v in (means or {}).items()]
        parts += [v for _, v in extra if isinstance(v, torch.Tensor)]
        vals = _floats(parts, dev)
        n, sz, se = vals[0], vals[1], vals[2]
        k = 3
        ext = []
        for v in extrema:
            if isinstance(v, torch.Tensor):
                ext.append(vals[k])
                k += 1
            else:
                ext.append(float(v))
        zmin, zmax = ext
        if not floats and n != z.numel() and (zmin == 0.0 or zmax == 0.0):
            # a masked 0 could be the extremum (every valid entry on one side of 0): apply the mask
            zmin, zmax = _masked_extrema(z, maskf.to(dt))
        d = max(n, 1.0)
        has = n > 0
        keys = ["tokens", "ratio/mean", "ratio/min", "ratio/max"]
        values = [n, (se + n) / d if has else 1.0, _exp(zmin) if has else 1.0, _exp(zmax) if has else 1.0]
        qs = _sampled_quantiles(z, maskf.to(dt)) if want_q else None
        tail_keys = ["kl/k1", "kl/k3"]
        tail = [-sz / d, max(se - sz, 0.0) / d]
        if lo_b is not None:
            ph, pl, nh, nl, hs, ls = vals[k:k + 6]
            k += 6
            tail_keys += ["clip_frac/pos_high", "clip_frac/pos_low", "clip_frac/neg_high", "clip_frac/neg_low",
                          "clip_frac", "ratio/out_of_range_frac"]
            tail += [ph / d, pl / d, nh / d, nl / d, ph / d + nl / d, (hs + ls) / d]
        for key, v in extra:
            tail_keys.append(key)
            if isinstance(v, torch.Tensor):
                tail.append(vals[k] / d)
                k += 1
            else:
                tail.append(float(v) / d)
        scalars = torch.tensor(values + tail, dtype=dt, device=dev).unbind()
        out: Dict[str, torch.Tensor] = dict(zip(keys, scalars[:4]))
        if want_q:
            zero = torch.zeros((), dtype=dt, device=dev)
            for i, key in enumerate(QUANTILES):
                out[f"log_ratio/{key}"] = zero.clone() if qs is None else qs[i]
        out.update(zip(tail_keys, scalars[4:]))
    if prefix:
        out = {prefix + k: v for k, v in out.items()}
    return out


# below this many entries (one per sequence: GSPO, GMPO, sequence-level SAPO) the metrics are
# computed in float64 by the interpreter from one copy of the values: some fifty tensor
# operations on a handful of numbers cost more in dispatch than the arithmetic
_SMALL = 256


def _small_policy_metrics(z: torch.Tensor, adv: torch.Tensor, maskf: torch.Tensor, lo_b, hi_b) -> Dict[str, torch.Tensor]:
    """The keys and formulas of :func:`fast_policy_metrics` for a small CPU ``z`` (0 at masked slots)."""
    advs = adv.reshape(-1).tolist() if lo_b is not None else None
    return list_policy_metrics(z.reshape(-1).tolist(), maskf.reshape(-1).tolist(), advs, lo_b, hi_b, z.dtype,
                               z.device)


def list_policy_metrics(zs, ms, advs, lo_b, hi_b, dtype, device) -> Dict[str, torch.Tensor]:
    """:func:`_small_policy_metrics` on Python lists a caller already holds (``zs`` log ratios, 0 where ``ms``
    is 0; ``advs`` read only with ``lo_b``), in float64, returned as 0-D tensors of ``dtype``."""
    dt = dtype
    valid = list(itertools.compress(zs, ms))
    n = float(len(valid))
    d = max(n, 1.0)
    sum_z = math.fsum(valid)
    try:
        sum_em1 = math.fsum(map(math.expm1, valid))
    except OverflowError:  # e^z beyond the largest double
        sum_em1 = math.inf
    has = n > 0
    keys = ["tokens", "ratio/mean", "ratio/min", "ratio/max", "kl/k1", "kl/k3"]
    vals = [n, (sum_em1 + n) / d if has else 1.0, _exp(min(valid)) if has else 1.0, _exp(max(valid)) if has else 1.0,
            -sum_z / d, max(sum_em1 - sum_z, 0.0) / d]
    if lo_b is not None:
        ph = pl = nh = nl = 0
        # only the entries outside the range count (masked slots: z = 0 inside every range, A = 0)
        outside = [(v > hi_b, a) for v, a in zip(zs, advs) if v > hi_b or v < lo_b]
        for h, a in outside:
            if a > 0:
                ph += h
                pl += not h
            elif a < 0:
                nh += h
                nl += not h
        high = sum(h for h, _ in outside)
        low = len(outside) - high
        keys += ["clip_frac/pos_high", "clip_frac/pos_low", "clip_frac/neg_high", "clip_frac/neg_low", "clip_frac",
                 "ratio/out_of_range_frac"]
        vals += [ph / d, pl / d, nh / d, nl / d, (ph + nl) / d, (high + low) / d]
    return dict(zip(keys, torch.tensor(vals, dtype=dt, device=device).unbind()))
