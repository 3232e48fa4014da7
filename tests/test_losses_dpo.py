"""Tests for trajgrad.losses.dpo (spec §9, §10, §24)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.losses import dpo_loss, sequence_logp

D64 = torch.float64


def t(x):
    return torch.as_tensor(x, dtype=D64).clone()


def run(c, r, rc, rr, **kw):
    c = t(c).requires_grad_(True)
    r = t(r).requires_grad_(True)
    res = dpo_loss(c, r, t(rc), t(rr), **kw)
    res.loss.backward()
    return res, c.grad, r.grad


def test_hand_value_and_gradient():
    # beta 0.1: r_w = 0.1*(-10 + 12) = 0.2, r_l = 0.1*(-15 + 14) = -0.1, z = 0.3
    # loss = log(1 + e^{-0.3}); d loss / d chosen = -beta * sigmoid(-z); d / d rejected = +beta * sigmoid(-z)
    res, gc, gr = run([-10.0], [-15.0], [-12.0], [-14.0], beta=0.1)
    assert res.loss.item() == pytest.approx(math.log1p(math.exp(-0.3)), abs=1e-14)
    assert res.loss.item() == pytest.approx(0.554355, abs=1e-6)
    s = 1.0 / (1.0 + math.exp(0.3))
    assert gc.item() == pytest.approx(-0.1 * s, abs=1e-14)
    assert gr.item() == pytest.approx(0.1 * s, abs=1e-14)
    m = res.metrics
    assert m["rewards/chosen"].item() == pytest.approx(0.2)
    assert m["rewards/rejected"].item() == pytest.approx(-0.1)
    assert m["rewards/margin"].item() == pytest.approx(0.3)
    assert m["rewards/accuracy"].item() == 1.0


def test_label_smoothing_hand_value():
    # 0.9 * log(1 + e^{-0.3}) + 0.1 * log(1 + e^{0.3})
    res, _, _ = run([-10.0], [-15.0], [-12.0], [-14.0], beta=0.1, label_smoothing=0.1)
    expected = 0.9 * math.log1p(math.exp(-0.3)) + 0.1 * math.log1p(math.exp(0.3))
    assert res.loss.item() == pytest.approx(expected, abs=1e-14)


@settings(max_examples=40, deadline=None)
@given(lp=st.lists(st.floats(-50, 0), min_size=2, max_size=2), delta=st.floats(-5, 5), beta=st.floats(0.01, 5),
       ls=st.floats(0.0, 0.49))
def test_log_two_when_implicit_margins_are_equal(lp, delta, beta, ls):
    # chosen and rejected move equally from their references -> z = 0 -> loss log 2 (§24)
    res, _, _ = run([lp[0]], [lp[1]], [lp[0] - delta], [lp[1] - delta], beta=beta, label_smoothing=ls)
    assert res.loss.item() == pytest.approx(math.log(2.0), abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), beta=st.floats(0.01, 2.0))
def test_gradient_raises_chosen_and_lowers_rejected(seed, beta):
    g = torch.Generator().manual_seed(seed)
    c, r, rc, rr = (-10 * torch.rand(4, generator=g, dtype=D64) for _ in range(4))
    _, gc, gr = run(c, r, rc, rr, beta=beta)
    # minimizing: chosen gradient < 0 (raise chosen), rejected gradient > 0 (lower rejected)
    assert torch.all(gc < 0) and torch.all(gr > 0)
    z = beta * ((c - rc) - (r - rr))
    assert torch.allclose(gc, -beta * torch.sigmoid(-z) / 4, atol=1e-14)
    assert torch.allclose(gr, beta * torch.sigmoid(-z) / 4, atol=1e-14)


def test_references_are_detached():
    rc = t([-1.0]).requires_grad_(True)
    rr = t([-2.0]).requires_grad_(True)
    c = t([-1.5]).requires_grad_(True)
    dpo_loss(c, t([-2.5]), rc, rr).loss.backward()
    assert rc.grad is None and rr.grad is None and c.grad is not None


def test_with_sequence_logp_and_masked_nan():
    logp = t([[-0.5, -1.0, math.nan], [-2.0, math.inf, -0.25]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    lp = logp.clone().requires_grad_(True)
    s = sequence_logp(lp, mask)
    assert torch.allclose(s, t([-1.5, -2.25]))
    res = dpo_loss(s[:1], s[1:], t([-1.0]), t([-2.0]), beta=0.5)
    res.loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 2].item() == 0.0 and lp.grad[1, 1].item() == 0.0
    # every chosen token gets the same gradient -beta*sigmoid(-z); every rejected token the opposite
    z = 0.5 * ((-1.5 + 1.0) - (-2.25 + 2.0))
    gw = -0.5 / (1 + math.exp(z))
    assert torch.allclose(lp.grad, t([[gw, gw, 0.0], [-gw, 0.0, -gw]]), atol=1e-14)


def test_sequence_logp_empty_row_and_bad_inputs():
    assert sequence_logp(t([[-1.0, -2.0]]), torch.tensor([[0, 0]])).item() == 0.0
    with pytest.raises(ValueError, match="logp"):
        sequence_logp(t([[-1.0, math.nan]]), torch.tensor([[1, 1]]))
    with pytest.raises(ValueError, match="mask"):
        sequence_logp(t([[-1.0, -1.0]]), torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="logp"):
        sequence_logp(t([-1.0, -1.0]), torch.tensor([1, 1]))


def test_microbatches_with_global_denominator_equal_full_batch():
    g = torch.Generator().manual_seed(0)
    c, r, rc, rr = (-10 * torch.rand(6, generator=g, dtype=D64) for _ in range(4))
    full, gcf, grf = run(c, r, rc, rr, beta=0.3)
    cc = c.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        res = dpo_loss(cc[rows], r[rows], rc[rows], rr[rows], beta=0.3, denominator=6)
        res.loss.backward()
        total += res.loss.item()
    assert total == pytest.approx(full.loss.item(), abs=1e-13)
    assert torch.allclose(cc.grad, gcf, atol=1e-15)


def test_gradcheck():
    g = torch.Generator().manual_seed(1)
    c, r = ((-5 * torch.rand(3, generator=g, dtype=D64)).requires_grad_(True) for _ in range(2))
    rc, rr = (-5 * torch.rand(3, generator=g, dtype=D64) for _ in range(2))
    for ls in (0.0, 0.2):
        assert torch.autograd.gradcheck(lambda a, b: dpo_loss(a, b, rc, rr, beta=0.7, label_smoothing=ls).loss, (c, r))


def test_accuracy_metric():
    res, _, _ = run([-1.0, -1.0, -1.0], [-2.0, -0.5, -1.0], [-1.0] * 3, [-1.0] * 3)
    # z = beta*(0 - (-1)) > 0, beta*(0 - 0.5) < 0, 0 (a tie is not counted correct)
    assert res.metrics["rewards/accuracy"].item() == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(chosen_logp=t([[-1.0]])), "chosen_logp"),
        (dict(chosen_logp=t([])), "chosen_logp"),
        (dict(rejected_logp=t([-1.0, -2.0])), "rejected_logp"),
        (dict(ref_chosen_logp=t([math.nan])), "ref_chosen_logp"),
        (dict(ref_rejected_logp=t([-math.inf])), "ref_rejected_logp"),
        (dict(chosen_logp=torch.tensor([1])), "chosen_logp"),
        (dict(beta=0.0), "beta"),
        (dict(beta=-0.1), "beta"),
        (dict(beta=math.inf), "beta"),
        (dict(label_smoothing=0.5), "label_smoothing"),
        (dict(label_smoothing=-0.1), "label_smoothing"),
        (dict(denominator=0), "denominator"),
    ],
)
def test_bad_inputs(kwargs, name):
    args = dict(chosen_logp=t([-1.0]), rejected_logp=t([-2.0]), ref_chosen_logp=t([-1.5]), ref_rejected_logp=t([-1.5]))
    args.update(kwargs)
    pos = [args.pop(k) for k in ("chosen_logp", "rejected_logp", "ref_chosen_logp", "ref_rejected_logp")]
    with pytest.raises(ValueError, match=name):
        dpo_loss(*pos, **args)


# ----------------------------------------------------------------- loss_type variants (TRL forms)
def _case(seed=0, B=5):
    g = torch.Generator().manual_seed(seed)
    c = -torch.rand(B, generator=g, dtype=D64) * 20
    r = -torch.rand(B, generator=g, dtype=D64) * 20
    rc = c + torch.randn(B, generator=g, dtype=D64)
    rr = r + torch.randn(B, generator=g, dtype=D64)
    lc = torch.randint(1, 30, (B,), generator=g).to(D64)
    lr = torch.randint(1, 30, (B,), generator=g).to(D64)
    return c, r, rc, rr, lc, lr


def _trl(loss_type, c, r, rc, rr, lc, lr, beta, ls=0.0, gamma=0.5):
    """TRL 1.16 DPOTrainer (and CPO's simpo) per-pair losses, written out."""
    F = torch.nn.functional
    cr, rr_ = c - rc, r - rr
    d = cr - rr_
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * d)
    if loss_type == "hinge":
        return torch.relu(1 - beta * d)
    if loss_type == "ipo":
        return (cr / lc - rr_ / lr - 1 / (2 * beta)) ** 2
    if loss_type == "robust":
        clean = -(1 - ls) * F.logsigmoid(beta * d)
        flipped = -ls * F.logsigmoid(-beta * d)
        return (clean - flipped) / (1 - 2 * ls)
    if loss_type == "simpo":
        logits = (c / lc - r / lr) - gamma / beta
        return -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    raise AssertionError(loss_type)


