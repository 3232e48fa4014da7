"""Tests for trajgrad.losses.distill: exact full-vocabulary on-policy distillation (§14, §15, §24)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.aggregate import Normalizer, aggregate
from trajgrad.losses.distill import (
    forward_kl_distill_loss,
    jsd_distill_loss,
    multi_teacher_distill_loss,
    reverse_kl_distill_loss,
    sampled_token_kl,
)

F64 = torch.float64
MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_constant")


# ---------------------------------------------------------------------------------------
# naive references: §14's exact code on full [B, L, V] logits
# ---------------------------------------------------------------------------------------


def naive_divergence(zs, zt, kind, beta=0.5, normalized=True, T=1.0):
    ls = (zs / T).log_softmax(-1)
    lt = (zt / T).log_softmax(-1)
    ps, pt = ls.exp(), lt.exp()
    if kind == "reverse_kl":
        return (ps * (ls - lt)).sum(-1)
    if kind == "forward_kl":
        return (pt * (lt - ls)).sum(-1)
    lm = torch.logaddexp(lt + math.log(beta), ls + math.log(1 - beta))
    jsd = beta * (pt * (lt - lm)).sum(-1) + (1 - beta) * (ps * (ls - lm)).sum(-1)
    return jsd / (beta * (1 - beta)) if normalized else jsd


def naive_loss(zs, zt, mask, kind, aggregation="token_mean", **kw):
    d = naive_divergence(zs, zt, kind, **kw)
    return aggregate(torch.where(mask, d, torch.zeros_like(d)), mask, aggregation)


LOSSES = {
    "reverse_kl": reverse_kl_distill_loss,
    "forward_kl": forward_kl_distill_loss,
    "jsd": jsd_distill_loss,
}


def make(seed, B, L, H, V, p_valid=0.7, scale=2.0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, L, H, generator=g, dtype=dtype)
    ws = torch.randn(V, H, generator=g, dtype=dtype) * scale / math.sqrt(H)
    bs = torch.randn(V, generator=g, dtype=dtype)
    ht = torch.randn(B, L, H + 1, generator=g, dtype=dtype)
    wt = torch.randn(V, H + 1, generator=g, dtype=dtype) * scale / math.sqrt(H + 1)
    mask = torch.rand(B, L, generator=g) < p_valid
    return hs, ws, bs, ht, wt, mask


# ---------------------------------------------------------------------------------------
# hand-derived worked numbers (§14)
# ---------------------------------------------------------------------------------------


def two_token_logits():
    # student pi_s = (1/2, 1/2), teacher pi_t = (1/4, 3/4)
    zs = torch.zeros(1, 1, 2, dtype=F64, requires_grad=True)
    zt = torch.tensor([[[0.0, math.log(3.0)]]], dtype=F64)
    return zs, zt, torch.ones(1, 1, dtype=torch.bool)


def test_worked_reverse_forward_jsd_values():
    zs, zt, mask = two_token_logits()
    rev = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)                      # = 0.5 log(4/3)
    fwd = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    m = (0.5 * 0.25 + 0.5 * 0.5, 0.5 * 0.75 + 0.5 * 0.5)                                 # (3/8, 5/8)
    js = 0.5 * (0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1])) \
        + 0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1]))
    assert rev == pytest.approx(0.5 * math.log(4 / 3), abs=1e-15)
    r = reverse_kl_distill_loss(student_logits=zs, teacher_logits=zt, mask=mask)
    assert r.loss.item() == pytest.approx(rev, abs=1e-15)
    assert r.metrics["reverse_kl"].item() == pytest.approx(rev, abs=1e-15)
    assert r.metrics["student_entropy"].item() == pytest.approx(math.log(2), abs=1e-15)
    assert r.metrics["teacher_entropy"].item() == pytest.approx(
        -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-15)
    assert r.metrics["token_count"].item() == 1
    f = forward_kl_distill_loss(student_logits=zs, teacher_logits=zt, mask=mask)
    assert f.loss.item() == pytest.approx(fwd, abs=1e-15)
    j = jsd_distill_loss(student_logits=zs, teacher_logits=zt, mask=mask, beta=0.5, normalized=False)
    assert j.loss.item() == pytest.approx(js, abs=1e-15)
    jn = jsd_distill_loss(student_logits=zs, teacher_logits=zt, mask=mask, beta=0.5)
    assert jn.loss.item() == pytest.approx(4 * js, abs=1e-14)


def test_worked_gradients_match_hand_derivation():
    zs, zt, mask = two_token_logits()
    rev = 0.5 * math.log(4 / 3)
    # d KL(ps||pt) / d zs_v = ps_v (log ps_v - log pt_v - KL)
    want_rev = [0.5 * (math.log(0.5 / 0.25) - rev), 0.5 * (math.log(0.5 / 0.75) - rev)]
    (g,) = torch.autograd.grad(reverse_kl_distill_loss(student_logits=zs, teacher_logits=zt, mask=mask).loss, [zs])
    assert g[0, 0].tolist() == pytest.approx(want_rev, abs=1e-15)
    # d KL(pt||ps) / d zs = ps - pt
    (g,) = torch.autograd.grad(forward_kl_distill_loss(student_logits=zs, teacher_logits=zt, mask=mask).loss, [zs])
    assert g[0, 0].tolist() == pytest.approx([0.5 - 0.25, 0.5 - 0.75], abs=1e-15)
    # plain JSD(1/2): (1 - beta) ps_v (log ps_v - log m_v - KL(ps||m)), m = (3/8, 5/8)
    ksm = 0.5 * math.log(0.5 / 0.375) + 0.5 * math.log(0.5 / 0.625)
    want = [0.5 * 0.5 * (math.log(0.5 / 0.375) - ksm), 0.5 * 0.5 * (math.log(0.5 / 0.625) - ksm)]
    (g,) = torch.autograd.grad(
        jsd_distill_loss(student_logits=zs, teacher_logits=zt, mask=mask, normalized=False).loss, [zs])
    assert g[0, 0].tolist() == pytest.approx(want, abs=1e-15)
    # temperature T divides the logit gradient: z/T with T = 2 halves it at the same distributions
    (g2,) = torch.autograd.grad(
        forward_kl_distill_loss(student_logits=zs, teacher_logits=2 * zt, mask=mask, temperature=2.0).loss, [zs])
    assert g2[0, 0].tolist() == pytest.approx([0.125, -0.125], abs=1e-15)


# ---------------------------------------------------------------------------------------
# equality with the naive full-logit computation (values + gradients), hypothesis
# ---------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 3),
    L=st.integers(1, 7),
    H=st.integers(1, 5),
    V=st.integers(1, 11),
    chunk=st.integers(1, 6),
    kind=st.sampled_from(["reverse_kl", "forward_kl", "jsd"]),
    beta=st.sampled_from([0.1, 0.5, 0.9]),
    normalized=st.booleans(),
    aggregation=st.sampled_from(MODES),
    T=st.sampled_from([0.6, 1.0, 1.5]),
    with_bias=st.booleans(),
)
def test_hidden_path_equals_naive(seed, B, L, H, V, chunk, kind, beta, normalized, aggregation, T, with_bias):
    hs, ws, bs, ht, wt, mask = make(seed, B, L, H, V)
    bs = bs if with_bias else None
    kw = dict(beta=beta, normalized=normalized) if kind == "jsd" else {}
    # poisoned masked rows (student and teacher): must not leak
    hs_in, ht_in = hs.clone(), ht.clone()
    hs_in[~mask] = float("nan")
    ht_in[~mask] = float("inf")
    p = [hs_in.requires_grad_(), ws.clone().requires_grad_()] + ([bs.clone().requires_grad_()] if with_bias else [])
    res = LOSSES[kind](student_hidden=p[0], student_weight=p[1], student_bias=p[2] if with_bias else None,
                       teacher_hidden=ht_in, teacher_weight=wt, mask=mask, temperature=T,
                       aggregation=aggregation, chunk_size=chunk, **kw)
    q = [hs.clone().requires_grad_(), ws.clone().requires_grad_()] + ([bs.clone().requires_grad_()] if with_bias else [])
    zs = q[0] @ q[1].T + (q[2] if with_bias else 0)
    ref = naive_loss(zs, ht @ wt.T, mask, kind, aggregation, T=T, **kw)
    assert torch.allclose(res.loss, ref, atol=1e-12, rtol=1e-10)
    got = torch.autograd.grad(res.loss, p)
    want = torch.autograd.grad(ref, q, allow_unused=True)
    for a, b in zip(got, want):
        b = torch.zeros_like(a) if b is None else b
        assert torch.isfinite(a).all()
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-9)
    assert (got[0][~mask] == 0).all()


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 3),
    L=st.integers(1, 6),
    V=st.integers(1, 9),
    chunk=st.integers(1, 5),
    kind=st.sampled_from(["reverse_kl", "forward_kl", "jsd"]),
    aggregation=st.sampled_from(MODES),
)
def test_logits_path_equals_naive(seed, B, L, V, chunk, kind, aggregation):
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(B, L, V, generator=g, dtype=F64) * 3
    zt = torch.randn(B, L, V, generator=g, dtype=F64) * 3
    mask = torch.rand(B, L, generator=g) < 0.7
    zs_in, zt_in = zs.clone(), zt.clone()
    zs_in[~mask] = float("nan")
    zt_in[~mask] = -float("inf")
    zs_in.requires_grad_()
    res = LOSSES[kind](student_logits=zs_in, teacher_logits=zt_in, mask=mask, aggregation=aggregation,
                       chunk_size=chunk)
    zq = zs.clone().requires_grad_()
    ref = naive_loss(zq, zt, mask, kind, aggregation)
    assert torch.allclose(res.loss, ref, atol=1e-12, rtol=1e-10)
    (a,) = torch.autograd.grad(res.loss, [zs_in])
    (b,) = torch.autograd.grad(ref, [zq])
    assert torch.allclose(a, b, atol=1e-12, rtol=1e-9)
    assert (a[~mask] == 0).all()           # §24: masked logit gradient is zero


def test_mixed_sides_and_metrics_match_naive():
    hs, ws, bs, ht, wt, mask = make(1, 2, 5, 4, 8)
    zt = ht @ wt.T
    a = reverse_kl_distill_loss(student_hidden=hs, student_weight=ws, student_bias=bs, teacher_logits=zt, mask=mask)
    b = reverse_kl_distill_loss(student_logits=hs @ ws.T + bs, teacher_hidden=ht, teacher_weight=wt, mask=mask)
    assert torch.allclose(a.loss, b.loss, atol=1e-13)
    ls = (hs @ ws.T + bs).log_softmax(-1)
    lt = zt.log_softmax(-1)
    for key, val in [("reverse_kl", (ls.exp() * (ls - lt)).sum(-1)), ("student_entropy", -(ls.exp() * ls).sum(-1)),
                     ("teacher_entropy", -(lt.exp() * lt).sum(-1))]:
        assert torch.allclose(a.metrics[key], val[mask].mean(), atol=1e-13)
        assert not a.metrics[key].requires_grad
    assert a.metrics["token_count"].item() == mask.sum().item()


# ---------------------------------------------------------------------------------------
# §24: exact reverse KL >= 0, = 0 for equal distributions; padding; denominators
# ---------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), V=st.integers(1, 40), scale=st.sampled_from([0.01, 1.0, 10.0, 50.0]))
def test_reverse_kl_nonnegative_and_zero_for_equal(seed, V, scale):
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(2, 5, V, generator=g, dtype=F64) * scale
    zt = torch.randn(2, 5, V, generator=g, dtype=F64) * scale
    mask = torch.ones(2, 5, dtype=torch.bool)
    res = reverse_kl_distill_loss(student_logits=zs, teacher_logits=zt, mask=mask)
    assert res.loss.item() >= -1e-12
    # identical distributions, including logits that differ by a per-position constant
    shift = torch.randn(2, 5, 1, generator=g, dtype=F64) * 7
    zq = zs.clone().requires_grad_()
    same = reverse_kl_distill_loss(student_logits=zq, teacher_logits=zs + shift, mask=mask)
    assert abs(same.loss.item()) <= 1e-12 * max(1.0, scale)
    (gz,) = torch.autograd.grad(same.loss, [zq])
    assert gz.abs().max().item() <= 1e-12 * max(1.0, scale)
    for fn in (forward_kl_distill_loss, jsd_distill_loss):
        assert abs(fn(student_logits=zs, teacher_logits=zs + shift, mask=mask).loss.item()) <= 1e-12 * max(1.0, scale)


def test_padding_does_not_change_loss():
    hs, ws, bs, ht, wt, mask = make(2, 3, 6, 4, 7)
    base = reverse_kl_distill_loss(student_hidden=hs, student_weight=ws, teacher_hidden=ht, teacher_weight=wt,
                                   mask=mask, aggregation="seq_mean_token_mean")
    pad = lambda x: torch.cat([x, torch.full_like(x[:, :3], float("nan"))], dim=1)  # noqa: E731
    padded_mask = torch.cat([mask, torch.zeros(3, 3, dtype=torch.bool)], dim=1)
    more = reverse_kl_distill_loss(student_hidden=pad(hs), student_weight=ws, teacher_hidden=pad(ht),
                                   teacher_weight=wt, mask=padded_mask, aggregation="seq_mean_token_mean")
    assert torch.allclose(base.loss, more.loss, atol=1e-14)
    empty_rows = torch.cat([mask, torch.zeros(2, 6, dtype=torch.bool)], dim=0)
    extra = reverse_kl_distill_loss(student_hidden=torch.cat([hs, hs[:2]]), student_weight=ws,
                                    teacher_hidden=torch.cat([ht, ht[:2]]), teacher_weight=wt, mask=empty_rows,
                                    aggregation="seq_mean_token_mean")
    assert torch.allclose(base.loss, extra.loss, atol=1e-14)


def test_micro_batches_with_global_denominator_sum_to_full_batch():
    hs, ws, bs, ht, wt, mask = make(3, 4, 5, 3, 6)
    mask[0] = True
    full_w = ws.clone().requires_grad_()
    full = reverse_kl_distill_loss(student_hidden=hs, student_weight=full_w, teacher_hidden=ht, teacher_weight=wt,
                                   mask=mask)
    (g_full,) = torch.autograd.grad(full.loss, [full_w])
    norm = Normalizer.from_masks([mask[:2], mask[2:]], "token_mean")
    w = ws.clone().requires_grad_()
    total = 0.0
    for sl in (slice(0, 2), slice(2, 4)):
        part = reverse_kl_distill_loss(student_hidden=hs[sl], student_weight=w, teacher_hidden=ht[sl],
                                       teacher_weight=wt, mask=mask[sl], denominator=norm.denominator())
        part.loss.backward()
        total = total + part.loss.detach()
    assert torch.allclose(total, full.loss.detach(), atol=1e-14)
    assert torch.allclose(w.grad, g_full, atol=1e-14)


def test_empty_mask_gives_zero_loss_and_zero_grad():
    hs, ws, bs, ht, wt, _ = make(4, 2, 3, 3, 5)
    w = ws.clone().requires_grad_()
    mask = torch.zeros(2, 3, dtype=torch.bool)
    res = reverse_kl_distill_loss(student_hidden=hs, student_weight=w, teacher_hidden=ht, teacher_weight=wt, mask=mask)
    assert res.loss.item() == 0.0 and res.metrics["token_count"].item() == 0
    res.loss.backward()
    assert (w.grad == 0).all()


def test_gradient_reaches_student_only():
    hs, ws, bs, ht, wt, mask = make(5, 2, 4, 3, 6)
    ht_r, wt_r = ht.clone().requires_grad_(), wt.clone().requires_grad_()
    s = hs.clone().requires_grad_()
    res = reverse_kl_distill_loss(student_hidden=s, student_weight=ws, teacher_hidden=ht_r, teacher_weight=wt_r,
                                  mask=mask)
    res.loss.backward()
    assert ht_r.grad is None and wt_r.grad is None and s.grad is not None
    zt = (ht @ wt.T).requires_grad_()
    res = forward_kl_distill_loss(student_hidden=s, student_weight=ws, teacher_logits=zt, mask=mask)
    res.loss.backward()
    assert zt.grad is None


def test_float32_hidden_path_close_to_float64():
    hs, ws, bs, ht, wt, mask = make(6, 2, 20, 16, 500, scale=4.0)
    r32 = reverse_kl_distill_loss(student_hidden=hs.float(), student_weight=ws.float(), teacher_hidden=ht.float(),
                                  teacher_weight=wt.float(), mask=mask, chunk_size=7)
    ref = naive_loss(hs @ ws.T, ht @ wt.T, mask, "reverse_kl")
    assert r32.loss.dtype == torch.float32
    assert abs(r32.loss.item() - ref.item()) <= 1e-5 * max(1.0, abs(ref.item()))


# ---------------------------------------------------------------------------------------
# sampled-token approximation: a different objective (§14)
# ---------------------------------------------------------------------------------------


def _constructed_distributions():
    zs = torch.tensor([2.0, 0.5, -1.0, 0.0, 1.0], dtype=F64)
    zt = torch.tensor([0.0, 2.0, 0.5, -1.0, 1.5], dtype=F64)
    return zs, zt


def test_sampled_token_kl_differs_from_exact_but_is_unbiased_in_mean():
    zs, zt = _constructed_distributions()
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    exact = reverse_kl_distill_loss(student_logits=zs[None, None], teacher_logits=zt[None, None],
                                    mask=torch.ones(1, 1)).loss.item()
    # single samples differ from the exact value (every token's k1 differs from it here)
    k1_all = (ls - lt)
    assert (k1_all - exact).abs().min().item() > 0.05
    one = sampled_token_kl(ls[None, :1], lt[None, :1], torch.ones(1, 1)).loss.item()
    assert abs(one - exact) > 0.05
    # Monte Carlo: y ~ pi_s, many draws; mean of k1 -> exact KL. Tolerance 4 standard errors
    # (the mean of N i.i.d. draws has standard error sd(k1)/sqrt(N); a 4-SE band holds with
    # probability > 0.9999 by the CLT, and the seed is fixed).
    N = 40_000
    g = torch.Generator().manual_seed(0)
    y = torch.multinomial(ls.exp(), N, replacement=True, generator=g)
    res = sampled_token_kl(ls[y][None], lt[y][None], torch.ones(1, N))
    sd = (ls - lt)[y].std().item()
    se = sd / math.sqrt(N)
    assert res.metrics["token_count"].item() == N
    assert abs(res.loss.item() - exact) <= 4 * se
    assert se < 0.02  # the test is informative: the band is narrower than the gap above


def test_sampled_token_gradient_is_not_the_kl_gradient():
    # Exact expectations over y ~ pi_s (enumerating the vocabulary, no sampling):
    #   E[grad k1(y)] = sum_y pi(y) (onehot(y) - pi) = 0          (score-function identity)
    #   E[sg(k1(y)) grad log pi(y)] = grad KL(pi_s || pi_t)         (the reward form)
    zs, zt = _constructed_distributions()
    V = zs.numel()
    z = zs.clone().requires_grad_()
    (g_exact,) = torch.autograd.grad(
        reverse_kl_distill_loss(student_logits=z[None, None], teacher_logits=zt[None, None],
                                mask=torch.ones(1, 1)).loss, [z])
    p = zs.softmax(-1)
    lt = zt.log_softmax(-1)
    mean_k1_grad = torch.zeros(V, dtype=F64)
    reward_form = torch.zeros(V, dtype=F64)
    for y in range(V):
        zz = zs.clone().requires_grad_()
        lsy = zz.log_softmax(-1)[y]
        res = sampled_token_kl(lsy.reshape(1, 1), lt[y].reshape(1, 1), torch.ones(1, 1))
        (gk,) = torch.autograd.grad(res.loss, [zz])
        mean_k1_grad += p[y] * gk
        advantage = -res.loss.detach()                  # A_t = -sg(k1)
        (gl,) = torch.autograd.grad(-advantage * zz.log_softmax(-1)[y], [zz])
        reward_form += p[y] * gl
    assert mean_k1_grad.abs().max().item() < 1e-15
    assert g_exact.abs().max().item() > 0.05
    assert torch.allclose(reward_form, g_exact, atol=1e-14)


def test_sampled_token_kl_masks_and_detaches():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, 4, generator=g, dtype=F64)
    t = torch.randn(2, 4, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    s_in, t_in = s.clone(), t.clone()
    s_in[~mask] = float("nan")
    t_in[~mask] = float("inf")
    s_in.requires_grad_()
    t_in.requires_grad_()
    res = sampled_token_kl(s_in, t_in, mask, aggregation="seq_mean_token_mean")
    want = ((s[0, 0] - t[0, 0] + s[0, 1] - t[0, 1]) / 2 + (s[1, 0] - t[1, 0] + s[1, 2] - t[1, 2]) / 2) / 2
    assert res.loss.item() == pytest.approx(want.item(), abs=1e-15)
    res.loss.backward()
    assert t_in.grad is None
    assert torch.equal(s_in.grad, torch.where(mask, torch.full_like(s, 0.25), torch.zeros_like(s)))


# ---------------------------------------------------------------------------------------
# JSD limits
# ---------------------------------------------------------------------------------------


def test_jsd_limits_and_direction():
    hs, ws, bs, ht, wt, mask = make(2, 2, 6, 4, 9, scale=1.0)
    kw = dict(student_hidden=hs, student_weight=ws, teacher_hidden=ht, teacher_weight=wt, mask=mask)
    fwd = forward_kl_distill_loss(**kw).loss.item()
    rev = reverse_kl_distill_loss(**kw).loss.item()
    # Tolerance, derived per position with r = pt/ps, d = beta (near 0):
    #   JSD_n(d) = [F - sum pt log(1 + d(r - 1))]/(1 - d) + KL(ps||m)/d,
    #   |sum pt log(1 + d(r-1))| <= d (2 + chi2(pt||ps))/(1 - d),  KL(ps||m) <= chi2(ps||m) <= d^2 chi2(pt||ps)/(1-d),
    # so |JSD_n(d) - F| <= d/(1-d)^2 (F + 2 + 2 chi2(pt||ps)); symmetrically near 1 with ps, pt swapped.
    # (The approach is O(d) but with a constant that grows with chi2: tokens with pt/ps ~ 1/d are not yet
    # in the linear regime, hence a moderate-scale case.)
    zs, zt = hs @ ws.T, ht @ wt.T
    ps, pt = zs.softmax(-1), zt.softmax(-1)
    chi_ts = (pt ** 2 / ps).sum(-1) - 1
    chi_st = (ps ** 2 / pt).sum(-1) - 1
    F = naive_divergence(zs, zt, "forward_kl")
    R = naive_divergence(zs, zt, "reverse_kl")
    eps = 1e-4
    tol0 = (eps / (1 - eps) ** 2 * (F + 2 + 2 * chi_ts))[mask].mean().item()
    tol1 = (eps / (1 - eps) ** 2 * (R + 2 + 2 * chi_st))[mask].mean().item()
    assert abs(fwd - rev) > 20 * max(tol0, tol1)          # the two ends are told apart
    near0 = jsd_distill_loss(beta=eps, **kw).loss.item()
    near1 = jsd_distill_loss(beta=1 - eps, **kw).loss.item()
    assert abs(near0 - fwd) <= tol0 and abs(near0 - rev) > 10 * tol0   # beta -> 0: forward KL
    assert abs(near1 - rev) <= tol1 and abs(near1 - fwd) > 10 * tol1   # beta -> 1: reverse KL
    # continuity: the gap shrinks proportionally to eps (no jump at the end point)
    gap1 = abs(near0 - fwd)
    gap2 = abs(jsd_distill_loss(beta=eps / 2, **kw).loss.item() - fwd)
    assert gap2 == pytest.approx(gap1 / 2, rel=5e-2)
    # at the ends: exactly the limit (value and gradient)
    for beta, other in ((0.0, forward_kl_distill_loss), (1.0, reverse_kl_distill_loss)):
        w1, w2 = ws.clone().requires_grad_(), ws.clone().requires_grad_()
        a = jsd_distill_loss(beta=beta, **{**kw, "student_weight": w1})
        b = other(**{**kw, "student_weight": w2})
        assert torch.allclose(a.loss, b.loss, atol=1e-13)
        (ga,) = torch.autograd.grad(a.loss, [w1])
        (gb,) = torch.autograd.grad(b.loss, [w2])
        assert torch.allclose(ga, gb, atol=1e-13)
    # plain JSD -> 0 at both ends, ~beta * KL near them
    for beta in (0.0, 1.0):
        w1 = ws.clone().requires_grad_()
        plain = jsd_distill_loss(beta=beta, normalized=False, **{**kw, "student_weight": w1})
        assert plain.loss.item() == 0.0
        (g,) = torch.autograd.grad(plain.loss, [w1])
        assert (g == 0).all()
    p0 = jsd_distill_loss(beta=eps, normalized=False, **kw).loss.item()
    assert p0 == pytest.approx(eps * (1 - eps) * near0, rel=1e-12)
    # symmetric JS at beta = 1/2 is bounded by log 2
    assert jsd_distill_loss(beta=0.5, normalized=False, **kw).loss.item() <= math.log(2)


def test_jsd_near_ends_accurate_in_float32():
    # the log-mixture ratios are evaluated without cancellation: float32 near the ends
    # agrees with a float64 evaluation to float32 precision
    hs, ws, bs, ht, wt, mask = make(8, 1, 8, 4, 50, scale=3.0)
    for beta in (1e-4, 1 - 1e-4):
        r64 = jsd_distill_loss(student_hidden=hs, student_weight=ws, teacher_hidden=ht, teacher_weight=wt,
                               mask=mask, beta=beta).loss.item()
        r32 = jsd_distill_loss(student_hidden=hs.float(), student_weight=ws.float(), teacher_hidden=ht.float(),
                               teacher_weight=wt.float(), mask=mask, beta=beta).loss.item()
        assert abs(r32 - r64) <= 1e-4 * max(1.0, abs(r64))


# ---------------------------------------------------------------------------------------
# multi-teacher (§15)
# ---------------------------------------------------------------------------------------


def test_one_teacher_with_weight_one_equals_single_teacher():
    hs, ws, bs, ht, wt, mask = make(9, 2, 5, 4, 7)
    w1, w2 = ws.clone().requires_grad_(), ws.clone().requires_grad_()
    single = reverse_kl_distill_loss(student_hidden=hs, student_weight=w1, teacher_hidden=ht, teacher_weight=wt,
                                     mask=mask, aggregation="seq_mean_token_sum")
    multi = multi_teacher_distill_loss(student_hidden=hs, student_weight=w2, teachers=[(ht, wt)], mask=mask,
                                       weights=torch.tensor([1.0]), aggregation="seq_mean_token_sum")
    assert torch.allclose(single.loss, multi.loss, atol=1e-15)
    (g1,) = torch.autograd.grad(single.loss, [w1])
    (g2,) = torch.autograd.grad(multi.loss, [w2])
    assert torch.allclose(g1, g2, atol=1e-15)
    assert torch.allclose(multi.metrics["reverse_kl"], single.metrics["reverse_kl"], atol=1e-15)
    assert multi.metrics["weight_entropy"].item() == 0.0
    assert multi.metrics["teacher_disagreement"].item() == 0.0


def test_fixed_weights_are_renormalized_and_mix_kls():
    hs, ws, bs, ht, wt, mask = make(10, 2, 5, 4, 7)
    zt2 = torch.randn(2, 5, 7, dtype=F64, generator=torch.Generator().manual_seed(1))
    kl1 = reverse_kl_distill_loss(student_hidden=hs, student_weight=ws, teacher_hidden=ht, teacher_weight=wt,
                                  mask=mask).loss
    kl2 = reverse_kl_distill_loss(student_hidden=hs, student_weight=ws, teacher_logits=zt2, mask=mask).loss
    multi = multi_teacher_distill_loss(student_hidden=hs, student_weight=ws, teachers=[(ht, wt), zt2], mask=mask,
                                       weights=[2.0, 6.0])
    assert torch.allclose(multi.loss, 0.25 * kl1 + 0.75 * kl2, atol=1e-14)
    assert multi.metrics["weight/teacher1"].item() == pytest.approx(0.75)
    assert multi.metrics["weight_entropy"].item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    uniform = multi_teacher_distill_loss(student_hidden=hs, student_weight=ws, teachers=[(ht, wt), zt2], mask=mask)
    assert torch.allclose(uniform.loss, 0.5 * kl1 + 0.5 * kl2, atol=1e-14)
    assert uniform.metrics["weight_entropy"].item() == pytest.approx(math.log(2))
    zero_second = multi_teacher_distill_loss(student_hidden=hs, student_weight=ws, teachers=[(ht, wt), zt2],
                                             mask=mask, weights=torch.tensor([1.0, 0.0]))
    assert torch.allclose(zero_second.loss, kl1, atol=1e-14)


def test_routing_selects_the_teacher_per_token():
    hs, ws, bs, ht, wt, mask = make(11, 3, 6, 4, 7)
    mask[0, 0] = True
    g = torch.Generator().manual_seed(2)
    zt2 = torch.randn(3, 6, 7, dtype=F64, generator=g) * 2
    routing = torch.randint(0, 2, (3, 6), generator=g)
    routing[~mask] = -1                      # ids at masked positions are ignored
    routing[0, 0] = 1
    w_multi = ws.clone().requires_grad_()
    multi = multi_teacher_distill_loss(student_hidden=hs, student_weight=w_multi, teachers=[(ht, wt), zt2],
                                       mask=mask, routing=routing)
    # expected: the routed sub-masks with the global denominator (token_mean over all valid tokens)
    D = mask.sum().to(F64)
    w_ref = ws.clone().requires_grad_()
    part0 = reverse_kl_distill_loss(student_hidden=hs, student_weight=w_ref, teacher_hidden=ht, teacher_weight=wt,
                                    mask=mask & (routing == 0), denominator=D)
    part1 = reverse_kl_distill_loss(student_hidden=hs, student_weight=w_ref, teacher_logits=zt2,
                                    mask=mask & (routing == 1), denominator=D)
    assert torch.allclose(multi.loss, part0.loss + part1.loss, atol=1e-14)
    (g1,) = torch.autograd.grad(multi.loss, [w_multi])
    (g2,) = torch.autograd.grad(part0.loss + part1.loss, [w_ref])
    assert torch.allclose(g1, g2, atol=1e-14)
    assert multi.metrics["weight_entropy"].item() == 0.0
    assert torch.allclose(multi.metrics["kl/teacher1"], part1.metrics["reverse_kl"], atol=1e-14)
    assert multi.metrics["weight/teacher1"].item() == pytest.approx((mask & (routing == 1)).sum().item() / D.item())


def test_confidence_weighting_favours_low_entropy_teacher():
    B, L, V = 2, 4, 6
    g = torch.Generator().manual_seed(3)
    zs = torch.randn(B, L, V, generator=g, dtype=F64)
    sharp = torch.randn(B, L, V, generator=g, dtype=F64) * 8       # low entropy
    flat = torch.randn(B, L, V, generator=g, dtype=F64) * 0.1       # near uniform, high entropy
    mask = torch.ones(B, L, dtype=torch.bool)
    tau = 0.5
    res = multi_teacher_distill_loss(student_logits=zs, teachers=[flat, sharp], mask=mask, weights="entropy",
                                     entropy_temperature=tau)
    assert res.metrics["weight/teacher1"] > res.metrics["weight/teacher0"]
    # hand formula: w_i = softmax_i(-H_i / tau) per position, loss = mean_n sum_i w_i KL_i
    ent = lambda z: -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)                    # noqa: E731
    H = torch.stack([ent(flat), ent(sharp)], -1)
    w = torch.exp(-H / tau) / torch.exp(-H / tau).sum(-1, keepdim=True)
    kls = torch.stack([naive_divergence(zs, flat, "reverse_kl"), naive_divergence(zs, sharp, "reverse_kl")], -1)
    assert torch.allclose(res.loss, (w * kls).sum(-1).mean(), atol=1e-14)
    assert (w[..., 1] > w[..., 0]).all()


def test_vocabulary_mismatch_and_token_maps():
    B, L, V = 2, 3, 5
    g = torch.Generator().manual_seed(4)
    zs = torch.randn(B, L, V, generator=g, dtype=F64, requires_grad=True)
    mask = torch.ones(B, L, dtype=torch.bool)
    zt_big = torch.randn(B, L, V + 3, generator=g, dtype=F64)
    with pytest.raises(ValueError, match="teachers"):
        multi_teacher_distill_loss(student_logits=zs, teachers=[zt_big], mask=mask)
    # map: student token v <- teacher token tmap[v]; the teacher is pulled back and renormalized
    tmap = torch.tensor([7, 0, 3, 5, 1])
    res = multi_teacher_distill_loss(student_logits=zs, teachers=[zt_big], mask=mask, token_maps=[tmap])
    pulled = zt_big[..., tmap]
    ref = reverse_kl_distill_loss(student_logits=zs, teacher_logits=pulled, mask=mask)
    assert torch.allclose(res.loss, ref.loss, atol=1e-15)
    # by hand at one position: renormalized teacher probabilities of the mapped ids
    pt_full = zt_big[0, 0].softmax(-1)
    pt = pt_full[tmap] / pt_full[tmap].sum()
    ps = zs[0, 0].softmax(-1)
    one = multi_teacher_distill_loss(student_logits=zs[:1, :1], teachers=[zt_big[:1, :1]],
                                     mask=mask[:1, :1], token_maps=[tmap])
    assert one.loss.item() == pytest.approx((ps * (ps.log() - pt.log())).sum().item(), abs=1e-14)
    # hidden-state teacher with a map: the head rows are gathered
    ht = torch.randn(B, L, 3, generator=g, dtype=F64)
    wt = torch.randn(V + 3, 3, generator=g, dtype=F64)
    bt = torch.randn(V + 3, generator=g, dtype=F64)
    res_h = multi_teacher_distill_loss(student_logits=zs, teachers=[(ht, wt, bt)], mask=mask, token_maps=[tmap])
    ref_h = reverse_kl_distill_loss(student_logits=zs, teacher_logits=(ht @ wt.T + bt)[..., tmap], mask=mask)
    assert torch.allclose(res_h.loss, ref_h.loss, atol=1e-14)
    # a map per teacher, None where the vocabularies already match
    zt_same = torch.randn(B, L, V, generator=g, dtype=F64)
    both = multi_teacher_distill_loss(student_logits=zs, teachers=[zt_same, zt_big], mask=mask,
                                      token_maps=[None, tmap])
    single = reverse_kl_distill_loss(student_logits=zs, teacher_logits=zt_same, mask=mask).loss
    assert torch.allclose(both.loss, 0.5 * single + 0.5 * ref.loss, atol=1e-14)


def test_teacher_disagreement_metric():
    B, L, V = 2, 3, 5
    g = torch.Generator().manual_seed(5)
    zs = torch.randn(B, L, V, generator=g, dtype=F64)
    t1 = torch.randn(B, L, V, generator=g, dtype=F64)
    t2 = torch.randn(B, L, V, generator=g, dtype=F64) * 3
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    same = multi_teacher_distill_loss(student_logits=zs, teachers=[t1, t1.clone()], mask=mask)
    assert abs(same.metrics["teacher_disagreement"].item()) < 1e-14
    res = multi_teacher_distill_loss(student_logits=zs, teachers=[t1, t2], mask=mask)
    p, q = t1.softmax(-1), t2.softmax(-1)
    m = 0.5 * (p + q)
    js = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    assert res.metrics["teacher_disagreement"].item() == pytest.approx(js[mask].mean().item(), abs=1e-14)
    assert 0 < res.metrics["teacher_disagreement"].item() <= math.log(2)
    off = multi_teacher_distill_loss(student_logits=zs, teachers=[t1, t2], mask=mask, disagreement=False)
    assert off.metrics["teacher_disagreement"].item() == 0.0


# ---------------------------------------------------------------------------------------
# NaN/inf in masked slots: loss and gradient finite and unchanged (every loss)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["reverse_kl", "forward_kl", "jsd", "multi"])
def test_poisoned_masked_slots_leave_loss_and_grad_unchanged(name):
    hs, ws, bs, ht, wt, mask = make(12, 3, 5, 4, 6)
    zt2 = torch.randn(3, 5, 6, dtype=F64, generator=torch.Generator().manual_seed(6))

    def run(h, t_h, t_z):
        w = ws.clone().requires_grad_()
        h = h.clone().requires_grad_()
        if name == "multi":
            res = multi_teacher_distill_loss(student_hidden=h, student_weight=w, teachers=[(t_h, wt), t_z],
                                             mask=mask, weights="entropy")
        else:
            res = LOSSES[name](student_hidden=h, student_weight=w, teacher_hidden=t_h, teacher_weight=wt, mask=mask)
        return res.loss, torch.autograd.grad(res.loss, [h, w])

    clean = run(hs, ht, zt2)
    h_bad, t_bad, z_bad = hs.clone(), ht.clone(), zt2.clone()
    h_bad[~mask] = float("nan")
    t_bad[~mask] = float("inf")
    z_bad[~mask] = float("nan")
    dirty = run(h_bad, t_bad, z_bad)
    assert torch.isfinite(dirty[0]) and torch.equal(clean[0], dirty[0])
    for a, b in zip(clean[1], dirty[1]):
        assert torch.isfinite(b).all() and torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------


def test_bad_inputs_single_teacher():
    hs, ws, bs, ht, wt, mask = make(13, 2, 4, 3, 5)
    zs, zt = hs @ ws.T, ht @ wt.T
    ok = dict(student_logits=zs, teacher_logits=zt, mask=mask)
    cases = [
        (dict(student_logits=None), "student_logits"),
        (dict(teacher_logits=None), "teacher_logits"),
        (dict(student_hidden=hs), "student_logits"),
        (dict(student_logits=None, student_hidden=hs), "student_weight"),
        (dict(student_logits=None, student_weight=ws), "student_hidden"),
        (dict(student_bias=bs), "student_bias"),
        (dict(student_logits=zs[:, :3]), "student_logits"),
        (dict(student_logits=zs[0]), "student_logits"),
        (dict(teacher_logits=zt[..., :4]), "teacher_logits"),
        (dict(teacher_logits=None, teacher_hidden=ht, teacher_weight=wt[:4]), "teacher_weight"),
        (dict(teacher_logits=None, teacher_hidden=ht, teacher_weight=wt[:, :2]), "teacher_weight"),
        (dict(teacher_logits=None, teacher_hidden=ht[:, :2], teacher_weight=wt), "teacher_hidden"),
        (dict(student_logits=None, student_hidden=hs, student_weight=ws, student_bias=bs[:2]), "student_bias"),
        (dict(mask=mask.float() * 2), "mask"),
        (dict(mask=mask[:, :2]), "student_logits"),
        (dict(mask=None), "mask"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-2.0), "temperature"),
        (dict(aggregation="mean"), "aggregation"),
        (dict(constant=3.0), "constant"),
        (dict(denominator=0.0), "denominator"),
        (dict(chunk_size=0), "chunk_size"),
    ]
    for fn in (reverse_kl_distill_loss, forward_kl_distill_loss, jsd_distill_loss):
        for override, name in cases:
            with pytest.raises(ValueError, match=name):
                fn(**{**ok, **override})
    nan_zs = zs.clone()
    valid = mask.nonzero()[0]
    nan_zs[valid[0], valid[1], 0] = float("nan")
    with pytest.raises(ValueError, match="student_logits"):
        reverse_kl_distill_loss(**{**ok, "student_logits": nan_zs})
    bad_ht = ht.clone()
    bad_ht[valid[0], valid[1], 0] = float("inf")
    with pytest.raises(ValueError, match="teacher_hidden"):
        reverse_kl_distill_loss(student_logits=zs, teacher_hidden=bad_ht, teacher_weight=wt, mask=mask)
    for beta in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="beta"):
            jsd_distill_loss(**ok, beta=beta)


def test_bad_inputs_sampled_and_multi():
    g = torch.Generator().manual_seed(7)
    s = torch.randn(2, 3, generator=g, dtype=F64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="teacher_logp"):
        sampled_token_kl(s, s[:, :2], mask)
    with pytest.raises(ValueError, match="mask"):
        sampled_token_kl(s, s, mask[:, :2])
    bad = s.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="student_logp"):
        sampled_token_kl(bad, s, mask)
    with pytest.raises(ValueError, match="teacher_logp"):
        sampled_token_kl(s, bad, mask)
    with pytest.raises(ValueError, match="aggregation"):
        sampled_token_kl(s, s, mask, aggregation="sum")

    zs = torch.randn(2, 3, 4, generator=g, dtype=F64)
    zt = torch.randn(2, 3, 4, generator=g, dtype=F64)
    ok = dict(student_logits=zs, teachers=[zt, zt], mask=mask)
    cases = [
        (dict(teachers=[]), "teachers"),
        (dict(teachers=zt), "teachers"),
        (dict(teachers=[zt, "x"]), "teachers"),
        (dict(teachers=[zt[..., :3]]), "teachers"),
        (dict(teachers=[zt[:, :2]]), "teachers"),
        (dict(routing=torch.zeros(2, 3, dtype=torch.long), weights=torch.ones(2)), "routing"),
        (dict(routing=torch.full((2, 3), 2)), "routing"),
        (dict(routing=torch.zeros(2, 3)), "routing"),
        (dict(routing=torch.zeros(2, 2, dtype=torch.long)), "routing"),
        (dict(weights=torch.tensor([1.0, -1.0])), "weights"),
        (dict(weights=torch.tensor([0.0, 0.0])), "weights"),
        (dict(weights=torch.ones(3)), "weights"),
        (dict(weights="confidence"), "weights"),
        (dict(weights="entropy", entropy_temperature=0.0), "entropy_temperature"),
        (dict(token_maps=[None]), "token_maps"),
        (dict(token_maps=[torch.arange(3), None]), "token_maps"),
        (dict(token_maps=[torch.tensor([0, 1, 2, 9]), None]), "token_maps"),
        (dict(token_maps=[torch.zeros(4), None]), "token_maps"),
        (dict(student_logits=None), "student_logits"),
    ]
    for override, name in cases:
        with pytest.raises(ValueError, match=name):
            multi_teacher_distill_loss(**{**ok, **override})
    bad_t = zt.clone()
    bad_t[1, 1, 1] = float("nan")
    with pytest.raises(ValueError, match=r"teachers\[1\]"):
        multi_teacher_distill_loss(**{**ok, "teachers": [zt, bad_t]})
