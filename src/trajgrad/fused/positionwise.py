r"""Per-position log-probabilities and entropies from hidden states, recomputed in backward.

See :mod:`trajgrad.fused` for the scheme (chunks of positions, optional vocabulary blocks
with an online log-sum-exp, analytic gradients).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .. import _checks
from ._blocks import (_SWEEP, _chunks, _compute_dtype, _exp_shifted, _flat_rows, _head_logits, _log_partition, _mm,
                      _row_dot, _Workspace)
from .checks import check_head, check_sizes
from .chunking import resolve_tiles

__all__ = ["fused_token_logprobs", "fused_entropy"]


def _probs_(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``z <- exp(z - lse)`` (the softmax, given the log-partition ``[n, 1]``), block by block in cache."""
    for v0, v1 in _chunks(z.shape[1], _SWEEP):
        z[:, v0:v1].sub_(lse).exp_()
    return z


def _fold_onehot(G: torch.Tensor, y: torch.Tensor, v0: int, v1: int) -> None:
    """``G[n, y_n - v0] -= 1`` for the rows whose target lies in the block ``[v0, v1)``."""
    inside = ((y >= v0) & (y < v1)).nonzero().squeeze(1)
    if inside.numel():
        G[inside, y[inside] - v0] -= 1.0


def _expected_logit(z: torch.Tensor, lse: torch.Tensor, tmp) -> torch.Tensor:
    r""":math:`\sum_v \pi_{n,v} z_{n,v}` per row, :math:`\pi = e^{z - \operatorname{lse}}`, one block of
    :data:`_SWEEP` columns at a time in ``tmp(0, w)`` (``z`` is left as it is)."""
    total = z.new_zeros(z.shape[0])
    for v0, v1 in _chunks(z.shape[1], _SWEEP):
        p = torch.sub(z[:, v0:v1], lse, out=tmp(0, v1 - v0)).exp_()
        total.add_(_row_dot(p, z[:, v0:v1]))
    return total


