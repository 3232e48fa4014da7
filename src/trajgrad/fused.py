r"""Log-probabilities, entropies and divergences from hidden states without holding ``[B, L, V]``.

A language-model head maps a hidden state :math:`h \in \mathbb R^H` to logits
:math:`z = (W h + b)/T` over a vocabulary of size :math:`V`. The naive path
``log_softmax(hidden @ W.T)`` materializes ``[B, L, V]`` logits, their log-softmax and,
in the backward pass, a gradient of the same size: at ``L = 4096`` and ``V = 151936`` that
is 2.5 GB per tensor in float32, several of them alive at once (§14: "full vocabulary
costs memory/bandwidth").

The functions here compute the same quantities *exactly* (same formula, float rounding
aside) while holding only a chunk of ``chunk_size`` positions' logits at a time:

=========================  ================================================================
``fused_token_logprobs``   :math:`\log\pi(y_n\mid h_n) = z_{n,y_n} - \operatorname{lse}(z_n)`
                           (§4), ``[B, L]``
``fused_entropy``          :math:`\mathcal H_n = \operatorname{lse}(z_n) - \sum_v \pi_{n,v} z_{n,v}`,
                           ``[B, L]``
=========================  ================================================================

Both are ``torch.autograd.Function`` s that save only their inputs and one or two floats per
position (the log-partition :math:`\operatorname{lse}(z_n)`, the entropy) and *recompute*
each chunk's logits in the backward pass. The gradients w.r.t. ``hidden``, ``weight`` and
``bias`` are the analytic ones,

.. math::

   \frac{\partial \log\pi(y_n)}{\partial z_{n,v}} = \mathbb 1[v=y_n]-\pi_{n,v},\qquad
   \frac{\partial \mathcal H_n}{\partial z_{n,v}} = -\pi_{n,v}\,(\log\pi_{n,v}+\mathcal H_n),

pushed through :math:`z = (Wh+b)/T` by two matrix products per chunk. Peak extra memory is
:math:`O(\text{chunk\_size}\cdot V)` instead of :math:`O(B L V)`: one ``[chunk_size, V]``
buffer for log-probs, two for entropies, reused by every chunk of a call (plus the
gradients themselves, e.g. ``[V, H]`` for the head). Cost: one matrix product per chunk
forward, three backward (the naive path: one + two), i.e. about 4/3 of the naive matrix
work. When only ``hidden`` needs a gradient (a frozen head, as in LoRA training) the
hidden-state gradient factor is formed in the forward pass instead and nothing is
recomputed: two products, as for the naive path.

**Masks.** With ``mask`` given, masked positions are never read (NaN/inf hidden rows there
cannot leak), produce 0, and receive exactly zero gradient; they cost no compute.

**Vocabulary chunking.** ``vocab_chunk_size`` additionally splits the vocabulary into
blocks and combines them with an online log-sum-exp (running maximum :math:`m`, running
:math:`s = \sum e^{z-m}`, rescaled by :math:`e^{m_{old}-m_{new}}` when the maximum grows).
Memory then is :math:`O(\text{chunk\_size}\cdot\text{vocab\_chunk\_size})`, independent of
:math:`V`. It helps only when even a small block of positions times the full vocabulary does
not fit (very large vocabularies on small accelerators); otherwise it is slower (more,
smaller matrix products and extra passes), so it is off by default. Lowering
``chunk_size`` is the first remedy: memory is linear in it, and down to ~128 positions the
products stay efficient.

**Divergences.** The kernel behind :mod:`trajgrad.losses.distill` lives here too
(:func:`weighted_divergence`). It differs in one respect: a distillation loss is a scalar
:math:`\sum_n \omega_n D_n` with known per-position weights :math:`\omega_n` (the
aggregation), so its gradient is formed in the *forward* chunk loop, while each chunk's
logits are at hand, and the backward pass only scales it by the incoming scalar. Nothing is
recomputed: forward + backward costs the same four matrix products as the naive path
(student and teacher logits, hidden-state and head gradients), and three
``[chunk_size, V]`` buffers for the reverse KL (four for the forward KL and the JSD).

**Precision.** Statistics are formed in float32 at least (bf16/fp16 inputs are upcast per
chunk); vocabulary-wide sums use pairwise-style blocked accumulation so that float32 results
match a float32 naive computation to ~1e-7 relative at ``V ~ 1.5e5``.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _checks

__all__ = ["fused_token_logprobs", "fused_entropy", "weighted_divergence", "head_entropy", "Head", "DIVERGENCES"]

DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")

# ----------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------


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
    out = torch.einsum("nqk,nqk->nq", a[:, :cut].reshape(n, q, _DOT_BLOCK),
                       b[:, :cut].reshape(n, q, _DOT_BLOCK)).sum(-1)
    if cut < V:
        out = out + torch.einsum("nv,nv->n", a[:, cut:], b[:, cut:])
    return out


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


# ----------------------------------------------------------------------------------------
# validation shared with losses/distill.py
# ----------------------------------------------------------------------------------------


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


def check_sizes(temperature: float, chunk_size: int, vocab_chunk_size: Optional[int] = None) -> None:
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise ValueError(f"temperature: expected a positive number, got {temperature!r}") from None
    _checks.check_positive("temperature", t)
    if math.isinf(t):
        raise ValueError(f"temperature: must be finite, got {t}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be a positive int, got {chunk_size!r}")
    if vocab_chunk_size is not None and (
            not isinstance(vocab_chunk_size, int) or isinstance(vocab_chunk_size, bool) or vocab_chunk_size < 1):
        raise ValueError(f"vocab_chunk_size: must be None or a positive int, got {vocab_chunk_size!r}")


# ----------------------------------------------------------------------------------------
# per-position log-probs and entropies (recompute in backward)
# ----------------------------------------------------------------------------------------


def _fold_onehot(G: torch.Tensor, y: torch.Tensor, v0: int, v1: int) -> None:
    """``G[n, y_n - v0] -= 1`` for the rows whose target lies in the block ``[v0, v1)``."""
    inside = ((y >= v0) & (y < v1)).nonzero().squeeze(1)
    if inside.numel():
        G[inside, y[inside] - v0] -= 1.0


class _PositionwiseFn(torch.autograd.Function):
    """Chunked log-prob (``kind='logprob'``) or entropy (``kind='entropy'``) per position.

    Sign convention inside: ``G = -(d out / d z)``, i.e. ``p - onehot(y)`` for log-probs
    and ``p (log p + H)`` for entropies.

    ``eager``: only ``hidden`` needs a gradient (a frozen head, e.g. LoRA training) and the
    vocabulary is one block. Then the per-row factor :math:`a_n = -(G_n W)/T` is formed in
    the forward pass (one extra product there) and the backward pass is a row scaling, with
    no recomputation: two matrix products in total, as for the naive path.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, kind, inv_t, chunk, vchunk, eager):
        cdt = _compute_dtype(hidden.dtype)
        dev = hidden.device
        V = weight.shape[0]
        n_rows = rows.numel()
        step = min(vchunk, V)
        single = step >= V
        eager = bool(eager and single)
        work = _Workspace(min(chunk, max(n_rows, 1)) * step, cdt, dev)
        out = torch.zeros(hidden.shape[0], dtype=cdt, device=dev)
        lse_all = torch.zeros(n_rows, dtype=cdt, device=dev)
        factor = torch.zeros(n_rows, hidden.shape[1], dtype=cdt, device=dev) if eager else None
        for a, b in _chunks(n_rows, chunk):
            r = rows[a:b]
            n = r.numel()
            h = hidden.index_select(0, r)
            y = targets.index_select(0, r) if kind == "logprob" else None
            if single:
                z = _head_logits(h, weight, bias, inv_t, work.get(0, n, V))
                if kind == "logprob":
                    zy = z.gather(1, y[:, None]).squeeze(1)
                    e, m, s = _exp_shifted(z, z)                      # in place: z is not needed again
                    lse = (m + s.log()).squeeze(1)
                    val = zy - lse
                    if eager:
                        G = e.div_(s)
                        _fold_onehot(G, y, 0, V)
                else:
                    e, m, s = _exp_shifted(z, work.get(1, n, V))
                    lse = (m + s.log()).squeeze(1)
                    val = lse - _row_dot(e, z) / s.squeeze(1)
                    if eager:
                        G = z.sub_((lse - val)[:, None]).mul_(e.div_(s))   # p (log p + H)
                if eager:
                    factor[a:b] = _mm(G, weight, cdt).mul_(-inv_t)
            else:  # vocabulary blocks, online log-sum-exp
                m = torch.full((n, 1), -math.inf, dtype=cdt, device=dev)
                s = torch.zeros(n, 1, dtype=cdt, device=dev)
                t = torch.zeros(n, dtype=cdt, device=dev)
                zy = torch.zeros(n, dtype=cdt, device=dev)
                for v0, v1 in _chunks(V, step):
                    zb = _head_logits(h, weight, bias, inv_t, work.get(0, n, v1 - v0), v0, v1)
                    if kind == "logprob":
                        inside = (y >= v0) & (y < v1)
                        local = (y - v0).clamp(0, v1 - v0 - 1)
                        zy = torch.where(inside, zb.gather(1, local[:, None]).squeeze(1), zy)
                    m_new = torch.maximum(m, zb.amax(-1, keepdim=True))
                    scale = torch.exp(m - m_new)                      # 0 on the first block
                    eb = torch.sub(zb, m_new, out=work.get(1, n, v1 - v0)).exp_()
                    s = s * scale + eb.sum(-1, keepdim=True)
                    if kind == "entropy":
                        t = t * scale.squeeze(1) + _row_dot(eb, zb)
                    m = m_new
                lse = (m + s.log()).squeeze(1)
                val = zy - lse if kind == "logprob" else lse - t / s.squeeze(1)
            lse_all[a:b] = lse
            out[r] = val
        ctx.save_for_backward(hidden, weight, bias, targets, rows, lse_all, out, factor)
        ctx.cfg = (kind, inv_t, chunk, step, cdt, eager)
        return out.to(hidden.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, rows, lse_all, out, factor = ctx.saved_tensors
        kind, inv_t, chunk, step, cdt, eager = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        V = weight.shape[0]
        n_rows = rows.numel()
        grad_out = grad_out.to(cdt)
        gh = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device) if need_h else None
        if eager:
            if gh is not None:
                gh.index_copy_(0, rows, factor * grad_out.index_select(0, rows)[:, None])
            return (None if gh is None else gh.to(hidden.dtype),) + (None,) * 9
        single = step >= V
        gw = None
        if need_w:   # with one vocabulary block the first chunk assigns it (no zero fill)
            gw = None if (single and n_rows) else torch.zeros(weight.shape, dtype=cdt, device=weight.device)
        gb = torch.zeros(V, dtype=cdt, device=weight.device) if (need_b and bias is not None) else None
        work = _Workspace(min(chunk, max(n_rows, 1)) * step, cdt, hidden.device)
        for a, b in _chunks(n_rows, chunk):
            r = rows[a:b]
            n = r.numel()
            h = hidden.index_select(0, r)
            gr = grad_out.index_select(0, r) * inv_t          # per-row scale of d out / d z
            neg_hw = h.to(cdt) * gr.neg()[:, None] if need_w else None
            lse = lse_all[a:b, None]
            shift = lse - out.index_select(0, r)[:, None] if kind == "entropy" else None   # lse - H
            y = targets.index_select(0, r) if kind == "logprob" else None
            gh_rows = None
            for v0, v1 in _chunks(V, step):
                zb = _head_logits(h, weight, bias, inv_t, work.get(0, n, v1 - v0), v0, v1)
                if kind == "logprob":
                    G = zb.sub_(lse).exp_()                           # p, in place
                    _fold_onehot(G, y, v0, v1)                        # p - onehot(y)
                else:
                    pb = torch.sub(zb, lse, out=work.get(1, n, v1 - v0)).exp_()
                    G = zb.sub_(shift).mul_(pb)                       # p (log p + H)
                if need_h:
                    part = _mm(G, weight[v0:v1], cdt)
                    gh_rows = part if gh_rows is None else gh_rows.add_(part)
                if need_w:
                    if gw is None:
                        gw = G.T @ neg_hw
                    else:
                        gw[v0:v1].addmm_(G.T, neg_hw)
                if gb is not None:
                    gb[v0:v1].addmv_(G.T, gr, alpha=-1.0)
            if need_h:
                gh.index_copy_(0, r, gh_rows.mul_(gr.neg()[:, None]))
        if need_w and gw is None:
            gw = torch.zeros(weight.shape, dtype=cdt, device=weight.device)
        return (None if gh is None else gh.to(hidden.dtype),
                None if gw is None else gw.to(weight.dtype),
                None if gb is None else gb.to(bias.dtype),
                None, None, None, None, None, None, None)