@pytest.mark.parametrize("loss_type,ls", [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0), ("robust", 0.0),
                                          ("robust", 0.2), ("simpo", 0.0), ("simpo", 0.1)])
@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_loss_types_match_trl_value_and_gradient(loss_type, ls, beta):
    c0, r0, rc, rr, lc, lr = _case()
    c, r = c0.clone().requires_grad_(True), r0.clone().requires_grad_(True)
    kw = dict(beta=beta, label_smoothing=ls, loss_type=loss_type, chosen_length=lc, rejected_length=lr)
    if loss_type == "simpo":
        res = dpo_loss(c, r, None, None, **kw)
    else:
        res = dpo_loss(c, r, rc, rr, **kw)
    res.loss.backward()
    c2, r2 = c0.clone().requires_grad_(True), r0.clone().requires_grad_(True)
    ref = _trl(loss_type, c2, r2, rc, rr, lc, lr, beta, ls).mean()
    ref.backward()
    assert res.loss.item() == pytest.approx(ref.item(), abs=1e-12)
    assert torch.allclose(c.grad, c2.grad, atol=1e-13) and torch.allclose(r.grad, r2.grad, atol=1e-13)


def test_analytic_gradients_of_hinge_ipo_robust():
    c0, r0, rc, rr, lc, lr = _case(1, B=6)
    beta, B = 0.3, 6
    z = beta * ((c0 - rc) - (r0 - rr))
    # hinge: d/d chosen = -beta * 1[z < 1] / B
    _, gc, gr = run(c0, r0, rc, rr, beta=beta, loss_type="hinge")
    assert torch.allclose(gc, -beta * (z < 1).to(D64) / B, atol=1e-15)
    assert torch.allclose(gr, -gc, atol=1e-15)
    # ipo (paper form, no lengths): 2 (h - 1/(2 beta)) / B
    h = (c0 - rc) - (r0 - rr)
    _, gc, gr = run(c0, r0, rc, rr, beta=beta, loss_type="ipo")
    assert torch.allclose(gc, 2 * (h - 1 / (2 * beta)) / B, atol=1e-13)
    assert torch.allclose(gr, -gc, atol=1e-13)
    # robust: -beta/(1-2e) [(1-e) σ(-z) + e σ(z)] / B
    e = 0.25
    _, gc, _ = run(c0, r0, rc, rr, beta=beta, loss_type="robust", label_smoothing=e)
    expected = -beta / (1 - 2 * e) * ((1 - e) * torch.sigmoid(-z) + e * torch.sigmoid(z)) / B
    assert torch.allclose(gc, expected, atol=1e-14)