class _PositionwiseFn(torch.autograd.Function):
    r"""Chunked log-prob (``kind='logprob'``) or entropy (``kind='entropy'``) per position.

    Sign convention inside: ``G = -(d out / d z)``, i.e. ``p - onehot(y)`` for log-probs
    and ``p (log p + H)`` for entropies.

    ``eager``: only ``hidden`` needs a gradient (a frozen head, e.g. LoRA training) and the
    vocabulary is one block. Then the per-row factor :math:`a_n = -(G_n W)/T` is formed in
    the forward pass (one extra product there) and the backward pass is a row scaling, with
    no recomputation: two matrix products in total, as for the naive path.

    ``with_entropy`` (log-probs only): also return each position's entropy
    :math:`\operatorname{lse} - \sum_v \pi_v z_v`, read off the same logits in the forward
    pass (no gradient).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, kind, inv_t, chunk, vchunk, eager, with_entropy=False):
        cdt = _compute_dtype(hidden.dtype)
        dev = hidden.device
        V = weight.shape[0]
        n_rows = rows.numel()
        step = min(vchunk, V)
        single = step >= V
        eager = bool(eager and single)
        work = _Workspace(min(chunk, max(n_rows, 1)) * step, cdt, dev)
        sweep = _Workspace(min(chunk, max(n_rows, 1)) * min(_SWEEP, step), cdt, dev)
        out = torch.zeros(hidden.shape[0], dtype=cdt, device=dev)
        lse_all = torch.zeros(n_rows, dtype=cdt, device=dev)
        factor = torch.zeros(n_rows, hidden.shape[1], dtype=cdt, device=dev) if eager else None
        ent = torch.zeros(hidden.shape[0], dtype=cdt, device=dev) if with_entropy else None
        for a, b in _chunks(n_rows, chunk):
            r = rows[a:b]
            n = r.numel()
            h = hidden.index_select(0, r)
            y = targets.index_select(0, r) if kind == "logprob" else None
            if single:
                z = _head_logits(h, weight, bias, inv_t, work.get(0, n, V))
                if kind == "logprob":
                    zy = z.gather(1, y[:, None]).squeeze(1)
                    lse1 = _log_partition(z, lambda i, w, n=n: sweep.get(i, n, w))
                    lse = lse1.squeeze(1)
                    val = zy - lse
                    if ent is not None:
                        ent[r] = lse - _expected_logit(z, lse1, lambda i, w, n=n: sweep.get(i, n, w))
                    if eager:
                        G = _probs_(z, lse1)                          # in place: z is not needed again
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
                    if kind == "entropy" or ent is not None:
                        t = t * scale.squeeze(1) + _row_dot(eb, zb)
                    m = m_new
                lse = (m + s.log()).squeeze(1)
                val = zy - lse if kind == "logprob" else lse - t / s.squeeze(1)
                if ent is not None:
                    ent[r] = lse - t / s.squeeze(1)
            lse_all[a:b] = lse
            out[r] = val
        ctx.save_for_backward(hidden, weight, bias, targets, rows, lse_all, out, factor)
        ctx.cfg = (kind, inv_t, chunk, step, cdt, eager)
        if ent is None:
            return out.to(hidden.dtype)
        ent = ent.to(hidden.dtype)
        ctx.mark_non_differentiable(ent)
        return out.to(hidden.dtype), ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, *_grad_entropy):
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
            return (None if gh is None else gh.to(hidden.dtype),) + (None,) * 10
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
                    G = _probs_(zb, lse)                              # p, in place
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
                None, None, None, None, None, None, None, None)


def _eager_hidden_only(hidden, weight, bias) -> bool:
    return (torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad
            and not (bias is not None and bias.requires_grad))


def _tiled_head(weight, bias) -> bool:
    """Whether ``"auto"`` sizes may tile this call (:mod:`trajgrad.fused.chunking`): it computes a
    gradient for the head (its weight or bias) on the CPU. Tiles were measured on CPUs only; on
    an accelerator many small tiles would cost a kernel launch each, so there the whole
    vocabulary is kept."""
    trainable = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
    return bool(trainable and weight.device.type == "cpu")


def _prepare_positionwise(hidden, weight, bias, mask, temperature, chunk_size, vocab_chunk_size, kind):
    """Checked inputs, the valid rows, and ``(chunk, vocabulary block)`` resolved by
    :func:`~trajgrad.fused.chunking.resolve_tiles` (tiles for a trainable head on the CPU)."""
    check_sizes(temperature, chunk_size, vocab_chunk_size)
    hidden = _checks.as_tensor("hidden", hidden)
    _checks.check_ndim("hidden", hidden, (2, 3))
    if mask is not None:
        mask = _checks.check_mask("mask", mask, hidden.shape[:-1])
    hidden, weight, bias = check_head("hidden", hidden, "weight", weight, "bias", bias, mask=mask)
    n = math.prod(hidden.shape[:-1])
    h2 = hidden.reshape(n, hidden.shape[-1])
    rows = _flat_rows(mask, n, hidden.device)
    chunk, vchunk = resolve_tiles(chunk_size, vocab_chunk_size, weight.shape[0], kind, h2.dtype,
                                  _tiled_head(weight, bias))
    return h2, weight, bias, mask, rows, chunk, vchunk


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_size: Union[int, str] = "auto",
    mask: Optional[torch.Tensor] = None,
    vocab_chunk_size: Union[int, str, None] = "auto",
    with_entropy: bool = False,
):
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
    ``[chunk_size, V]`` buffer (two ``[chunk_size, vocab_chunk_size]`` tiles with vocabulary
    blocks) beyond the inputs and the gradients. With a trainable head over more than
    2,048 tokens on the CPU the defaults work in tiles (:mod:`trajgrad.fused.chunking`), so
    the ``[V, H]`` head gradient is the only vocabulary-sized allocation.

    Args:
      hidden: ``[B, L, H]`` or ``[N, H]`` hidden states (attached).
      weight: ``[V, H]`` output-head weight (attached; a tied embedding works as is).
      targets: integer ``[B, L]`` or ``[N]``, values in ``[0, V)`` at valid positions
        (anything, e.g. ``-100``, at masked ones).
      bias: optional ``[V]`` head bias.
      temperature: :math:`T > 0`; the sampling temperature whose distribution is wanted.
      chunk_size: positions per chunk, or ``"auto"`` (default): the largest chunk whose
        ``[chunk, V]`` buffer fits the memory budget of :mod:`trajgrad.fused.chunking`
        (192 MiB unless overridden: 320 positions at ``V = 151,936``); for auto tiles
        (below) the positions of a tile (256 at the default budget, float32). Larger
        amortizes the matrix products, smaller lowers the peak memory.
      mask: optional ``[B, L]``/``[N]`` 0/1 mask; masked positions are skipped (no compute,
        output 0, zero gradient, NaN in their hidden rows never read).
      vocab_chunk_size: block size over the vocabulary (online log-sum-exp; see
        :mod:`trajgrad.fused`). ``"auto"`` (default): blocks of 2,048 columns when the
        head gets a gradient (its weight or bias requires grad), lives on the CPU and
        ``V > 2048``, else the whole vocabulary; ``None``: always the whole vocabulary.
      with_entropy: also return the entropy :math:`\mathcal H_n = \operatorname{lse}(z_n) -
        \sum_v \pi_{n,v} z_{n,v}` of every position, read off the forward pass's logits
        (one more sweep over them, no extra matrix product), *without* a gradient; for a
        differentiable entropy use :func:`fused_entropy`.

    Returns:
      ``targets``-shaped log-probabilities in ``hidden``'s dtype (statistics are formed in
      float32 at least), 0 at masked positions; with ``with_entropy``, ``(logp, entropy)``,
      the entropies of the same shape, detached, 0 at masked positions.
    """
    if not isinstance(with_entropy, bool):
        raise ValueError(f"with_entropy: must be True or False, got {with_entropy!r}")
    hidden_t = _checks.as_tensor("hidden", hidden)
    _checks.check_ndim("hidden", hidden_t, (2, 3))
    targets = _checks.as_tensor("targets", targets)
    if targets.is_floating_point() or targets.dtype == torch.bool or targets.is_complex():
        raise ValueError(f"targets: expected an integer tensor, got dtype {targets.dtype}")
    _checks.check_shape("targets", targets, hidden_t.shape[:-1], against="hidden without its last dimension")
    h2, weight, bias, mask, rows, chunk, vchunk = _prepare_positionwise(
        hidden_t, weight, bias, mask, temperature, chunk_size, vocab_chunk_size, "logprob")
    y = targets.reshape(-1).to(torch.long)
    V = weight.shape[0]
    if rows.numel():
        yv = y.index_select(0, rows)
        if bool(((yv < 0) | (yv >= V)).any()):
            bad = yv[(yv < 0) | (yv >= V)][0].item()
            raise ValueError(f"targets: values must lie in [0, {V}) at valid positions, found {bad}")
    out = _PositionwiseFn.apply(h2, weight, bias, y, rows, "logprob", 1.0 / float(temperature),
                                chunk, vchunk, _eager_hidden_only(h2, weight, bias), with_entropy)
    if with_entropy:
        return out[0].reshape(targets.shape), out[1].reshape(targets.shape)
    return out.reshape(targets.shape)


def fused_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_size: Union[int, str] = "auto",
    mask: Optional[torch.Tensor] = None,
    vocab_chunk_size: Union[int, str, None] = "auto",
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
    h2, weight, bias, mask, rows, chunk, vchunk = _prepare_positionwise(
        hidden_t, weight, bias, mask, temperature, chunk_size, vocab_chunk_size, "entropy")
    out = _PositionwiseFn.apply(h2, weight, bias, None, rows, "entropy", 1.0 / float(temperature),
                                chunk, vchunk, _eager_hidden_only(h2, weight, bias))
    return out.reshape(hidden_t.shape[:-1])

