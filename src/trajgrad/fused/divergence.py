r"""Chunked divergences between a student and a teacher head, gradient formed in forward.

The kernel behind :mod:`trajgrad.losses.distill`; see :mod:`trajgrad.fused` for the scheme.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .. import _checks
from ._blocks import (_SWEEP, _chunks, _compute_dtype, _exp_shifted, _keep_graph, _log_partition, _mm, _row_dot,
                      _side_logits, _Workspace)
from .chunking import resolve_chunk_size

__all__ = ["Head", "DIVERGENCES", "weighted_divergence", "head_entropy"]

DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")

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


def _kl_chunk(zs, zt, tmp, kind, need_grad):
    r"""Reverse or forward KL of one chunk from the two logits, in blocked sweeps.

    ``zs``, ``zt``: ``[n, V]`` student / teacher logits (both overwritten). ``tmp(i, w)``: three
    ``[n, w]`` scratch blocks. After the log-partitions (:func:`_log_partition`), every
    statistic is read off a block of :data:`_SWEEP` columns while it is in cache:
    :math:`\log\pi=z-\operatorname{lse}(z)`, the teacher and student entropies
    :math:`-\sum_v\pi\log\pi`, the divergence, and the gradient w.r.t. the student logits,
    :math:`\pi_s-\pi_t` (forward KL) or :math:`\pi_s\odot(\log\pi_s-\log\pi_t-D)` (reverse
    KL, whose :math:`D` is known after the sweep: a second, shorter one). The gradient is
    written over ``zt`` (reverse) or ``zs`` (forward); nothing else of size ``[n, V]`` is
    allocated.

    Returns ``(div, ent_s, ent_t, grad)``.
    """
    n, V = zs.shape
    lse_s, lse_t = _log_partition(zs, tmp), _log_partition(zt, tmp)
    div = zs.new_zeros(n)
    ent_s = zs.new_zeros(n)
    ent_t = zs.new_zeros(n)
    forward = kind == "forward_kl"

    def dot(a, b):  # row sums of a * b: a product in cache, then a pairwise sum (no batched matmul)
        return torch.mul(a, b, out=tmp(2, a.shape[1])).sum(1)

    for v0, v1 in _chunks(V, _SWEEP):
        s, t = zs[:, v0:v1].sub_(lse_s), zt[:, v0:v1].sub_(lse_t)   # ls, lt
        pt = torch.exp(t, out=tmp(0, v1 - v0))
        ps = torch.exp(s, out=tmp(1, v1 - v0))
        ent_t.sub_(dot(pt, t))
        ent_s.sub_(dot(ps, s))
        if forward:
            div.add_(dot(pt, t.sub_(s)))                # sum pt (lt - ls)
            if need_grad:
                torch.sub(ps, pt, out=s)                # ps - pt, over ls
        else:
            div.add_(dot(ps, torch.sub(s, t, out=t)))   # sum ps (ls - lt), ls - lt over lt
            if need_grad:
                s.copy_(ps)                             # ls is read: keep ps for the second sweep
    if kind == "reverse_kl" and need_grad:              # ps ((ls - lt) - KL), over lt
        for v0, v1 in _chunks(V, _SWEEP):
            zt[:, v0:v1].sub_(div[:, None]).mul_(zs[:, v0:v1])
        return div, ent_s, ent_t, zt
    return div, ent_s, ent_t, (zs if need_grad else None)


def _divergence_chunk(zs, zt, pbuf, qbuf, kind, beta, normalized, need_grad, tmp=None):
    """Per-row divergence, student/teacher entropies and d(divergence)/d(zs) for one chunk.

    ``zs``, ``zt``: temperature-scaled logits ``[n, V]`` (overwritten). The KLs sweep them
    in blocks (:func:`_kl_chunk`: the two ``[n, V]`` buffers and three small ``tmp`` blocks).
    The JSD uses ``pbuf``/``qbuf`` (``[n, V]`` workspaces) too. Notation: ``ls = log pi_s``,
    ``lt = log pi_t``, ``e = ls - lt``.

    Returns ``(div, ent_s, ent_t, G, row_scale)``: the gradient w.r.t. ``zs`` is
    ``G * row_scale[:, None]`` (``row_scale`` None means 1), so a per-row normalization
    can ride on the later ``[n, H]`` products instead of a pass over ``[n, V]``.
    """
    if kind in ("reverse_kl", "forward_kl"):
        div, ent_s, ent_t, grad = _kl_chunk(zs, zt, tmp, kind, need_grad)
        return div, ent_s, ent_t, grad, None
    et, mt, st = _exp_shifted(zt, pbuf)                 # exp(zt - max)
    lse_t = mt + st.log()
    ent_t = lse_t.squeeze(1) - _row_dot(et, zt) / st.squeeze(1)
    pt = et.div_(st)
    es, ms, ss = _exp_shifted(zs, qbuf)
    lse_s = ms + ss.log()
    ent_s = lse_s.squeeze(1) - _row_dot(es, zs) / ss.squeeze(1)
    e = zs.sub_(zt).sub_(lse_s - lse_t)                 # ls - lt, in zs's buffer
    grad, row_scale = None, None
    ps = es.div_(ss)                                 # generalized JSD, mixture m = beta pt + (1 - beta) ps
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
        gw = None                      # the first chunk assigns it: no zero fill, no read
        if need_w and not any(int(rows.numel()) for _, rows, _ in jobs):
            gw = torch.zeros(s_w.shape, dtype=cdt, device=dev)
        gb = torch.zeros(s_b.shape, dtype=cdt, device=dev) if need_b else None
        loss = torch.zeros((), dtype=cdt, device=dev)
        divs, ents_s, ents_t = [], [], []
        V = s_x.shape[1] if s_w is None else s_w.shape[0]
        longest = max([int(rows.numel()) for _, rows, _ in jobs] + [1])
        work = _Workspace(min(chunk, longest) * V, cdt, dev)
        sweep = _Workspace(min(chunk, longest) * min(_SWEEP, V), cdt, dev)   # the KLs' two small blocks
        for j, (teacher, rows, omega) in enumerate(jobs):
            n = rows.numel()
            # rows are unique within a job: the first job copies, later ones (several teachers at
            # one position) add
            put = gx.index_copy_ if (gx is not None and j == 0) else (None if gx is None else gx.index_add_)
            div_all = torch.zeros(n, dtype=cdt, device=dev)
            ent_s_all = torch.zeros(n, dtype=cdt, device=dev)
            ent_t_all = torch.zeros(n, dtype=cdt, device=dev)
            omega = omega.to(device=dev, dtype=cdt)
            for a, b in _chunks(n, chunk):
                r = rows[a:b]
                m = r.numel()
                zs, xs = _side_logits(Head(s_x, s_w, s_b), r, inv_t, work.get(0, m, V))
                zt, _ = _side_logits(teacher, r, inv_t, work.get(1, m, V))
                jsd = kind == "jsd"
                div, es, et, G, row_scale = _divergence_chunk(
                    zs, zt, work.get(2, m, V) if jsd else None, work.get(3, m, V) if jsd else None,
                    kind, beta, normalized, need, tmp=lambda i, w, m=m: sweep.get(i, m, w))
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
                    put(0, r, G.mul_(scale[:, None]))
                    continue
                if need_x:
                    put(0, r, _mm(G, s_w, cdt).mul_(scale[:, None]))
                if need_w:
                    if gw is None:
                        gw = G.T @ (xs.to(cdt) * scale[:, None])
                    else:
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
    chunk_size: Union[int, str] = "auto",
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
      (likewise divided); with ``normalized`` at :math:`\beta=0` / :math:`\beta=1` the
      limit is computed as ``forward_kl`` / ``reverse_kl`` itself;

    and, when the student requires grad and grad mode is on, accumulates the gradient of
    :math:`\omega_n D_n` w.r.t. the student's hidden rows, weight and bias (or logits)
    into one buffer per parameter, which the backward pass scales by the incoming scalar.
    Jobs may share rows (several teachers at one position): their gradients add up.
    ``chunk_size="auto"`` sizes the chunk to the memory budget of
    :mod:`trajgrad.fused.chunking` for ``kind``.

    Returns:
      ``(loss, divs, student_entropies, teacher_entropies)``: a scalar attached to the
      student, and per job a detached ``[n]`` tensor of each statistic.
    """
    _checks.check_choice("kind", kind, DIVERGENCES)
    if kind == "jsd" and normalized and float(beta) in (0.0, 1.0):   # the limits, exactly
        kind = "forward_kl" if float(beta) == 0.0 else "reverse_kl"
    chunk = resolve_chunk_size(chunk_size, student.vocab, kind, student.x.dtype)
    grad_on = torch.is_grad_enabled()
    need_x = grad_on and student.x.requires_grad
    need_w = grad_on and student.weight is not None and student.weight.requires_grad
    need_b = grad_on and student.bias is not None and student.bias.requires_grad
    cfg = (kind, float(beta), bool(normalized), 1.0 / float(temperature), chunk, need_x, need_w, need_b)
    plain = []
    for teacher, rows, omega in jobs:
        plain.append((Head(teacher.x.detach(),
                           None if teacher.weight is None else teacher.weight.detach(),
                           None if teacher.bias is None else teacher.bias.detach()),
                      rows, omega.detach()))
    loss, div, es, et = _DivergenceFn.apply(student.x, student.weight, student.bias, plain, cfg)
    sizes = [int(rows.numel()) for _, rows, _ in jobs]
    return loss, list(div.split(sizes)), list(es.split(sizes)), list(et.split(sizes))


def head_entropy(side: Head, rows: torch.Tensor, *, temperature: float = 1.0,
                 chunk_size: Union[int, str] = "auto") -> torch.Tensor:
    """Detached entropies ``[n]`` of ``softmax(logits / T)`` at ``rows`` of one head (chunked)."""
    inv_t = 1.0 / float(temperature)
    chunk_size = resolve_chunk_size(chunk_size, side.vocab, "entropy", side.x.dtype)
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