def _eager_hidden_only(hidden, weight, bias) -> bool:
    return (torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad
            and not (bias is not None and bias.requires_grad))


def _prepare_positionwise(hidden, weight, bias, mask, temperature, chunk_size, vocab_chunk_size):
    check_sizes(temperature, chunk_size, vocab_chunk_size)
    hidden = _checks.as_tensor("hidden", hidden)
    _checks.check_ndim("hidden", hidden, (2, 3))
    if mask is not None:
        mask = _checks.check_mask("mask", mask, hidden.shape[:-1])
    hidden, weight, bias = check_head("hidden", hidden, "weight", weight, "bias", bias, mask=mask)
    n = math.prod(hidden.shape[:-1])
    h2 = hidden.reshape(n, hidden.shape[-1])
    rows = _flat_rows(mask, n, hidden.device)
    V = weight.shape[0]
    vchunk = V if vocab_chunk_size is None else min(int(vocab_chunk_size), V)
    return h2, weight, bias, mask, rows, vchunk


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    mask: Optional[torch.Tensor] = None,
    vocab_chunk_size: Optional[int] = None,
) -> torch.Tensor:
    r"""Log-probabilities of ``targets`` from hidden states, never holding ``[B, L, V]`` logits.

    .. math::

       \ell_n = \log\operatorname{softmax}\Big(\frac{W h_n + b}{T}\Big)_{y_n}
              = z_{n,y_n} - \log\sum_v e^{z_{n,v}}, \qquad z_n = (W h_n + b)/T

    This equals ``log_softmax((hidden @ weight.T + bias) / T).gather(-1, targets)`` (§4's
    code alignment: ``hidden`` is the last hidden state at the positions that *predict*
    ``targets = input_ids[:, 1:]``), computed ``chunk_size`` positions at a time inside a
    custom autograd Function that saves its inputs and one log-partition per position and
    recomputes each chunk's logits in the backward pass. Gradients w.r.t. ``hidden``,
    ``weight`` and ``bias`` are exact:
    :math:`\partial\ell_n/\partial z_{n,v} = \mathbb 1[v=y_n]-\pi_{n,v}`.

    Cost: forward one matrix product per chunk; backward three (recompute, hidden
    gradient, weight gradient), against one + two for the naive path. With a frozen head
    (only ``hidden`` requires grad) the hidden gradient factor is formed in the forward
    pass (two products in all, no recomputation). Memory: one reused
    ``[chunk_size, V]`` buffer (or ``chunk_size * vocab_chunk_size``) beyond the inputs and
    the gradients.

    Args:
      hidden: ``[B, L, H]`` or ``[N, H]`` hidden states (attached).
      weight: ``[V, H]`` output-head weight (attached; a tied embedding works as is).
      targets: integer ``[B, L]`` or ``[N]``, values in ``[0, V)`` at valid positions
        (anything, e.g. ``-100``, at masked ones).
      bias: optional ``[V]`` head bias.
      temperature: :math:`T > 0`; the sampling temperature whose distribution is wanted.
      chunk_size: positions per chunk (larger amortizes the matrix products, smaller
        lowers the peak memory, ``chunk_size * V`` floats; at ``V ~ 1.5e5`` on a CPU
        128-256 keeps the products efficient at ~80-160 MB).
      mask: optional ``[B, L]``/``[N]`` 0/1 mask; masked positions are skipped (no compute,
        output 0, zero gradient, NaN in their hidden rows never read).
      vocab_chunk_size: optional block size over the vocabulary (online log-sum-exp; see
        the module docstring). ``None`` = the whole vocabulary at once.

    Returns:
      ``targets``-shaped log-probabilities in ``hidden``'s dtype (statistics are formed in
      float32 at least), 0 at masked positions.
    """
    hidden_t = _checks.as_tensor("hidden", hidden)
    _checks.check_ndim("hidden", hidden_t, (2, 3))
    targets = _checks.as_tensor("targets", targets)
    if targets.is_floating_point() or targets.dtype == torch.bool or targets.is_complex():
        raise ValueError(f"targets: expected an integer tensor, got dtype {targets.dtype}")
    _checks.check_shape("targets", targets, hidden_t.shape[:-1], against="hidden without its last dimension")
    h2, weight, bias, mask, rows, vchunk = _prepare_positionwise(
        hidden_t, weight, bias, mask, temperature, chunk_size, vocab_chunk_size)
    y = targets.reshape(-1).to(torch.long)
    V = weight.shape[0]
    if rows.numel():
        yv = y.index_select(0, rows)
        if bool(((yv < 0) | (yv >= V)).any()):
            bad = yv[(yv < 0) | (yv >= V)][0].item()
            raise ValueError(f"targets: values must lie in [0, {V}) at valid positions, found {bad}")
    out = _PositionwiseFn.apply(h2, weight, bias, y, rows, "logprob", 1.0 / float(temperature),
                                int(chunk_size), vchunk, _eager_hidden_only(h2, weight, bias))
    return out.reshape(targets.shape)


