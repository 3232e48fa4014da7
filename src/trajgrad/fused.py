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
:math:`O(\text{chunk\_size}\cdot V)` instead of :math:`O(B L V)`.

**Masks.** With ``mask`` given, masked positions are never read (NaN/inf hidden rows there
cannot leak), produce 0, and receive exactly zero gradient; they cost no compute.

**Vocabulary chunking.** ``vocab_chunk_size`` additionally splits the vocabulary into
blocks and combines them with an online log-sum-exp (running maximum :math:`m`, running
:math:`s = \sum e^{z-m}`, rescaled by :math:`e^{m_{old}-m_{new}}` when the maximum grows).
Memory then is :math:`O(\text{chunk\_size}\cdot\text{vocab\_chunk\_size})`, independent of
:math:`V`. It helps only when even a small block of positions times the full vocabulary does
not fit (very large vocabularies on small accelerators); otherwise it is slower (more,
smaller matrix products and an extra exponential pass), so it is off by default.

The divergence kernel used by :mod:`trajgrad.losses.distill` lives here too
(:func:`weighted_divergence`). It differs in one respect: a distillation loss is a scalar
:math:`\sum_n \omega_n D_n` with known per-position weights :math:`\omega_n` (the
aggregation), so its gradient is formed in the *forward* chunk loop, while each chunk's
logits are at hand, and the backward pass only scales it by the incoming scalar. That
saves recomputing the logits: forward + backward costs the same four matrix products per
chunk as the naive path.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _checks

__all__ = ["fused_token_logprobs", "fused_entropy", "weighted_divergence", "head_entropy", "Head", "DIVERGENCES"]

DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")

_SMALL = 1 << 15  # elements below which the softmax statistics use plain elementwise ops


# ----------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics are formed in float32 at least (bf16/fp16 inputs are upcast)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product ``(a * b).sum(-1)`` without materializing ``a * b``."""
    return torch.einsum("nv,nv->n", a, b)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``b``'s dtype (the weight's), result in ``out_dtype``."""
    return (a.to(b.dtype) @ b).to(out_dtype)


def _logits(rows_x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
            inv_t: float, cdt: torch.dtype, v0: int = 0, v1: Optional[int] = None, *,
            owned: bool = False) -> torch.Tensor:
    """Scaled logits ``(x W[v0:v1]^T + b[v0:v1]) / T`` of some rows, in ``cdt``, in a fresh buffer.

    With ``weight`` None, ``rows_x`` already holds logits (``[n, V]``); ``owned`` says that
    it is a private copy that may be scaled in place.
    """
    if weight is None:
        z = rows_x[:, v0:v1] if (v0 != 0 or v1 is not None) else rows_x
        if z.dtype != cdt:
            z = z.to(cdt)
        elif not (owned and z.data_ptr() == rows_x.data_ptr() and z.is_contiguous()):
            z = z.clone()
        return z.mul_(inv_t) if inv_t != 1.0 else z
    w = weight[v0:v1]
    x = rows_x.to(w.dtype)
    if bias is None:
        z = x @ w.T
    else:
        z = torch.addmm(bias[v0:v1].to(w.dtype), x, w.T)
    z = z.to(cdt) if z.dtype != cdt else z
    return z.mul_(inv_t) if inv_t != 1.0 else z


def _softmax_lse(z: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""``softmax(z)`` and ``logsumexp(z)`` per row, in one exponential pass.

    At the arg-max the softmax equals :math:`1/\sum_v e^{z_v-\max z}` exactly up to one
    rounding, so :math:`\operatorname{lse} = \max z - \log\max\pi` (``max pi >= 1/V`` never
    underflows). ``torch.logsumexp`` would cost another full pass.
    Small blocks take the elementwise route (the fused softmax kernel forks threads even
    for a handful of rows, which costs far more than the arithmetic there).
    """
    if z.numel() < _SMALL:
        m = z.amax(-1, keepdim=True)
        p = torch.exp(z - m)
        s = p.sum(-1, keepdim=True)
        return p.div_(s), (m + s.log()).squeeze(-1)
    p = torch.softmax(z, -1)
    lse = z.amax(-1) - p.amax(-1).log()
    return p, lse


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
    _checks.check_positive("temperature", float(temperature))
    if isinstance(temperature, float) and math.isinf(temperature):
        raise ValueError(f"temperature: must be finite, got {temperature}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be a positive int, got {chunk_size!r}")
    if vocab_chunk_size is not None and (
            not isinstance(vocab_chunk_size, int) or isinstance(vocab_chunk_size, bool) or vocab_chunk_size < 1):
        raise ValueError(f"vocab_chunk_size: must be None or a positive int, got {vocab_chunk_size!r}")


# ----------------------------------------------------------------------------------------
# per-position log-probs and entropies (recompute in backward)
# ----------------------------------------------------------------------------------------


