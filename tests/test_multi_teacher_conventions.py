"""Multi-teacher distillation conventions: the forward KL(pi_E || pi_theta) per teacher, zero-sum
weights renormalized to 0 by option, and the public normalized teacher weights."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.losses import multi_teacher_distill_loss, normalized_teacher_weights

F64 = torch.float64


def case(seed, B=2, L=4, V=5, M=3):
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(B, L, V, generator=g, dtype=F64)
    teachers = [torch.randn(B, L, V, generator=g, dtype=F64) * (1 + i) for i in range(M)]
    mask = torch.rand(B, L, generator=g) < 0.75
    mask[0, 0] = True
    w = torch.rand(M, B, L, generator=g, dtype=F64)
    return zs, teachers, mask, w


def hand_loss(zs, teachers, w, mask, direction):
    """token_mean over valid positions of sum_i w_i KL, KL written from its definition per position."""
    total, n = 0.0, 0
    B, L, V = zs.shape
    for b in range(B):
        for t in range(L):
            if not mask[b, t]:
                continue
            n += 1
            ps = torch.softmax(zs[b, t], -1)
            s = sum(float(w[i, b, t]) for i in range(len(teachers)))
            for i, zt in enumerate(teachers):
                pe = torch.softmax(zt[b, t], -1)
                wi = float(w[i, b, t]) / s if s > 0 else 0.0
                kl = sum((ps[v] * (ps[v].log() - pe[v].log())) if direction == "reverse"
                         else (pe[v] * (pe[v].log() - ps[v].log())) for v in range(V))
                total = total + wi * kl
    return total / n


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_each_direction_matches_the_definition_in_value_and_gradient(direction):
    zs, teachers, mask, w = case(0)
    a = zs.clone().requires_grad_(True)
    res = multi_teacher_distill_loss(teachers=teachers, mask=mask, student_logits=a, weights=w, direction=direction)
    g, = torch.autograd.grad(res.loss, a)
    b = zs.clone().requires_grad_(True)
    want = hand_loss(b, teachers, w, mask, direction)
    gw, = torch.autograd.grad(want, b)
    assert res.loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(g, gw, atol=1e-14)
    assert res.metrics[f"{direction}_kl"].item() == pytest.approx(want.item(), rel=1e-12)


def test_direction_docstring_worked_example():
    t = torch.tensor([[[math.log(3.0), 0.0]]], dtype=F64)
    out = {}
    for d in ("reverse", "forward"):
        s = torch.zeros(1, 1, 2, dtype=F64, requires_grad=True)
        r = multi_teacher_distill_loss(teachers=[t], mask=torch.ones(1, 1, dtype=torch.bool), student_logits=s,
                                       direction=d)
        g, = torch.autograd.grad(r.loss, s)
        out[d] = (round(r.loss.item(), 6), [round(v, 6) for v in g.flatten().tolist()])
    assert out == {"reverse": (0.143841, [-0.274653, 0.274653]), "forward": (0.130812, [-0.25, 0.25])}


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_zero_sum_positions_contribute_zero_and_stay_in_the_denominator(direction):
    zs, teachers, mask, w = case(1)
    w = w.clone()
    w[:, 0, 0] = 0.0  # a valid position whose weights sum to 0
    with pytest.raises(ValueError, match="zero_sum"):
        multi_teacher_distill_loss(teachers=teachers, mask=mask, student_logits=zs, weights=w)
    a = zs.clone().requires_grad_(True)
    res = multi_teacher_distill_loss(teachers=teachers, mask=mask, student_logits=a, weights=w, direction=direction,
                                     zero_sum="zero")
    g, = torch.autograd.grad(res.loss, a)
    b = zs.clone().requires_grad_(True)
    want = hand_loss(b, teachers, w, mask, direction)  # the hand form divides by every valid position
    gw, = torch.autograd.grad(want, b)
    assert res.loss.item() == pytest.approx(want.item(), rel=1e-12) and torch.allclose(g, gw, atol=1e-14)
    assert torch.equal(g[0, 0], torch.zeros_like(g[0, 0]))


def test_zero_sum_with_learned_weights_keeps_gradients_finite():
    zs, teachers, mask, w = case(2)
    w = w.clone()
    w[:, 1, 1] = 0.0
    mask[1, 1] = True
    wl = w.clone().requires_grad_(True)
    res = multi_teacher_distill_loss(teachers=teachers, mask=mask, student_logits=zs, weights=wl, zero_sum="zero")
    gw, = torch.autograd.grad(res.loss, wl)
    assert torch.isfinite(gw).all() and torch.equal(gw[:, 1, 1], torch.zeros(3, dtype=F64))


def test_normalized_teacher_weights_match_the_hand_form_and_the_docstring():
    zs, teachers, mask, w = case(3)
    w = w.clone()
    w[:, 1, 2] = 0.0
    mask[1, 2] = True
    w[:, ~mask] = math.nan  # masked positions are never read
    got = normalized_teacher_weights(w, mask, zero_sum="zero")
    for b in range(2):
        for t in range(4):
            s = sum(float(w[i, b, t]) for i in range(3)) if mask[b, t] else 0.0
            for i in range(3):
                want = float(w[i, b, t]) / s if mask[b, t] and s > 0 else 0.0
                assert float(got[i, b, t]) == pytest.approx(want, rel=1e-14, abs=0)
    with pytest.raises(ValueError, match="weights"):
        normalized_teacher_weights(w, mask)
    ex = normalized_teacher_weights(torch.tensor([[[1.0, 0.0]], [[3.0, 0.0]]], dtype=F64), torch.ones(1, 2),
                                    zero_sum="zero")
    assert ex.tolist() == [[[0.25, 0.0]], [[0.75, 0.0]]]
    un = normalized_teacher_weights(torch.tensor([[[1.0, 0.0]], [[3.0, 0.0]]], dtype=F64), torch.ones(1, 2),
                                    renormalize=False)
    assert un.tolist() == [[[1.0, 0.0]], [[3.0, 0.0]]]


def test_the_loss_uses_the_public_weights():
    zs, teachers, mask, w = case(4)
    direct = multi_teacher_distill_loss(teachers=teachers, mask=mask, student_logits=zs, weights=w)
    pre = multi_teacher_distill_loss(teachers=teachers, mask=mask, student_logits=zs,
                                     weights=normalized_teacher_weights(w, mask), renormalize=False)
    assert direct.loss.item() == pytest.approx(pre.loss.item(), rel=1e-13)


@settings(max_examples=15, deadline=None)
@given(v=st.sampled_from([math.nan, math.inf, -math.inf]), direction=st.sampled_from(["reverse", "forward"]))
def test_masked_positions_do_not_leak(v, direction):
    zs, teachers, mask, w = case(5)
    mask[1, 3] = False
    a = zs.clone().requires_grad_(True)
    r0 = multi_teacher_distill_loss(teachers=teachers, mask=mask, student_logits=a, weights=w, direction=direction,
                                    zero_sum="zero")
    g0, = torch.autograd.grad(r0.loss, a)
    zs2, w2 = zs.clone(), w.clone()
    zs2[1, 3] = v
    w2[:, 1, 3] = v
    t2 = [t.clone() for t in teachers]
    t2[0][1, 3] = v
    b = zs2.clone().requires_grad_(True)
    r = multi_teacher_distill_loss(teachers=t2, mask=mask, student_logits=b, weights=w2, direction=direction,
                                   zero_sum="zero")
    g, = torch.autograd.grad(r.loss, b)
    assert r.loss.item() == r0.loss.item() and torch.equal(g, g0)


@pytest.mark.parametrize("kw,name", [({"direction": "jsd"}, "direction"), ({"zero_sum": "skip"}, "zero_sum")])
def test_new_arguments_name_themselves(kw, name):
    zs, teachers, mask, w = case(6)
    with pytest.raises(ValueError, match=name):
        multi_teacher_distill_loss(teachers=teachers, mask=mask, student_logits=zs, weights=w, **kw)
    with pytest.raises(ValueError, match="zero_sum"):
        normalized_teacher_weights(w, mask, zero_sum="skip")