def fused_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    mask: Optional[torch.Tensor] = None,
    vocab_chunk_size: Optional[int] = None,
) -> torch.Tensor:
    r"""Entropy of :math:`\operatorname{softmax}((W h_n + b)/T)` per position, chunked.

    .. math::

       \mathcal H_n = -\sum_v \pi_{n,v}\log\pi_{n,v}
                    = \operatorname{lse}(z_n) - \sum_v \pi_{n,v} z_{n,v},\qquad
       \frac{\partial\mathcal H_n}{\partial z_{n,v}} = -\pi_{n,v}(\log\pi_{n,v}+\mathcal H_n)

    Same scheme and arguments as :func:`fused_token_logprobs` (no targets): saves the
    inputs plus ``lse`` and :math:`\mathcal H` per position, recomputes logits in backward.

    Returns:
      ``hidden.shape[:-1]`` entropies in nats, 0 at masked positions.
    """
    hidden_t = _checks.as_tensor("hidden", hidden)
    _checks.check_ndim("hidden", hidden_t, (2, 3))
    h2, weight, bias, mask, rows, vchunk = _prepare_positionwise(
        hidden_t, weight, bias, mask, temperature, chunk_size, vocab_chunk_size)
    out = _PositionwiseFn.apply(h2, weight, bias, None, rows, "entropy", 1.0 / float(temperature),
                                int(chunk_size), vchunk, _eager_hidden_only(h2, weight, bias))
    return out.reshape(hidden_t.shape[:-1])


