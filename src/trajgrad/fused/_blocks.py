"""Building blocks of the chunked kernels: reused buffers, head logits, shifted exponentials,
blocked row dot products (see :mod:`trajgrad.fused`)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics are formed in float32 at least (bf16/fp16 inputs are upcast)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


_DOT_BLOCK = 128


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product ``(a * b).sum(-1)`` without materializing ``a * b``.

    A single batched product accumulates all ``V`` terms of a row sequentially, which in
    float32 loses ~1e-4 relative accuracy at ``V ~ 1.5e5`` on softmax-weighted sums; blocks
    of 128 terms, whose partial sums are then added, keep it at the level of a pairwise sum
    and are no slower.
    """
    n, V = a.shape
    q = V // _DOT_BLOCK
    if q < 2:
        return torch.einsum("nv,nv->n", a, b)
    cut = q * _DOT_BLOCK
    out = torch.einsum("nqk,nqk->nq", _blocks_view(a, q), _blocks_view(b, q)).sum(-1)
    if cut < V:
        out = out + torch.einsum("nv,nv->n", a[:, cut:], b[:, cut:])
    return out


def _blocks_view(a: torch.Tensor, q: int) -> torch.Tensor:
    """``a[:, :q * 128]`` as ``[n, q, 128]``: a strided view (no copy) when rows are contiguous."""
    if a.stride(1) == 1:
        return a.as_strided((a.shape[0], q, _DOT_BLOCK), (a.stride(0), _DOT_BLOCK, 1))
    return a[:, : q * _DOT_BLOCK].reshape(a.shape[0], q, _DOT_BLOCK)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``b``'s dtype (the weight's), result in ``out_dtype``."""
    return (a.to(b.dtype) @ b).to(out_dtype)


class _Workspace:
    """Flat buffers reused by every chunk of one call, so the ``[n, V]`` temporaries are
    allocated (and page-faulted) once per call instead of once per chunk."""

    def __init__(self, numel: int, dtype: torch.dtype, device) -> None:
        self.numel, self.dtype, self.device = int(numel), dtype, device
        self.bufs: dict = {}

    def get(self, i: int, n: int, w: int) -> torch.Tensor:
        buf = self.bufs.get(i)
        if buf is None:
            buf = self.bufs[i] = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return buf[: n * w].view(n, w)


def _head_logits(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], inv_t: float,
                 out: torch.Tensor, v0: int = 0, v1: Optional[int] = None) -> torch.Tensor:
    """``out <- (x W[v0:v1]^T + b[v0:v1]) / T`` (``out`` is ``[n, v1 - v0]`` in the compute dtype)."""
    w = weight[v0:v1]
    x = x.to(w.dtype)
    if w.dtype == out.dtype:
        if bias is None:
            torch.mm(x, w.T, out=out)
        else:
            torch.addmm(bias[v0:v1].to(w.dtype), x, w.T, out=out)
    else:  # low-precision head: product in its dtype, statistics in float32
        out.copy_(x @ w.T if bias is None else torch.addmm(bias[v0:v1].to(w.dtype), x, w.T))
    return out.mul_(inv_t) if inv_t != 1.0 else out


def _side_logits(side, r: torch.Tensor, inv_t: float, out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Logits of rows ``r`` of a :class:`Head` into ``out``; also returns the rows read."""
    if side.weight is None:
        if side.x.dtype == out.dtype:
            torch.index_select(side.x, 0, r, out=out)
        else:
            out.copy_(side.x.index_select(0, r))
        return (out.mul_(inv_t) if inv_t != 1.0 else out), out
    x = side.x.index_select(0, r)
    return _head_logits(x, side.weight, side.bias, inv_t, out), x


def _exp_shifted(z: torch.Tensor, out: torch.Tensor):
    r"""``out <- exp(z - max z)`` per row; returns ``(out, max, sum)`` with ``[n, 1]`` statistics.

    :math:`\operatorname{lse}(z) = \max z + \log\sum_v e^{z_v-\max z}` and
    :math:`\pi = e^{z-\max z}/\sum`. (Written with in-place element-wise ops on a reused
    buffer: ``torch.logsumexp`` costs several passes and ``torch.softmax`` a fresh buffer.)
    """
    m = z.amax(-1, keepdim=True)
    torch.sub(z, m, out=out)
    out.exp_()
    return out, m, out.sum(-1, keepdim=True)


# Width of the vocabulary blocks of the sweeps over a chunk's logits: a block's few
# [chunk, width] temporaries stay in cache while every statistic is read off it.
_SWEEP = 2048


def _log_partition(z: torch.Tensor, tmp) -> torch.Tensor:
    r""":math:`\operatorname{lse}(z_n)=\max z_n+\log\sum_v e^{z_{n,v}-\max z_n}` per row, ``[n, 1]``.

    The exponentials are formed one block of :data:`_SWEEP` columns at a time in ``tmp(0, w)``
    and summed there (a pairwise sum in cache); the block sums are added up. Reads ``z``
    twice (maximum, sweep) and writes nothing of its size. (The fused ``log_softmax`` kernel
    accumulates the row sum in float32 lanes, which loses ~1e-4 of the sum at ``V ~ 1e5``.)
    """
    m = z.amax(1, keepdim=True)
    total = z.new_zeros(z.shape[0], 1)
    for v0, v1 in _chunks(z.shape[1], _SWEEP):
        e = torch.sub(z[:, v0:v1], m, out=tmp(0, v1 - v0)).exp_()
        total.add_(e.sum(1, keepdim=True))
    return m.add_(total.log_())


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _keep_graph() -> bool:
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except Exception:  # pragma: no cover - private API missing: be conservative
        return True


def _flat_rows(mask: Optional[torch.Tensor], n: int, device) -> torch.Tensor:
    if mask is None:
        return torch.arange(n, device=device)
    return mask.reshape(-1).nonzero().squeeze(1)