def _forward_stats(h, weight, bias, y, inv_t, cdt, vchunk, want_entropy):
    """Per-row ``lse``, target logit (if ``y``) and ``sum_v e^{z-m} z / sum e^{z-m}``."""
    V = weight.shape[0]
    if vchunk >= V:
        z = _logits(h, weight, bias, inv_t, cdt)
        p, lse = _softmax_lse(z)
        zy = z.gather(1, y[:, None]).squeeze(1) if y is not None else None
        mean_z = _row_dot(p, z) if want_entropy else None
        return lse, zy, mean_z
    n = h.shape[0]
    m = torch.full((n,), -math.inf, dtype=cdt, device=h.device)
    s = torch.zeros(n, dtype=cdt, device=h.device)
    t = torch.zeros(n, dtype=cdt, device=h.device) if want_entropy else None
    zy = torch.zeros(n, dtype=cdt, device=h.device) if y is not None else None
    for v0, v1 in _chunks(V, vchunk):
        zb = _logits(h, weight, bias, inv_t, cdt, v0, v1)
        m_new = torch.maximum(m, zb.amax(-1))
        scale = torch.exp(m - m_new)  # exp(-inf) = 0 on the first block
        eb = torch.exp(zb - m_new[:, None])
        s = s * scale + eb.sum(-1)
        if want_entropy:
            t = t * scale + _row_dot(eb, zb)
        if y is not None:
            inside = (y >= v0) & (y < v1)
            local = (y - v0).clamp(0, v1 - v0 - 1)
            zy = torch.where(inside, zb.gather(1, local[:, None]).squeeze(1), zy)
        m = m_new
    lse = m + s.log()
    return lse, zy, (t / s if want_entropy else None)