# ----------------------------------------------------------------------------------------
# divergences between a student and a teacher head (gradient formed in forward)
# ----------------------------------------------------------------------------------------


class Head(NamedTuple):
    """One side of a divergence: ``x`` are logits ``[N, V]`` (``weight`` None) or hidden
    states ``[N, H]`` read through ``weight [V, H]`` and ``bias [V]``."""

    x: torch.Tensor
    weight: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None

    @property
    def vocab(self) -> int:
        return int(self.x.shape[-1] if self.weight is None else self.weight.shape[0])


def _log_mix(x: torch.Tensor, w: float) -> torch.Tensor:
    r""":math:`f(x, w) = \log\big((1-w) + w e^{x}\big)` elementwise, accurately for every ``w``.

    For :math:`|x|\le 1`, ``log1p(w * expm1(x))`` keeps the relative precision of a small
    result (``w`` near 0 or ``x`` near 0); elsewhere the ``logaddexp`` form cannot overflow
    and has no cancellation. ``f(x, 0) = 0`` and ``f(x, 1) = x``.
    """
    if w == 0.0:
        return torch.zeros_like(x)
    if w == 1.0:
        return x.clone()
    near = x.abs() <= 1.0
    small = torch.log1p(torch.expm1(x.clamp(-1.0, 1.0)).mul_(w))
    big = torch.logaddexp(x + math.log(w), torch.full_like(x, math.log1p(-w)))
    return torch.where(near, small, big)


