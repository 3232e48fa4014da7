"""Tests for trajgrad.fused: chunked log-probs / entropies / divergences from hidden states."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from trajgrad.fused import Head, fused_entropy, fused_token_logprobs, weighted_divergence

F64 = torch.float64


# ---------------------------------------------------------------------------------------
# naive references (full [B, L, V] logits)
# ---------------------------------------------------------------------------------------


def naive_logits(h, w, b, t):
    z = h @ w.T
    if b is not None:
        z = z + b
    return z / t


def naive_logprobs(h, w, y, b=None, t=1.0, mask=None):
    lp = naive_logits(h, w, b, t).log_softmax(-1).gather(-1, y.clamp_min(0)[..., None]).squeeze(-1)
    return lp if mask is None else torch.where(mask, lp, torch.zeros_like(lp))


def naive_entropy(h, w, b=None, t=1.0, mask=None):
    lp = naive_logits(h, w, b, t).log_softmax(-1)
    ent = -(lp.exp() * lp).sum(-1)
    return ent if mask is None else torch.where(mask, ent, torch.zeros_like(ent))


def make_case(seed, B, L, H, V, with_bias=True, p_valid=0.7, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, L, H, generator=g, dtype=dtype)
    w = torch.randn(V, H, generator=g, dtype=dtype) / math.sqrt(H) * 3
    b = torch.randn(V, generator=g, dtype=dtype) if with_bias else None
    y = torch.randint(0, V, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) < p_valid
    return h, w, b, y, mask


def grads(out, params, seed=0):
    g = torch.Generator().manual_seed(seed)
    cot = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad((out * cot).sum(), params, allow_unused=True)


def leaf(*xs):
    return [None if x is None else x.clone().requires_grad_(True) for x in xs]


# random small cases: sizes, chunking over positions and the vocabulary, bias, temperature
CASES = dict(seed=st.integers(0, 10_000), B=st.integers(1, 3), L=st.integers(1, 9), H=st.integers(1, 6),
             V=st.integers(1, 13), chunk=st.integers(1, 8), vchunk=st.one_of(st.none(), st.integers(1, 7)),
             with_bias=st.booleans(), temperature=st.sampled_from([0.5, 1.0, 2.3]))


# ---------------------------------------------------------------------------------------
# hand-derived values and gradients
# ---------------------------------------------------------------------------------------


def test_two_token_worked_numbers():
    # H = 1, h = 1, W = [[0], [log 3]]: logits (0, log 3) -> pi = (1/4, 3/4).
    h = torch.ones(1, 1, 1, dtype=F64)
    w = torch.tensor([[0.0], [math.log(3.0)]], dtype=F64)
    lp = fused_token_logprobs(h, w, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-15)
    lp0 = fused_token_logprobs(h, w, torch.tensor([[0]]))
    assert lp0.item() == pytest.approx(math.log(0.25), abs=1e-15)
    ent = fused_entropy(h, w)
    assert ent.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-15)
    # temperature 2: logits (0, log 3 / 2) -> pi = (1, sqrt 3) / (1 + sqrt 3)
    lp_t = fused_token_logprobs(h, w, torch.tensor([[1]]), temperature=2.0)
    assert lp_t.item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-15)


def test_uniform_logits_give_log_v():
    V, H = 11, 3
    h = torch.randn(2, 4, H, dtype=F64)
    w = torch.zeros(V, H, dtype=F64)
    y = torch.randint(0, V, (2, 4))
    assert torch.allclose(fused_token_logprobs(h, w, y), torch.full((2, 4), -math.log(V), dtype=F64), atol=1e-14)
    assert torch.allclose(fused_entropy(h, w, vocab_chunk_size=4), torch.full((2, 4), math.log(V), dtype=F64),
                          atol=1e-14)


def test_gradients_match_hand_derivation():
    # d logp_y / dz = onehot(y) - p ; d H / dz = -p (log p + H) ; z = (W h + b) / T
    h, w, b, y, _ = make_case(1, 1, 3, 4, 6)
    T = 1.7
    hh, ww, bb = leaf(h, w, b)
    lp = fused_token_logprobs(hh, ww, y, bias=bb, temperature=T, chunk_size=2)
    gh, gw, gb = torch.autograd.grad(lp.sum(), [hh, ww, bb])
    with torch.no_grad():
        p = naive_logits(h, w, b, T).softmax(-1)[0]              # [3, V]
        G = torch.nn.functional.one_hot(y[0], 6).to(F64) - p     # d sum logp / dz
        assert torch.allclose(gh[0], G @ w / T, atol=1e-13)
        assert torch.allclose(gw, G.T @ h[0] / T, atol=1e-13)
        assert torch.allclose(gb, G.sum(0) / T, atol=1e-13)
    ent = fused_entropy(hh, ww, bias=bb, temperature=T, vocab_chunk_size=4)
    gh, gw, gb = torch.autograd.grad(ent.sum(), [hh, ww, bb])
    with torch.no_grad():
        logp = p.log()
        Hn = -(p * logp).sum(-1, keepdim=True)
        G = -p * (logp + Hn)
        assert torch.allclose(gh[0], G @ w / T, atol=1e-13)
        assert torch.allclose(gw, G.T @ h[0] / T, atol=1e-13)
        assert torch.allclose(gb, G.sum(0) / T, atol=1e-13)


# ---------------------------------------------------------------------------------------
# equality with the naive path (values and gradients), hypothesis
# ---------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(**CASES, use_mask=st.booleans())
def test_logprobs_and_entropy_equal_naive(seed, B, L, H, V, chunk, vchunk, with_bias, temperature, use_mask):
    h, w, b, y, mask = make_case(seed, B, L, H, V, with_bias)
    mask = mask if use_mask else None
    # poison the masked hidden rows: they must never be read
    h_in = h.clone()
    if mask is not None:
        h_in[~mask] = float("nan")
    params = leaf(h_in, w, b)
    ref_params = leaf(h, w, b)
    params_nonnull = [p for p in params if p is not None]
    ref_nonnull = [p for p in ref_params if p is not None]
    for kind in ("logprob", "entropy"):
        if kind == "logprob":
            out = fused_token_logprobs(params[0], params[1], y, bias=params[2], temperature=temperature,
                                       chunk_size=chunk, mask=mask, vocab_chunk_size=vchunk)
            ref = naive_logprobs(ref_params[0], ref_params[1], y, ref_params[2], temperature, mask)
        else:
            out = fused_entropy(params[0], params[1], bias=params[2], temperature=temperature, chunk_size=chunk,
                                mask=mask, vocab_chunk_size=vchunk)
            ref = naive_entropy(ref_params[0], ref_params[1], ref_params[2], temperature, mask)
        assert out.shape == (B, L)
        assert torch.allclose(out, ref, atol=1e-12, rtol=1e-12)
        got = grads(out, params_nonnull)
        want = grads(ref, ref_nonnull)
        for g1, g2 in zip(got, want):
            assert torch.isfinite(g1).all()
            assert torch.allclose(g1, g2, atol=1e-12, rtol=1e-10)
        if mask is not None:
            assert (got[0][~mask] == 0).all()


def test_flat_inputs_and_no_mask():
    h, w, b, y, _ = make_case(3, 2, 5, 4, 7)
    flat = fused_token_logprobs(h.reshape(10, 4), w, y.reshape(10), bias=b)
    assert flat.shape == (10,)
    assert torch.allclose(flat, naive_logprobs(h, w, y, b).reshape(10), atol=1e-13)
    ent = fused_entropy(h.reshape(10, 4), w, bias=b)
    assert torch.allclose(ent, naive_entropy(h, w, b).reshape(10), atol=1e-13)


def test_float32_close_to_float64():
    h, w, b, y, mask = make_case(4, 2, 16, 8, 300)
    out32 = fused_token_logprobs(h.float(), w.float(), y, bias=b.float(), mask=mask, chunk_size=5)
    assert out32.dtype == torch.float32
    assert torch.allclose(out32.double(), naive_logprobs(h, w, y, b, mask=mask), atol=1e-5)


def test_bfloat16_inputs_are_upcast_for_statistics():
    h, w, b, y, mask = make_case(5, 1, 6, 8, 40)
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    out = fused_token_logprobs(hb, wb, y, mask=mask, chunk_size=4)
    assert out.dtype == torch.bfloat16
    ref = naive_logprobs(hb.double(), wb.double(), y, mask=mask)
    assert torch.allclose(out.double(), ref, atol=0.05)
    out.sum().backward()
    assert hb.grad.dtype == torch.bfloat16 and torch.isfinite(wb.grad.float()).all()


# ---------------------------------------------------------------------------------------
# masked positions: NaN/inf never leaks, zero gradient
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_poisoned_masked_rows_leave_values_and_grads_unchanged(poison):
    h, w, b, y, mask = make_case(6, 3, 7, 5, 9)
    y_poison = torch.where(mask, y, torch.full_like(y, -100))    # ignore-index style padding targets
    clean = leaf(h, w, b)
    dirty_h = h.clone()
    dirty_h[~mask] = poison
    dirty = leaf(dirty_h, w, b)
    for fn in (
        lambda p, yy: fused_token_logprobs(p[0], p[1], yy, bias=p[2], mask=mask, chunk_size=3),
        lambda p, yy: fused_entropy(p[0], p[1], bias=p[2], mask=mask, chunk_size=3),
    ):
        out_c = fn(clean, y)
        out_d = fn(dirty, y_poison)
        assert torch.equal(out_c, out_d)
        assert (out_d[~mask] == 0).all()
        g_c = grads(out_c, clean)
        g_d = grads(out_d, dirty)
        for a, c in zip(g_c, g_d):
            assert torch.isfinite(c).all()
            assert torch.equal(a, c)
        assert (g_d[0][~mask] == 0).all()


# ---------------------------------------------------------------------------------------
# gradcheck on the custom autograd Functions
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("vchunk", [None, 2])
def test_gradcheck_positionwise(vchunk):
    h, w, b, y, mask = make_case(7, 2, 3, 3, 5)
    hh, ww, bb = leaf(h, w, b)
    assert torch.autograd.gradcheck(
        lambda a, c, d: fused_token_logprobs(a, c, y, bias=d, temperature=0.8, chunk_size=2, mask=mask,
                                             vocab_chunk_size=vchunk), (hh, ww, bb))
    assert torch.autograd.gradcheck(
        lambda a, c, d: fused_entropy(a, c, bias=d, temperature=1.3, chunk_size=2, mask=mask,
                                      vocab_chunk_size=vchunk), (hh, ww, bb))


@pytest.mark.parametrize("kind,beta,normalized", [
    ("reverse_kl", 0.5, True), ("forward_kl", 0.5, True), ("jsd", 0.3, True), ("jsd", 0.3, False),
    ("jsd", 0.0, True), ("jsd", 1.0, True),
])
def test_gradcheck_divergence(kind, beta, normalized):
    g = torch.Generator().manual_seed(8)
    N, H, V = 5, 3, 4
    hs = torch.randn(N, H, generator=g, dtype=F64, requires_grad=True)
    ws = torch.randn(V, H, generator=g, dtype=F64, requires_grad=True)
    bs = torch.randn(V, generator=g, dtype=F64, requires_grad=True)
    ht = torch.randn(N, H, generator=g, dtype=F64)
    wt = torch.randn(V, H, generator=g, dtype=F64)
    rows = torch.tensor([0, 2, 3, 4])
    omega = torch.rand(4, generator=g, dtype=F64)

    def f(a, c, d):
        return weighted_divergence(Head(a, c, d), [(Head(ht, wt), rows, omega)], kind=kind, beta=beta,
                                   normalized=normalized, temperature=0.9, chunk_size=3)[0]

    assert torch.autograd.gradcheck(f, (hs, ws, bs))
    logits = torch.randn(N, V, generator=g, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda z: weighted_divergence(Head(z), [(Head(ht, wt), rows, omega)], kind=kind, beta=beta,
                                      normalized=normalized, chunk_size=2)[0], (logits,))


# ---------------------------------------------------------------------------------------
# the divergence kernel: backward scaling, retain_graph, no-grad mode
# ---------------------------------------------------------------------------------------


def _div_setup():
    g = torch.Generator().manual_seed(9)
    N, H, V = 6, 4, 7
    hs = torch.randn(N, H, generator=g, dtype=F64, requires_grad=True)
    ws = torch.randn(V, H, generator=g, dtype=F64, requires_grad=True)
    ht = torch.randn(N, H, generator=g, dtype=F64)
    wt = torch.randn(V, H, generator=g, dtype=F64)
    rows = torch.arange(N)
    omega = torch.full((N,), 1.0 / N, dtype=F64)
    return hs, ws, [(Head(ht, wt), rows, omega)]


def test_divergence_backward_scales_and_retains():
    hs, ws, jobs = _div_setup()
    loss = weighted_divergence(Head(hs, ws), jobs)[0]
    g1 = torch.autograd.grad(loss, [hs, ws], retain_graph=True)
    g3 = torch.autograd.grad(3.0 * loss, [hs, ws], retain_graph=True)
    g1b = torch.autograd.grad(loss, [hs, ws])
    for a, b, c in zip(g1, g3, g1b):
        assert torch.allclose(3.0 * a, b, atol=1e-15)
        assert torch.equal(a, c)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(loss, [hs, ws])
    # scaled, graph freed: in-place scaling path
    loss = weighted_divergence(Head(hs, ws), jobs)[0]
    g3b = torch.autograd.grad(3.0 * loss, [hs, ws])
    for a, b in zip(g3, g3b):
        assert torch.allclose(a, b, atol=1e-15)


def test_divergence_no_grad_mode_and_frozen_head():
    hs, ws, jobs = _div_setup()
    with torch.no_grad():
        loss = weighted_divergence(Head(hs, ws), jobs)[0]
    assert not loss.requires_grad
    loss2 = weighted_divergence(Head(hs, ws.detach()), jobs)[0]
    (gh,) = torch.autograd.grad(loss2, [hs])
    assert torch.allclose(loss, loss2.detach())
    loss3 = weighted_divergence(Head(hs, ws), jobs)[0]
    gh3, _ = torch.autograd.grad(loss3, [hs, ws])
    assert torch.allclose(gh, gh3, atol=1e-15)


# ---------------------------------------------------------------------------------------
# memory: no [B, L, V]-sized tensor is ever created
# ---------------------------------------------------------------------------------------


class _MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_never_materializes_full_logits():
    B, L, H, V, chunk = 2, 64, 8, 50, 16
    h, w, b, y, mask = make_case(10, B, L, H, V, p_valid=1.0, dtype=torch.float32)
    hh, ww, bb = leaf(h, w, b)
    full = B * L * V
    with _MaxNumel() as mode:
        lp = fused_token_logprobs(hh, ww, y, bias=bb, chunk_size=chunk)
        ent = fused_entropy(hh, ww, bias=bb, chunk_size=chunk)
        (lp.sum() + ent.sum()).backward()
        loss = weighted_divergence(Head(hh.reshape(-1, H), ww, bb),
                                   [(Head(h.reshape(-1, H), w), torch.arange(B * L), torch.ones(B * L))],
                                   chunk_size=chunk)[0]
        loss.backward()
    assert mode.max_numel <= max(chunk * V, V * H, B * L * H)
    assert mode.max_numel < full // 4
    # the same computation with vocabulary blocks stays below chunk * vocab block (+ inputs)
    with _MaxNumel() as mode:
        fused_token_logprobs(hh, ww, y, bias=bb, chunk_size=chunk, vocab_chunk_size=10).sum().backward()
    assert mode.max_numel <= max(chunk * 10, V * H, B * L * H)


# ---------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------


def test_bad_inputs_raise_naming_the_argument():
    h, w, b, y, mask = make_case(11, 2, 4, 3, 5)
    cases = [
        (dict(hidden=h[0, 0]), "hidden"),
        (dict(weight=w[:, :2]), "weight"),
        (dict(weight=w[0]), "weight"),
        (dict(targets=y[:, :3]), "targets"),
        (dict(targets=y.double()), "targets"),
        (dict(targets=torch.full_like(y, 5)), "targets"),
        (dict(targets=torch.full_like(y, -1)), "targets"),
        (dict(bias=b[:3]), "bias"),
        (dict(mask=mask[:, :2]), "mask"),
        (dict(mask=torch.full((2, 4), 0.5)), "mask"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(vocab_chunk_size=0), "vocab_chunk_size"),
    ]
    base = dict(hidden=h, weight=w, targets=y, bias=b, mask=None)
    for override, name in cases:
        kw = {**base, **override}
        with pytest.raises(ValueError, match=name):
            fused_token_logprobs(kw.pop("hidden"), kw.pop("weight"), kw.pop("targets"), **kw)
    bad_h = h.clone()
    bad_h[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="hidden"):
        fused_token_logprobs(bad_h, w, y)
    with pytest.raises(ValueError, match="hidden"):
        fused_entropy(bad_h, w)
    m = torch.ones(2, 4, dtype=torch.bool)
    m[0, 0] = False
    fused_entropy(bad_h, w, mask=m)  # NaN only at a masked position: fine
    bad_w = w.clone()
    bad_w[1, 1] = float("inf")
    with pytest.raises(ValueError, match="weight"):
        fused_entropy(h, bad_w)
    bad_b = b.clone()
    bad_b[0] = float("nan")
    with pytest.raises(ValueError, match="bias"):
        fused_entropy(h, w, bias=bad_b)


def test_finite_check_has_no_false_positive_on_overflowing_sums():
    # huge but finite values overflow a float32 sum; the exact check must then accept them
    h = torch.ones(1, 2, 2)
    w = torch.full((3, 2), 3e38)
    w[1] = -3e38
    out = fused_entropy(h, w)
    assert out.shape == (1, 2)
    w[2, 0] = float("inf")
    with pytest.raises(ValueError, match="weight"):
        fused_entropy(h, w)
    w[2, 0] = float("nan")
    with pytest.raises(ValueError, match="weight"):
        fused_entropy(h, w)
    hh = torch.full((1, 3, 2), 3e38)
    hh[0, 1, 1] = float("-inf")
    w_ok = torch.ones(3, 2)
    with pytest.raises(ValueError, match="hidden"):
        fused_entropy(hh, w_ok, mask=torch.tensor([[1, 1, 0]]))
    fused_entropy(hh, w_ok, mask=torch.tensor([[1, 0, 1]]))  # the inf row is masked


@pytest.mark.parametrize("with_bias", [False, True])
def test_frozen_head_hidden_gradient_formed_in_forward(with_bias):
    # only the hidden states need a gradient (frozen head, e.g. LoRA): the eager path
    h, w, b, y, mask = make_case(12, 2, 5, 4, 9, with_bias)
    hh = h.clone().requires_grad_()
    href = h.clone().requires_grad_()
    for fused, naive in (
        (lambda x: fused_token_logprobs(x, w, y, bias=b, mask=mask, chunk_size=3, temperature=0.7),
         lambda x: naive_logprobs(x, w, y, b, 0.7, mask)),
        (lambda x: fused_entropy(x, w, bias=b, mask=mask, chunk_size=3, temperature=0.7),
         lambda x: naive_entropy(x, w, b, 0.7, mask)),
    ):
        out = fused(hh)
        ref = naive(href)
        assert torch.allclose(out, ref, atol=1e-13)
        (g1,) = grads(out, [hh])
        (g2,) = grads(ref, [href])
        assert torch.allclose(g1, g2, atol=1e-13)
        assert (g1[~mask] == 0).all()
        assert torch.autograd.gradcheck(fused, (hh,))


def test_float32_accuracy_at_large_vocabulary():
    # softmax-weighted sums over V ~ 6e4 terms: float32 results within a few ulps of float64
    g = torch.Generator().manual_seed(13)
    N, H, V = 3, 16, 60_000
    hs = torch.randn(N, H, generator=g, dtype=F64)
    ws = torch.randn(V, H, generator=g, dtype=F64)
    ht = torch.randn(N, H, generator=g, dtype=F64)
    wt = torch.randn(V, H, generator=g, dtype=F64)
    ent64 = fused_entropy(hs, ws)
    ent32 = fused_entropy(hs.float(), ws.float())
    assert torch.allclose(ent32.double(), ent64, rtol=2e-6)
    rows, om = torch.arange(N), torch.ones(N, dtype=F64)
    kl64 = weighted_divergence(Head(hs, ws), [(Head(ht, wt), rows, om)])[0]
    kl32 = weighted_divergence(Head(hs.float(), ws.float()), [(Head(ht.float(), wt.float()), rows, om.float())])[0]
    assert abs(kl32.item() - kl64.item()) <= 2e-6 * kl64.item()


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kl_sweeps_over_several_vocabulary_blocks_equal_naive(kind, with_bias, monkeypatch):
    """Vocabularies wider than one sweep block (and a partial last block): divergence, both
    entropies and the student's gradients equal the full-logit formulas, analytic and autograd."""
    from trajgrad.fused import _blocks

    monkeypatch.setattr(_blocks, "_SWEEP", 64)           # V = 1000: 15 full blocks and one of 40
    import trajgrad.fused.divergence as divergence
    monkeypatch.setattr(divergence, "_SWEEP", 64)
    g = torch.Generator().manual_seed(21)
    N, H, V = 9, 5, 1000
    hs, ws = leaf(torch.randn(N, H, generator=g, dtype=F64), torch.randn(V, H, generator=g, dtype=F64) / 2)
    bs = leaf(torch.randn(V, generator=g, dtype=F64))[0] if with_bias else None
    ht, wt = torch.randn(N, H, generator=g, dtype=F64), torch.randn(V, H, generator=g, dtype=F64) / 2
    rows = torch.tensor([0, 1, 3, 4, 5, 8])
    omega = torch.rand(rows.numel(), generator=g, dtype=F64)
    loss, (div,), (ent_s,), (ent_t,) = weighted_divergence(Head(hs, ws, bs), [(Head(ht, wt), rows, omega)],
                                                           kind=kind, temperature=0.8, chunk_size=4)
    ls = naive_logits(hs[rows], ws, bs, 0.8).log_softmax(-1)
    lt = naive_logits(ht[rows], wt, None, 0.8).log_softmax(-1)
    ps, pt = ls.exp(), lt.exp()
    ref = (ps * (ls - lt)).sum(-1) if kind == "reverse_kl" else (pt * (lt - ls)).sum(-1)
    assert torch.allclose(div, ref.detach(), rtol=1e-12, atol=1e-13)
    assert torch.allclose(ent_s, -(ps * ls).sum(-1).detach(), rtol=1e-12)
    assert torch.allclose(ent_t, -(pt * lt).sum(-1), rtol=1e-12)
    params = [p for p in (hs, ws, bs) if p is not None]
    got = torch.autograd.grad(loss, params)
    want = torch.autograd.grad((omega * ref).sum(), params)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    # the analytic gradient w.r.t. the student logits: pi_s - pi_t, or pi_s (ls - lt - KL)
    zs = leaf(naive_logits(hs[rows], ws, bs, 0.8).detach())[0]
    loss_z = weighted_divergence(Head(zs), [(Head(naive_logits(ht[rows], wt, None, 0.8)), torch.arange(len(rows)),
                                            omega)], kind=kind, chunk_size=4)[0]
    (gz,) = torch.autograd.grad(loss_z, [zs])
    ps, pt, ls, lt = ps.detach(), pt.detach(), ls.detach(), lt.detach()
    analytic = (ps - pt) if kind == "forward_kl" else ps * (ls - lt - ref.detach()[:, None])
    assert torch.allclose(gz, omega[:, None] * analytic, rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------------------------------
# log-probs with the entropy read off the same logits (with_entropy=True)
# ---------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(**CASES, trainable=st.sampled_from(["all", "hidden", "none"]))
def test_logprobs_with_entropy_equal_both_calls_and_the_same_gradient(seed, B, L, H, V, chunk, vchunk, with_bias,
                                                                      temperature, trainable):
    h, w, b, y, mask = make_case(seed, B, L, H, V, with_bias)
    h_in = h.clone()
    h_in[~mask] = float("nan")  # masked hidden rows are never read
    # "hidden": a frozen head (the eager path of LoRA training); "none": under no_grad
    if trainable == "all":
        p, q = leaf(h_in, w, b), leaf(h_in, w, b)
    elif trainable == "hidden":
        p, q = leaf(h_in) + [w, b], leaf(h_in) + [w, b]
    else:
        p, q = [h_in, w, b], [h_in, w, b]
    kw = dict(temperature=temperature, chunk_size=chunk, mask=mask, vocab_chunk_size=vchunk)
    with torch.set_grad_enabled(trainable != "none"):
        lp, ent = fused_token_logprobs(p[0], p[1], y, bias=p[2], with_entropy=True, **kw)
        lp_alone = fused_token_logprobs(q[0], q[1], y, bias=q[2], **kw)
    assert not ent.requires_grad and ent.shape == (B, L)
    assert torch.allclose(ent, naive_entropy(h, w, b, temperature, mask), atol=1e-12, rtol=1e-12)
    assert torch.equal(ent, fused_entropy(h_in, w, bias=b, **kw)) or torch.allclose(
        ent, fused_entropy(h_in, w, bias=b, **kw), atol=1e-13, rtol=1e-12)
    assert (ent[~mask] == 0).all() and torch.isfinite(ent).all()
    assert torch.equal(lp, lp_alone)
    if trainable != "none":
        params = [x for x in p if x is not None and x.requires_grad]
        params_alone = [x for x in q if x is not None and x.requires_grad]
        for g1, g2 in zip(grads(lp, params), grads(lp_alone, params_alone)):
            assert torch.equal(g1, g2)  # the extra sweep leaves the log-prob's gradient exactly as it was


def test_logprobs_with_entropy_float32_close_to_float64_at_a_large_vocabulary():
    h, w, b, y, mask = make_case(4, 2, 6, 16, 50_000, True)
    _, e64 = fused_token_logprobs(h, w, y, bias=b, mask=mask, with_entropy=True)
    _, e32 = fused_token_logprobs(h.float(), w.float(), y, bias=b.float(), mask=mask, with_entropy=True)
    assert e32.dtype == torch.float32
    assert torch.allclose(e32.double(), e64, atol=2e-5, rtol=1e-5)


def test_with_entropy_must_be_a_bool():
    h, w, b, y, mask = make_case(0, 1, 2, 3, 4)
    with pytest.raises(ValueError, match="with_entropy"):
        fused_token_logprobs(h, w, y, with_entropy="yes")