class _PositionwiseFn(torch.autograd.Function):
    """Chunked log-prob (``kind='logprob'``) or entropy (``kind='entropy'``) per position."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, kind, inv_t, chunk, vchunk):
        cdt = _compute_dtype(hidden.dtype)
        n_total = hidden.shape[0]
        out = torch.zeros(n_total, dtype=cdt, device=hidden.device)
        lse_all = torch.zeros(rows.numel(), dtype=cdt, device=hidden.device)
        for a, b in _chunks(rows.numel(), chunk):
            r = rows[a:b]
            h = hidden.index_select(0, r)
            y = targets.index_select(0, r) if kind == "logprob" else None
            lse, zy, mean_z = _forward_stats(h, weight, bias, y, inv_t, cdt, vchunk, kind == "entropy")
            lse_all[a:b] = lse
            out[r] = (zy - lse) if kind == "logprob" else (lse - mean_z)
        ctx.save_for_backward(hidden, weight, bias, targets, rows, lse_all, out)
        ctx.cfg = (kind, inv_t, chunk, vchunk, cdt)
        return out.to(hidden.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, rows, lse_all, out = ctx.saved_tensors
        kind, inv_t, chunk, vchunk, cdt = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        V = weight.shape[0]
        gh = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device) if need_h else None
        gw = None
        if need_w:   # with one vocabulary block the first chunk assigns it (no zero fill)
            gw = torch.empty(0) if (vchunk >= V and rows.numel()) else torch.zeros(weight.shape, dtype=cdt,
                                                                                   device=weight.device)
        gb = torch.zeros(V, dtype=cdt, device=weight.device) if (need_b and bias is not None) else None
        grad_out = grad_out.to(cdt)
        step = V if vchunk >= V else vchunk
        for a, b in _chunks(rows.numel(), chunk):
            r = rows[a:b]
            n = r.numel()
            h = hidden.index_select(0, r)
            gr = grad_out.index_select(0, r) * inv_t          # per-row scale of d out / d z
            neg_hw = h.to(cdt) * gr.neg()[:, None] if gw is not None else None
            lse = lse_all[a:b]
            shift = lse - out.index_select(0, r) if kind == "entropy" else None  # lse - H
            y = targets.index_select(0, r) if kind == "logprob" else None
            gh_rows = None
            for v0, v1 in _chunks(V, step):
                zb = _logits(h, weight, bias, inv_t, cdt, v0, v1 if step < V else None)
                if step >= V:
                    pb = _softmax_lse(zb)[0]
                else:
                    pb = zb.sub(lse[:, None]).exp_()
                if kind == "logprob":
                    # Gb = p - onehot(y) = -(d logp / d z), the one-hot folded in place
                    Gb = pb
                    inside = ((y >= v0) & (y < v1)).nonzero().squeeze(1)
                    if inside.numel():
                        Gb[inside, y[inside] - v0] -= 1.0
                else:
                    Gb = zb.sub_(shift[:, None]).mul_(pb)   # p (log p + H) = -(d H / d z)
                del zb
                if gh is not None:
                    part = _mm(Gb, weight[v0:v1], cdt)
                    gh_rows = part if gh_rows is None else gh_rows.add_(part)
                if gw is not None:
                    if step >= V and a == 0:
                        gw = Gb.T @ neg_hw                  # first chunk: no zero fill needed
                    else:
                        gw[v0:v1].addmm_(Gb.T, neg_hw)
                if gb is not None:
                    gb[v0:v1].addmv_(Gb.T, gr, alpha=-1.0)
            if gh is not None:
                gh.index_copy_(0, r, gh_rows.mul_(gr.neg()[:, None]))
        return (None if gh is None else gh.to(hidden.dtype),
                None if gw is None else gw.to(weight.dtype),
                None if gb is None else gb.to(bias.dtype),
                None, None, None, None, None, None)


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
    gradient, weight gradient), against two + one for the naive path. Memory:
    :math:`O(\text{chunk\_size}\cdot V)` (or ``chunk_size * vocab_chunk_size``) beyond the
    inputs and the gradients.

    Args:
      hidden: ``[B, L, H]`` or ``[N, H]`` hidden states (attached).
      weight: ``[V, H]`` output-head weight (attached; a tied embedding works as is).
      targets: integer ``[B, L]`` or ``[N]``, values in ``[0, V)`` at valid positions
        (anything, e.g. ``-100``, at masked ones).
      bias: optional ``[V]`` head bias.
      temperature: :math:`T > 0`; the sampling temperature whose distribution is wanted.
      chunk_size: positions per chunk (larger amortizes the matrix products, smaller
        lowers the peak memory ``~ 2 * chunk_size * V`` floats).
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
                                int(chunk_size), vchunk)
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
                                int(chunk_size), vchunk)
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


def _divergence_chunk(logits, kind, beta, normalized, need_grad):
    """Per-row divergence, student/teacher entropies and d(divergence)/d(zs) for one chunk.

    ``logits = [zs, zt]``: temperature-scaled logits ``[n, V]``, taken out of the list so
    that their buffers can be reused or freed early (at most three ``[n, V]`` buffers are
    alive for the KLs). Notation: ``ls = log pi_s``, ``lt = log pi_t``, ``e = ls - lt``.
    """
    zs, zt = logits.pop(0), logits.pop(0)
    pt, lse_t = _softmax_lse(zt)
    ent_t = lse_t - _row_dot(pt, zt)
    if kind == "reverse_kl":
        del pt                                           # only its entropy was needed
    ps, lse_s = _softmax_lse(zs)
    ent_s = lse_s - _row_dot(ps, zs)
    e = zs.sub_(zt).sub_((lse_s - lse_t)[:, None])     # ls - lt, in zs's buffer
    del zt, zs
    grad = None
    if kind == "reverse_kl":
        div = _row_dot(ps, e)                            # sum ps (ls - lt)
        if need_grad:                                    # ps * ((ls - lt) - KL)
            grad = e.sub_(div[:, None]).mul_(ps)
    elif kind == "forward_kl":
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
    return div, ent_s, ent_t, grad


def _rows_of(side: Head, r: torch.Tensor) -> torch.Tensor:
    return side.x.index_select(0, r)


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
        for teacher, rows, omega in jobs:
            n = rows.numel()
            div_all = torch.zeros(n, dtype=cdt, device=dev)
            ent_s_all = torch.zeros(n, dtype=cdt, device=dev)
            ent_t_all = torch.zeros(n, dtype=cdt, device=dev)
            omega = omega.to(device=dev, dtype=cdt)
            for a, b in _chunks(n, chunk):
                r = rows[a:b]
                xs = s_x.index_select(0, r)
                logits = [_logits(xs, s_w, s_b, inv_t, cdt, owned=True),
                          _logits(_rows_of(teacher, r), teacher.weight, teacher.bias, inv_t, cdt, owned=True)]
                div, es, et, G = _divergence_chunk(logits, kind, beta, normalized, need)
                div_all[a:b] = div
                ent_s_all[a:b] = es
                ent_t_all[a:b] = et
                om = omega[a:b]
                loss = loss + torch.dot(om, div)
                if G is None:
                    continue
                scale = om * inv_t                 # d(omega_n D_n)/dz = omega_n G_n; z = (.)/T
                if s_w is None:
                    gx.index_copy_(0, r, G.mul_(scale[:, None]))
                    continue
                if need_x:
                    gx.index_copy_(0, r, _mm(G, s_w, cdt).mul_(scale[:, None]))
                if need_w:
                    gw.addmm_(G.T, xs.to(cdt) * scale[:, None])
                if need_b:
                    gb.addmv_(G.T, scale)
                del G
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
    out = torch.zeros(rows.numel(), dtype=cdt, device=side.x.device)
    with torch.no_grad():
        for a, b in _chunks(rows.numel(), chunk_size):
            z = _logits(_rows_of(side, rows[a:b]), side.weight, side.bias, inv_t, cdt, owned=True)
            p, lse = _softmax_lse(z)
            out[a:b] = lse - _row_dot(p, z)
    return out