def _log_mix_over_w(x: torch.Tensor, w: float) -> torch.Tensor:
    """``f(x, w) / w`` with its limit ``expm1(x)`` at ``w = 0``."""
    if w == 0.0:
        return torch.expm1(x)
    return _log_mix(x, w).div_(w)


def _divergence_chunk(zs, zt, pbuf, qbuf, kind, beta, normalized, need_grad):
    """Per-row divergence, student/teacher entropies and d(divergence)/d(zs) for one chunk.

    ``zs``, ``zt``: temperature-scaled logits ``[n, V]`` (overwritten); ``pbuf``/``qbuf``:
    ``[n, V]`` workspaces (``qbuf`` unused by the reverse KL, which thus needs three
    buffers). Notation: ``ls = log pi_s``, ``lt = log pi_t``, ``e = ls - lt``.

    Returns ``(div, ent_s, ent_t, G, row_scale)``: the gradient w.r.t. ``zs`` is
    ``G * row_scale[:, None]`` (``row_scale`` None means 1), so a per-row normalization
    can ride on the later ``[n, H]`` products instead of a pass over ``[n, V]``.
    """
    et, mt, st = _exp_shifted(zt, pbuf)                 # exp(zt - max)
    lse_t = mt + st.log()
    ent_t = lse_t.squeeze(1) - _row_dot(et, zt) / st.squeeze(1)
    pt = None
    if kind != "reverse_kl":
        pt = et.div_(st)
    es, ms, ss = _exp_shifted(zs, pbuf if pt is None else qbuf)
    lse_s = ms + ss.log()
    ent_s = lse_s.squeeze(1) - _row_dot(es, zs) / ss.squeeze(1)
    e = zs.sub_(zt).sub_(lse_s - lse_t)                 # ls - lt, in zs's buffer
    grad, row_scale = None, None
    if kind == "reverse_kl":
        inv_s = ss.squeeze(1).reciprocal()
        div = _row_dot(es, e) * inv_s                    # sum ps (ls - lt)
        if need_grad:                                    # ps * ((ls - lt) - KL) = es * (e - KL) / s
            grad, row_scale = e.sub_(div[:, None]).mul_(es), inv_s
        return div, ent_s, ent_t, grad, row_scale
    ps = es.div_(ss)
    if kind == "forward_kl":
        div = -_row_dot(pt, e)                           # sum pt (lt - ls)
        if need_grad:                                    # ps - pt
            grad = ps.sub_(pt)
    else:  # generalized JSD, mixture m = beta * pt + (1 - beta) * ps
        if normalized:
            a = _log_mix_over_w(e.neg(), beta)           # (log m - ls) / beta
            b = _log_mix_over_w(e, 1.0 - beta)           # (log m - lt) / (1 - beta)
            ka = _row_dot(ps, a)
            div = -_row_dot(pt, b) - ka                  # KL(pt||m)/(1-beta) + KL(ps||m)/beta
            if need_grad:                                # ps * (E_ps[a] - a)
                grad = a.neg_().add_(ka[:, None]).mul_(ps)
        else:
            a = _log_mix(e.neg(), beta)                  # log m - ls
            b = _log_mix(e, 1.0 - beta)                  # log m - lt
            ka = _row_dot(ps, a)
            div = -beta * _row_dot(pt, b) - (1.0 - beta) * ka
            if need_grad:                                # (1 - beta) ps (E_ps[a] - a)
                grad = a.neg_().add_(ka[:, None]).mul_(ps).mul_(1.0 - beta)
    return div, ent_s, ent_t, grad, row_scale


