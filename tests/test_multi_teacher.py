"""Multi-teacher distillation (§15): value and gradient against the naive full-logit path for
every weight mode (fixed, entropy-confidence, routed, learned per-position weights, router)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.aggregate import aggregate
from trajgrad.losses import TeacherRouter, multi_teacher_distill_loss

F64 = torch.float64
MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_constant")


def case(seed, B=3, L=5, H=4, V=7, M=3, p_valid=0.7):
    """Student hidden/head/bias, M teachers (alternating logits and hidden tuples), a mask."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, L, H, generator=g, dtype=F64)
    ws = torch.randn(V, H, generator=g, dtype=F64) * 2 / math.sqrt(H)
    bs = torch.randn(V, generator=g, dtype=F64)
    teachers, logits = [], []
    for i in range(M):
        if i % 2 == 0:
            z = torch.randn(B, L, V, generator=g, dtype=F64) * (1 + i)
            teachers.append(z)
            logits.append(z)
        else:
            ht = torch.randn(B, L, H + i, generator=g, dtype=F64)
            wt = torch.randn(V, H + i, generator=g, dtype=F64) * 2 / math.sqrt(H + i)
            teachers.append((ht, wt))
            logits.append(ht @ wt.T)
    mask = torch.rand(B, L, generator=g) < p_valid
    mask[0, 0] = True
    return hs, ws, bs, teachers, logits, mask


def naive_kl(zs, zt, T=1.0):
    ls, lt = (zs / T).log_softmax(-1), (zt / T).log_softmax(-1)
    return (ls.exp() * (ls - lt)).sum(-1)


def naive_entropy(z, T=1.0):
    lp = (z / T).log_softmax(-1)
    return -(lp.exp() * lp).sum(-1)


def naive_multi(zs, teacher_logits, w, mask, aggregation="token_mean", T=1.0):
    """§15 on materialized [B, L, V] logits: aggregate(sum_i w_i KL(pi_s || pi_i)), autograd throughout."""
    kls = torch.stack([naive_kl(zs, zt, T) for zt in teacher_logits])          # [M, B, L]
    safe_w = torch.where(mask, w, torch.zeros_like(w))
    d = (safe_w * torch.where(mask, kls, torch.zeros_like(kls))).sum(0)
    return aggregate(d, mask, aggregation)


def leaves(*xs):
    return [x.clone().requires_grad_() for x in xs]


def fused_and_naive(weights_kw, naive_w, seed=0, aggregation="token_mean", T=1.0, M=3, path="hidden"):
    hs, ws, bs, teachers, tlogits, mask = case(seed, M=M)
    h1, w1, b1 = leaves(hs, ws, bs)
    h2, w2, b2 = leaves(hs, ws, bs)
    if path == "hidden":
        res = multi_teacher_distill_loss(student_hidden=h1, student_weight=w1, student_bias=b1, teachers=teachers,
                                         mask=mask, aggregation=aggregation, temperature=T, chunk_size=4,
                                         **weights_kw(mask, tlogits))
        params1, params2 = [h1, w1, b1], [h2, w2, b2]
        zs_naive = h2 @ w2.T + b2
    else:
        z1 = (hs @ ws.T + bs).requires_grad_()
        z2 = z1.detach().clone().requires_grad_()
        res = multi_teacher_distill_loss(student_logits=z1, teachers=teachers, mask=mask, aggregation=aggregation,
                                         temperature=T, chunk_size=4, **weights_kw(mask, tlogits))
        params1, params2 = [z1], [z2]
        zs_naive = z2
    ref = naive_multi(zs_naive, tlogits, naive_w(mask, tlogits), mask, aggregation, T)
    g1 = torch.autograd.grad(res.loss, params1)
    g2 = torch.autograd.grad(ref, params2)
    return res, ref, g1, g2


def assert_match(res, ref, g1, g2, atol=1e-12):
    assert torch.allclose(res.loss, ref, atol=atol, rtol=1e-10), (res.loss, ref)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=atol, rtol=1e-9), (a - b).abs().max()


# ---------------------------------------------------------------------------------------
# every weight mode against the naive path (value and gradient)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["hidden", "logits"])
@pytest.mark.parametrize("aggregation", MODES)
def test_fixed_weights_gradient_sums_every_teacher(path, aggregation):
    fixed = torch.tensor([1.0, 2.0, 5.0], dtype=F64)
    res, ref, g1, g2 = fused_and_naive(
        lambda mask, tl: dict(weights=fixed),
        lambda mask, tl: (fixed / fixed.sum())[:, None, None].expand(3, *mask.shape),
        aggregation=aggregation, path=path)
    assert_match(res, ref, g1, g2)