def test_ipo_minimum_is_at_half_over_beta_and_hinge_saturates():
    beta = 0.5
    # h = 1/(2β) = 1: zero loss and zero gradient
    res, gc, _ = run([-5.0], [-7.0], [-6.0], [-7.0], beta=beta, loss_type="ipo")
    assert res.loss.item() == pytest.approx(0.0, abs=1e-15) and gc.item() == pytest.approx(0.0, abs=1e-15)
    # z = β h = 3 > 1: hinge loss 0, gradient 0
    res, gc, gr = run([-1.0], [-7.0], [-1.0], [-1.0], beta=beta, loss_type="hinge")
    assert res.loss.item() == 0.0 and gc.item() == 0.0 and gr.item() == 0.0


def test_simpo_ignores_the_reference_and_sigmoid_default_unchanged():
    c0, r0, rc, rr, lc, lr = _case(2)
    a = dpo_loss(c0, r0, None, None, loss_type="simpo", chosen_length=lc, rejected_length=lr).loss
    b = dpo_loss(c0, r0, rc + 3.0, rr - 1.0, loss_type="simpo", chosen_length=lc, rejected_length=lr).loss
    assert a.item() == b.item()
    assert dpo_loss(c0, r0, rc, rr).loss.item() == dpo_loss(c0, r0, rc, rr, loss_type="sigmoid").loss.item()


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(loss_type="kto"), "loss_type"),
        (dict(loss_type="hinge", label_smoothing=0.1), "label_smoothing"),
        (dict(loss_type="ipo", label_smoothing=0.1), "label_smoothing"),
        (dict(loss_type="simpo"), "chosen_length"),
        (dict(loss_type="ipo", chosen_length=t([3.0])), "rejected_length"),
        (dict(loss_type="ipo", chosen_length=t([0.0]), rejected_length=t([2.0])), "chosen_length"),
        (dict(loss_type="ipo", chosen_length=t([1.0, 2.0]), rejected_length=t([2.0])), "chosen_length"),
        (dict(loss_type="robust", label_smoothing=0.5), "label_smoothing"),
        (dict(loss_type="simpo", chosen_length=t([1.0]), rejected_length=t([1.0]), simpo_gamma=math.inf),
         "simpo_gamma"),
        (dict(denominator=math.inf), "denominator"),
    ],
)
def test_loss_type_bad_inputs(kw, name):
    with pytest.raises(ValueError, match=name):
        dpo_loss(t([-1.0]), t([-2.0]), t([-1.5]), t([-1.5]), **kw)


def test_reference_required_except_for_simpo():
    with pytest.raises(ValueError, match="ref_chosen_logp"):
        dpo_loss(t([-1.0]), t([-2.0]), None, t([-1.5]), loss_type="ipo")