class _DivergenceFn(torch.autograd.Function):
    """``sum_jobs sum_n omega_n D(pi_s(.|n) || pi_t(.|n))``; the gradient is formed in forward.

    ``jobs`` is a list of ``(teacher Head, rows, omega)`` with detached tensors (teachers
    need no gradient, so they travel as plain Python data); one gradient accumulator is
    shared by all of them.
    """

    @staticmethod
    def forward(ctx, s_x, s_w, s_b, jobs, cfg):
        kind, beta, normalized, inv_t, chunk, need_x, need_w, need_b = cfg
        cdt = _compute_dtype(s_x.dtype)
        dev = s_x.device
        need = need_x or need_w or need_b
        gx = torch.zeros(s_x.shape, dtype=cdt, device=dev) if need_x else None
        gw = torch.zeros(s_w.shape, dtype=cdt, device=dev) if need_w else None
        gb = torch.zeros(s_b.shape, dtype=cdt, device=dev) if need_b else None
        loss = torch.zeros((), dtype=cdt, device=dev)
        divs, ents_s, ents_t = [], [], []
        V = s_x.shape[1] if s_w is None else s_w.shape[0]
        longest = max([int(rows.numel()) for _, rows, _ in jobs] + [1])
        work = _Workspace(min(chunk, longest) * V, cdt, dev)
        for teacher, rows, omega in jobs:
            n = rows.numel()
            div_all = torch.zeros(n, dtype=cdt, device=dev)
            ent_s_all = torch.zeros(n, dtype=cdt, device=dev)
            ent_t_all = torch.zeros(n, dtype=cdt, device=dev)
            omega = omega.to(device=dev, dtype=cdt)
            for a, b in _chunks(n, chunk):
                r = rows[a:b]
                m = r.numel()
                zs, xs = _side_logits(Head(s_x, s_w, s_b), r, inv_t, work.get(0, m, V))
                zt, _ = _side_logits(teacher, r, inv_t, work.get(1, m, V))
                div, es, et, G, row_scale = _divergence_chunk(
                    zs, zt, work.get(2, m, V), work.get(3, m, V) if kind != "reverse_kl" else None,
                    kind, beta, normalized, need)
                div_all[a:b] = div
                ent_s_all[a:b] = es
                ent_t_all[a:b] = et
                om = omega[a:b]
                loss = loss + torch.dot(om, div)
                if G is None:
                    continue
                scale = om * inv_t                 # d(omega_n D_n)/dz = omega_n G_n; z = (.)/T
                if row_scale is not None:
                    scale = scale * row_scale
                if s_w is None:
                    gx.index_copy_(0, r, G.mul_(scale[:, None]))
                    continue
                if need_x:
                    gx.index_copy_(0, r, _mm(G, s_w, cdt).mul_(scale[:, None]))
                if need_w:
                    gw.addmm_(G.T, xs.to(cdt) * scale[:, None])
                if need_b:
                    gb.addmv_(G.T, scale)
            divs.append(div_all)
            ents_s.append(ent_s_all)
            ents_t.append(ent_t_all)
        ctx.grads = [gx, gw, gb]
        ctx.dtypes = (s_x.dtype, None if s_w is None else s_w.dtype, None if s_b is None else s_b.dtype)
        div_cat, es_cat, et_cat = torch.cat(divs), torch.cat(ents_s), torch.cat(ents_t)
        ctx.mark_non_differentiable(div_cat, es_cat, et_cat)
        return loss.to(s_x.dtype), div_cat, es_cat, et_cat

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, *_unused):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("weighted_divergence: the saved gradient was already consumed; "
                               "call backward(retain_graph=True) to backpropagate more than once")
        keep = _keep_graph()
        if not keep:
            ctx.grads = None  # hand the buffers over: no copy when the graph is freed
        c = grad_loss.detach()
        unit = bool(c == 1)
        out = []
        for g, dt in zip(grads, ctx.dtypes):
            if g is None:
                out.append(None)
                continue
            if not unit:
                g = g * c.to(g.dtype) if keep else g.mul_(c.to(g.dtype))
            out.append(g.to(dt) if dt is not None and g.dtype != dt else g)
        return out[0], out[1], out[2], None, None