def test_shared_positions_gradient_is_not_the_last_teachers_share():
    """The defect: with index_copy the gradient kept only the last teacher's share."""
    res, ref, g1, g2 = fused_and_naive(lambda mask, tl: dict(weights=None),
                                       lambda mask, tl: torch.full((3,) + tuple(mask.shape), 1 / 3, dtype=F64))
    assert_match(res, ref, g1, g2)
    hs, ws, bs, teachers, tl, mask = case(0)
    h = hs.clone().requires_grad_()
    last_only = naive_multi(h @ ws.T + bs, tl[2:], torch.full((1,) + tuple(mask.shape), 1 / 3, dtype=F64), mask)
    (g_last,) = torch.autograd.grad(last_only, [h])
    assert not torch.allclose(g1[0], g_last, atol=1e-6)


@pytest.mark.parametrize("path", ["hidden", "logits"])
@pytest.mark.parametrize("tau", [0.3, 2.0])
def test_entropy_confidence_weights_match_naive(path, tau):
    def w_naive(mask, tl):
        ent = torch.stack([naive_entropy(z, 1.5) for z in tl])                      # [M, B, L]
        return torch.softmax(-ent / tau, dim=0)

    res, ref, g1, g2 = fused_and_naive(lambda mask, tl: dict(weights="entropy", entropy_temperature=tau), w_naive,
                                       T=1.5, path=path)
    assert_match(res, ref, g1, g2)


@pytest.mark.parametrize("path", ["hidden", "logits"])
def test_routed_weights_match_naive(path):
    g = torch.Generator().manual_seed(5)
    routing = torch.randint(0, 3, case(0)[5].shape, generator=g)

    def w_naive(mask, tl):
        return torch.nn.functional.one_hot(routing, 3).permute(2, 0, 1).to(F64)

    res, ref, g1, g2 = fused_and_naive(lambda mask, tl: dict(routing=torch.where(mask, routing, -1)), w_naive,
                                       path=path, aggregation="seq_mean_token_sum")
    assert_match(res, ref, g1, g2)


# ---------------------------------------------------------------------------------------
# learned per-position weights [M, B, L]
# ---------------------------------------------------------------------------------------


def positional(seed, shape, M=3, zero_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand((M,) + tuple(shape), generator=g, dtype=F64) + 0.05
    if zero_frac:
        w = torch.where(torch.rand(w.shape, generator=g, dtype=F64) < zero_frac, torch.zeros_like(w), w)
    return w


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("path", ["hidden", "logits"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_positional_weights_value_and_gradients_into_student_and_weights(renormalize, path, aggregation):
    hs, ws, bs, teachers, tl, mask = case(1)
    w0 = positional(2, mask.shape, zero_frac=0.2)
    w0[:, 0, 0] = torch.tensor([0.0, 1.0, 3.0])        # a zero weight still receives its gradient
    wa, wb = leaves(w0, w0)

    def norm(w):
        return w / w.sum(0, keepdim=True) if renormalize else w

    res, ref, g1, g2 = fused_and_naive(lambda mask, tl: dict(weights=wa, renormalize=renormalize),
                                       lambda mask, tl: norm(wb), seed=1, path=path, aggregation=aggregation)
    assert_match(res, ref, g1, g2)
    # the gradient w.r.t. the weights: autograd through the naive path (renormalization included)
    (gw_fused,) = torch.autograd.grad(multi_teacher_distill_loss(
        student_hidden=hs, student_weight=ws, student_bias=bs, teachers=teachers, mask=mask, weights=wa,
        renormalize=renormalize, aggregation=aggregation).loss, [wa])
    (gw_naive,) = torch.autograd.grad(naive_multi(hs @ ws.T + bs, tl, norm(wb), mask, aggregation), [wb])
    assert torch.allclose(gw_fused, gw_naive, atol=1e-12)
    assert (gw_fused[:, ~mask] == 0).all()
    assert gw_fused[0, 0, 0] != 0


def test_positional_weights_gradient_is_omega_times_kl_without_renormalization():
    """Analytic: dL/dw_i(h_n) = omega_n KL_i(h_n); for token_mean omega_n = 1 / #valid."""
    hs, ws, bs, teachers, tl, mask = case(3)
    w = positional(4, mask.shape).requires_grad_()
    res = multi_teacher_distill_loss(student_hidden=hs, student_weight=ws, student_bias=bs, teachers=teachers,
                                     mask=mask, weights=w, renormalize=False)
    (gw,) = torch.autograd.grad(res.loss, [w])
    zs = hs @ ws.T + bs
    kls = torch.stack([naive_kl(zs, z) for z in tl])
    expected = torch.where(mask, kls, torch.zeros_like(kls)) / mask.sum()
    assert torch.allclose(gw, expected, atol=1e-13)


def test_detached_positional_weights_give_the_same_student_gradient_and_none_to_weights():
    hs, ws, bs, teachers, tl, mask = case(4)
    w = positional(5, mask.shape).requires_grad_()
    h1, h2 = leaves(hs, hs)
    att = multi_teacher_distill_loss(student_hidden=h1, student_weight=ws, teachers=teachers, mask=mask, weights=w)
    det = multi_teacher_distill_loss(student_hidden=h2, student_weight=ws, teachers=teachers, mask=mask,
                                     weights=w.detach())
    assert torch.equal(att.loss.detach(), det.loss.detach())
    (g_att,) = torch.autograd.grad(att.loss, [h1])
    (g_det,) = torch.autograd.grad(det.loss, [h2])
    assert torch.allclose(g_att, g_det, atol=1e-15)
    assert det.loss.grad_fn is not None and w.grad is None


def test_fixed_weights_unnormalized_scale_the_loss():
    hs, ws, bs, teachers, tl, mask = case(6)
    a = multi_teacher_distill_loss(student_hidden=hs, student_weight=ws, teachers=teachers, mask=mask,
                                   weights=[1.0, 2.0, 1.0], renormalize=False)
    b = multi_teacher_distill_loss(student_hidden=hs, student_weight=ws, teachers=teachers, mask=mask,
                                   weights=[1.0, 2.0, 1.0])
    assert torch.allclose(a.loss, 4 * b.loss, atol=1e-13)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.01, 100.0))
def test_renormalized_positional_weights_are_scale_invariant(seed, scale):
    hs, ws, bs, teachers, tl, mask = case(seed, M=2)
    w = positional(seed + 1, mask.shape, M=2)
    a = multi_teacher_distill_loss(student_hidden=hs, student_weight=ws, teachers=teachers, mask=mask, weights=w)
    b = multi_teacher_distill_loss(student_hidden=hs, student_weight=ws, teachers=teachers, mask=mask,
                                   weights=w * scale)
    assert torch.allclose(a.loss, b.loss, atol=1e-12, rtol=1e-10)
    assert a.loss >= 0


# ---------------------------------------------------------------------------------------
# the router
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate,renormalize", [("softmax", True), ("sigmoid", False), ("sigmoid", True)])
def test_router_gradient_reaches_its_parameters_not_the_student_features(gate, renormalize):
    hs, ws, bs, teachers, tl, mask = case(7)
    torch.manual_seed(0)
    router = TeacherRouter(hs.shape[-1], 3, gate=gate, temperature=0.7).double()
    with torch.no_grad():
        router.proj.weight.normal_()
        router.proj.bias.normal_()
    h = hs.clone().requires_grad_()
    res = multi_teacher_distill_loss(student_hidden=h, student_weight=ws, student_bias=bs, teachers=teachers,
                                     mask=mask, weights=router, renormalize=renormalize)
    params = [h, router.proj.weight, router.proj.bias]
    g_fused = torch.autograd.grad(res.loss, params)

    # naive: the same router by hand on sg[h], the student logits attached
    h2 = hs.clone().requires_grad_()
    U = router.proj.weight.detach().clone().requires_grad_()
    c = router.proj.bias.detach().clone().requires_grad_()
    u = (h2.detach() @ U.T + c) / 0.7
    w = (torch.softmax(u, -1) if gate == "softmax" else torch.sigmoid(u)).permute(2, 0, 1)
    if renormalize:
        w = w / w.sum(0, keepdim=True)
    ref = naive_multi(h2 @ ws.T + bs, tl, w, mask)
    g_naive = torch.autograd.grad(ref, [h2, U, c])
    assert torch.allclose(res.loss, ref, atol=1e-12)
    for a, b in zip(g_fused, g_naive):
        assert torch.allclose(a, b, atol=1e-12)
    assert g_fused[1].abs().sum() > 0


def test_router_starts_uniform_and_learns_towards_the_closest_teacher():
    hs, ws, bs, teachers, tl, mask = case(8, M=2)
    zs = hs @ ws.T
    near = zs + 0.01 * torch.randn(zs.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    far = tl[0] * 3
    router = TeacherRouter(hs.shape[-1], 2).double()
    w0 = router(hs)
    assert torch.allclose(w0, torch.full_like(w0, 0.5))
    opt = torch.optim.SGD(router.parameters(), lr=5.0)
    for _ in range(30):
        opt.zero_grad()
        multi_teacher_distill_loss(student_hidden=hs, student_weight=ws, teachers=[far, near], mask=mask,
                                   weights=router).loss.backward()
        opt.step()
    w = router(hs)
    assert (w[1][mask] > 0.6).float().mean() > 0.8


def test_router_input_is_detached_by_default_and_attached_when_asked():
    hs, ws, bs, teachers, tl, mask = case(9)
    zs = (hs @ ws.T).detach()
    feats = hs.clone().requires_grad_()
    router = TeacherRouter(hs.shape[-1], 3, detach_input=False).double()
    with torch.no_grad():
        router.proj.weight.normal_()
    res = multi_teacher_distill_loss(student_logits=zs.requires_grad_(), teachers=teachers, mask=mask,
                                     weights=router, router_input=feats)
    (gf,) = torch.autograd.grad(res.loss, [feats])
    assert gf.abs().sum() > 0 and (gf[~mask] == 0).all()
    router.detach_input = True
    res = multi_teacher_distill_loss(student_logits=zs, teachers=teachers, mask=mask, weights=router,
                                     router_input=feats)
    assert res.loss.requires_grad
    assert torch.autograd.grad(res.loss, [feats], allow_unused=True)[0] is None


def test_poisoned_masked_slots_with_learned_weights_and_router():
    hs, ws, bs, teachers, tl, mask = case(10)
    w = positional(11, mask.shape)
    router = TeacherRouter(hs.shape[-1], 3).double()
    with torch.no_grad():
        router.proj.weight.normal_()

    def run(h, wts):
        h = h.clone().requires_grad_()
        wts = wts.clone().requires_grad_()
        a = multi_teacher_distill_loss(student_hidden=h, student_weight=ws, teachers=teachers, mask=mask, weights=wts)
        b = multi_teacher_distill_loss(student_hidden=h, student_weight=ws, teachers=teachers, mask=mask,
                                       weights=router)
        loss = a.loss + b.loss
        return (loss,) + torch.autograd.grad(loss, [h, wts, router.proj.weight])

    clean = run(hs, w)
    h_bad, w_bad = hs.clone(), w.clone()
    h_bad[~mask] = float("nan")
    w_bad[:, ~mask] = float("inf")
    dirty = run(h_bad, w_bad)
    for a, b in zip(clean, dirty):
        assert torch.isfinite(b).all() and torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------


def test_bad_learned_weights_and_router_inputs():
    hs, ws, bs, teachers, tl, mask = case(12)
    base = dict(student_hidden=hs, student_weight=ws, teachers=teachers, mask=mask)
    w = positional(13, mask.shape)
    neg = w.clone()
    neg[0][mask] = -1.0
    zero = w.clone()
    zero[:, 0, 0] = 0.0
    nan = w.clone()
    nan[1][mask] = float("nan")
    cases = [
        (dict(weights=w[:2]), "weights"),
        (dict(weights=w[..., :-1]), "weights"),
        (dict(weights=neg), "weights"),
        (dict(weights=zero), "weights"),
        (dict(weights=nan), "weights"),
        (dict(weights=w.long()), "weights"),
        (dict(weights=[1.0, 2.0]), "weights"),
        (dict(weights=w, routing=torch.zeros(mask.shape, dtype=torch.long)), "routing"),
        (dict(weights=w, router_input=hs), "router_input"),
        (dict(weights=lambda x: x.sum()), "weights"),
        (dict(weights=lambda x: 3.0), "weights"),
        (dict(weights=TeacherRouter(hs.shape[-1], 2).double()), "weights"),
        (dict(weights=TeacherRouter(hs.shape[-1], 3).double(), router_input=hs[..., :2]), "hidden"),
        (dict(weights=TeacherRouter(hs.shape[-1], 3).double(), router_input=hs[:, :2]), "router_input"),
    ]
    for kw, name in cases:
        with pytest.raises(ValueError, match=name):
            multi_teacher_distill_loss(**{**base, **kw})
    # zero weights at a position are fine without renormalization
    multi_teacher_distill_loss(**base, weights=zero, renormalize=False)
    with pytest.raises(ValueError, match="router_input"):
        multi_teacher_distill_loss(student_logits=hs @ ws.T, teachers=teachers, mask=mask,
                                   weights=TeacherRouter(hs.shape[-1], 3).double())
    for kw, name in [(dict(hidden_size=0, num_teachers=2), "hidden_size"),
                     (dict(hidden_size=4, num_teachers=True), "num_teachers"),
                     (dict(hidden_size=4, num_teachers=2, gate="relu"), "gate"),
                     (dict(hidden_size=4, num_teachers=2, temperature=0.0), "temperature")]:
        with pytest.raises(ValueError, match=name):
            TeacherRouter(**kw)
    with pytest.raises(ValueError, match="hidden"):
        TeacherRouter(4, 2)(torch.zeros(2, 3))