def weighted_divergence(
    student: Head,
    jobs: Sequence[Tuple[Head, torch.Tensor, torch.Tensor]],
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    normalized: bool = True,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> Tuple[torch.Tensor, List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
    r"""Chunked :math:`\sum_{(t, R, \omega)}\sum_{n\in R}\omega_n D(\pi_s(\cdot|n)\Vert\pi_t(\cdot|n))`.

    The low-level kernel behind :mod:`trajgrad.losses.distill`; it does no validation and
    expects flattened inputs. ``jobs`` lists ``(teacher, rows, omega)``: ``rows`` (``[n]``
    long) index the flattened positions of ``student.x`` / ``teacher.x`` (``[N, .]``),
    ``omega`` (``[n]``) are their loss weights. Teachers are detached here. For each chunk
    of rows it forms both logits and the divergence

    * ``reverse_kl``: :math:`D=\sum_v\pi_s(\log\pi_s-\log\pi_t)`, gradient w.r.t. the
      student logits :math:`\pi_s\odot(\log\pi_s-\log\pi_t-D)`;
    * ``forward_kl``: :math:`D=\sum_v\pi_t(\log\pi_t-\log\pi_s)`, gradient
      :math:`\pi_s-\pi_t`;
    * ``jsd``: :math:`D=\beta\,\mathrm{KL}(\pi_t\Vert m)+(1-\beta)\,\mathrm{KL}(\pi_s\Vert m)`
      with :math:`m=\beta\pi_t+(1-\beta)\pi_s`, divided by :math:`\beta(1-\beta)` when
      ``normalized`` (continuous limits at the ends), gradient
      :math:`(1-\beta)\,\pi_s\odot(\log\pi_s-\log m-\mathrm{KL}(\pi_s\Vert m))`
      (likewise divided);

    and, when the student requires grad and grad mode is on, accumulates the gradient of
    :math:`\omega_n D_n` w.r.t. the student's hidden rows, weight and bias (or logits)
    into one buffer per parameter, which the backward pass scales by the incoming scalar.

    Returns:
      ``(loss, divs, student_entropies, teacher_entropies)``: a scalar attached to the
      student, and per job a detached ``[n]`` tensor of each statistic.
    """
    _checks.check_choice("kind", kind, DIVERGENCES)
    grad_on = torch.is_grad_enabled()
    need_x = grad_on and student.x.requires_grad
    need_w = grad_on and student.weight is not None and student.weight.requires_grad
    need_b = grad_on and student.bias is not None and student.bias.requires_grad
    cfg = (kind, float(beta), bool(normalized), 1.0 / float(temperature), int(chunk_size), need_x, need_w, need_b)
    plain = []
    for teacher, rows, omega in jobs:
        plain.append((Head(teacher.x.detach(),
                           None if teacher.weight is None else teacher.weight.detach(),
                           None if teacher.bias is None else teacher.bias.detach()),
                      rows, omega.detach()))
    loss, div, es, et = _DivergenceFn.apply(student.x, student.weight, student.bias, plain, cfg)
    sizes = [int(rows.numel()) for _, rows, _ in jobs]
    return loss, list(div.split(sizes)), list(es.split(sizes)), list(et.split(sizes))


def head_entropy(side: Head, rows: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """Detached entropies ``[n]`` of ``softmax(logits / T)`` at ``rows`` of one head (chunked)."""
    inv_t = 1.0 / float(temperature)
    cdt = _compute_dtype(side.x.dtype)
    n_rows = rows.numel()
    out = torch.zeros(n_rows, dtype=cdt, device=side.x.device)
    work = _Workspace(min(chunk_size, max(n_rows, 1)) * side.vocab, cdt, side.x.device)
    with torch.no_grad():
        for a, b in _chunks(n_rows, chunk_size):
            n = b - a
            z, _ = _side_logits(side, rows[a:b], inv_t, work.get(0, n, side.vocab))
            e, m, s = _exp_shifted(z, work.get(1, n, side.vocab))
            out[a:b] = (m + s.log()).squeeze(1) - _row_dot(e, z) / s.squeeze(1)
    return out
