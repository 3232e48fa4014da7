"""Tests for trajgrad.losses.sapo (spec §18)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.aggregate import MODES, local_count
from trajgrad.losses import reinforce_loss, sapo_loss

D64 = torch.float64


def t(x):
    return torch.as_tensor(x, dtype=D64).clone()


def run(logp, old, adv, mask, **kw):
    lp = t(logp).requires_grad_(True)
    res = sapo_loss(lp, t(old), t(adv), torch.as_tensor(mask), **kw)
    res.loss.backward()
    return res, lp.grad


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def gate_of(ratio, tau, adv=1.0):
    """The gate read off autograd: one token, token_mean, so grad = -gate * r * A."""
    _, g = run([[-1.0 + math.log(ratio)]], [[-1.0]], [[adv]], [[1]], tau_pos=tau, tau_neg=tau,
               aggregation="token_mean")
    return -g.item() / (ratio * adv)


def test_hand_value_and_gradient():
    # one sequence of 2 tokens, r = e^{0.1} and e^{-0.2}, A = [1, -1], tau_pos = 1, tau_neg = 2.
    r = [math.exp(0.1), math.exp(-0.2)]
    res, g = run([[-1.0 + 0.1, -1.0 - 0.2]], [[-1.0, -1.0]], [[1.0, -1.0]], [[1, 1]], tau_pos=1.0, tau_neg=2.0)
    f0 = 4.0 / 1.0 * sigmoid(1.0 * (r[0] - 1))
    f1 = 4.0 / 2.0 * sigmoid(2.0 * (r[1] - 1))
    assert res.loss.item() == pytest.approx(-(f0 * 1.0 + f1 * -1.0) / 2, abs=1e-13)
    p0, p1 = sigmoid(r[0] - 1), sigmoid(2.0 * (r[1] - 1))
    # per-token gradient: -(1/agg) * 4p(1-p) * r * A, agg = G * L_i = 2
    expected = [-(4 * p0 * (1 - p0)) * r[0] * 1.0 / 2, -(4 * p1 * (1 - p1)) * r[1] * -1.0 / 2]
    assert torch.allclose(g, t([expected]), atol=1e-14)
    assert res.metrics["gate/mean"].item() == pytest.approx((4 * p0 * (1 - p0) + 4 * p1 * (1 - p1)) / 2)
    assert res.metrics["gate/pos_mean"].item() == pytest.approx(4 * p0 * (1 - p0))
    assert res.metrics["gate/neg_mean"].item() == pytest.approx(4 * p1 * (1 - p1))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(MODES), tau_pos=st.floats(0.1, 5.0),
       tau_neg=st.floats(0.1, 5.0))
def test_per_token_gradient_formula(seed, mode, tau_pos, tau_neg):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 5, generator=g, dtype=D64) * 2
    old = logp + 0.5 * torch.randn(3, 5, generator=g, dtype=D64)
    adv = torch.randn(3, 5, generator=g, dtype=D64)
    mask = torch.rand(3, 5, generator=g) > 0.3
    _, grad = run(logp, old, adv, mask.long(), tau_pos=tau_pos, tau_neg=tau_neg, aggregation=mode)
    r = torch.exp(logp - old)
    tau = torch.where(adv > 0, t(tau_pos), t(tau_neg))
    p = torch.sigmoid(tau * (r - 1))
    lengths = mask.sum(-1, keepdim=True).clamp_min(1).to(D64)
    n_seq = max(int(mask.any(-1).sum()), 1)
    agg = {
        "token_mean": torch.full_like(r, float(max(int(mask.sum()), 1))),
        "seq_mean_token_mean": (n_seq * lengths).expand_as(r),
        "seq_mean_token_sum": torch.full_like(r, float(n_seq)),
        "seq_sum_constant": torch.full_like(r, float(n_seq * r.shape[1])),
        "token_sum": torch.ones_like(r),
    }[mode]
    expected = torch.where(mask, -(1 / agg) * 4 * p * (1 - p) * r * adv, torch.zeros_like(r))
    assert torch.allclose(grad, expected, atol=1e-13)


@settings(max_examples=30, deadline=None)
@given(tau=st.floats(1e-3, 50.0), adv=st.sampled_from([1.0, -1.0, 0.37]))
def test_gate_is_one_at_ratio_one_for_any_tau(tau, adv):
    assert gate_of(1.0, tau, adv) == pytest.approx(1.0, abs=1e-12)


def test_gate_decays_with_distance_and_faster_for_larger_tau():
    for tau in (0.5, 1.0, 1.05, 4.0):
        above = [gate_of(r, tau) for r in (1.0, 1.2, 1.5, 2.0, 4.0)]
        below = [gate_of(r, tau) for r in (1.0, 0.8, 0.5, 0.2)]
        assert all(a > b for a, b in zip(above, above[1:]))
        assert all(a > b for a, b in zip(below, below[1:]))
    for r in (0.5, 0.8, 1.2, 2.0):
        assert gate_of(r, 2.0) < gate_of(r, 1.0) < gate_of(r, 0.5)
    # analytic gate sech^2(tau (r - 1) / 2) = 4p(1-p)
    assert gate_of(1.5, 1.0) == pytest.approx(1.0 / math.cosh(0.25) ** 2, rel=1e-12)


def test_sign_dependent_temperature_and_value_at_ratio_one():
    # at r = 1: f = 2/tau, term = -(2/tau) A ; A > 0 -> tau_pos = 1, A <= 0 -> tau_neg = 2.
    res, _ = run([[-1.0, -1.0, -1.0]], [[-1.0, -1.0, -1.0]], [[1.0, -1.0, 0.0]], [[1, 1, 1]], tau_pos=1.0,
                 tau_neg=2.0, aggregation="token_mean")
    assert res.loss.item() == pytest.approx((-2.0 + 1.0 + 0.0) / 3, abs=1e-14)


def test_detached_ratio_would_have_zero_gradient():
    logp = t([[-0.9, -0.6]]).requires_grad_(True)
    old = t([[-1.0, -0.5]])
    adv = t([[1.0, -1.0]])
    # counterfactual: the same surrogate with r detached has no path to logp at all
    r_det = torch.exp(logp - old).detach()
    tau = torch.where(adv > 0, t(1.0), t(1.05))
    wrong = -((4 / tau) * torch.sigmoid(tau * (r_det - 1)) * adv).mean()
    assert not wrong.requires_grad
    # ... whereas the value is the same and SAPO's own gradient is nonzero
    res = sapo_loss(logp, old, adv, torch.ones(1, 2), aggregation="token_mean")
    assert res.loss.item() == pytest.approx(wrong.item(), abs=1e-14)
    (g,) = torch.autograd.grad(res.loss, logp)
    assert torch.all(g != 0)


def test_overflowing_ratio_is_finite():
    logp = torch.tensor([[0.0, 0.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-200.0, -200.0, -0.5]])
    adv = torch.tensor([[1.0, 0.0, -1.0]])
    res = sapo_loss(logp, old, adv, torch.ones(1, 3), aggregation="token_mean")
    res.loss.backward()
    # terms: -(4/1)*1*1, 0, -(2/1.05)*(-1) at r = 1
    assert res.loss.item() == pytest.approx((-4.0 + 0.0 + 2 / 1.05) / 3, rel=1e-6)
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 9.0])
@pytest.mark.parametrize("mode", MODES)
def test_masked_slots_change_nothing(bad, mode):
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(3, 4, generator=g, dtype=D64)
    old = logp + 0.3 * torch.randn(3, 4, generator=g, dtype=D64)
    adv = torch.randn(3, 4, generator=g, dtype=D64)
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]])
    clean, gc = run(logp, old, adv, mask, aggregation=mode)
    dl, do, da = logp.clone(), old.clone(), adv.clone()
    for x in (dl, do, da):
        x[mask == 0] = bad
    dirty, gd = run(dl, do, da, mask, aggregation=mode)
    assert torch.isfinite(dirty.loss) and torch.isfinite(gd).all()
    assert dirty.loss.item() == clean.loss.item()
    assert torch.equal(gc, gd)
    for k in clean.metrics:
        assert torch.equal(clean.metrics[k], dirty.metrics[k]), k


@pytest.mark.parametrize("mode", MODES)
def test_microbatches_with_global_denominator_equal_full_batch(mode):
    g = torch.Generator().manual_seed(4)
    logp = -torch.rand(6, 5, generator=g, dtype=D64)
    old = logp + 0.3 * torch.randn(6, 5, generator=g, dtype=D64)
    adv = torch.randn(6, generator=g, dtype=D64)
    mask = (torch.rand(6, 5, generator=g) > 0.4).long()
    mask[5] = 0
    full, gfull = run(logp, old, adv, mask, aggregation=mode)
    d = local_count(mask, mode)
    lp = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 3), slice(3, 6)):
        r = sapo_loss(lp[rows], old[rows], adv[rows], mask[rows], aggregation=mode, denominator=d)
        r.loss.backward()
        total += r.loss.item()
    assert total == pytest.approx(full.loss.item(), abs=1e-12)
    assert torch.allclose(lp.grad, gfull, atol=1e-14)


def test_gradcheck():
    g = torch.Generator().manual_seed(5)
    logp = (-torch.rand(3, 4, generator=g, dtype=D64)).requires_grad_(True)
    old = logp.detach() + 0.5 * torch.randn(3, 4, generator=g, dtype=D64)
    adv = torch.randn(3, 4, generator=g, dtype=D64)
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0], [0, 1, 1, 1]])
    for mode in MODES:
        f = lambda x: sapo_loss(x, old, adv, mask, aggregation=mode, tau_pos=0.7, tau_neg=1.3).loss  # noqa: E731
        assert torch.autograd.gradcheck(f, (logp,))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(MODES), tau_pos=st.floats(0.05, 10.0),
       tau_neg=st.floats(0.05, 10.0))
def test_ratio_one_gradient_equals_reinforce(seed, mode, tau_pos, tau_neg):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 4, generator=g, dtype=D64)
    adv = torch.randn(3, 4, generator=g, dtype=D64)
    mask = (torch.rand(3, 4, generator=g) > 0.3).long()
    _, gs = run(logp, logp, adv, mask, aggregation=mode, tau_pos=tau_pos, tau_neg=tau_neg)
    lp = logp.clone().requires_grad_(True)
    reinforce_loss(lp, adv, mask, aggregation=mode).loss.backward()
    assert torch.allclose(gs, lp.grad, atol=1e-14)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(old_logp=t([[-1.0, -1.0]])), "old_logp"),
        (dict(old_logp=t([[-1.0, -math.inf], [-1.0, -1.0]])), "old_logp"),
        (dict(logp=t([[[-1.0]]])), "logp"),
        (dict(advantages=t([[1.0], [1.0]])), "advantages"),
        (dict(mask=torch.tensor([[3, 1], [1, 0]])), "mask"),
        (dict(tau_pos=0.0), "tau_pos"),
        (dict(tau_neg=-1.0), "tau_neg"),
        (dict(tau_pos=math.nan), "tau_pos"),
        (dict(tau_neg=math.inf), "tau_neg"),
        (dict(aggregation="x"), "aggregation"),
    ],
)
def test_bad_inputs(kwargs, name):
    args = dict(logp=t([[-1.0, -2.0], [-0.5, -0.1]]), old_logp=t([[-1.0, -2.0], [-0.5, -0.1]]),
                advantages=t([1.0, -1.0]), mask=torch.tensor([[1, 1], [1, 0]]))
    args.update(kwargs)
    pos = [args.pop(k) for k in ("logp", "old_logp", "advantages", "mask")]
    with pytest.raises(ValueError, match=name):
        sapo_loss(*pos, **args)


# ------------------------------------------------------------- sequence-level SAPO
def _seq_batch(seed=0, B=5, L=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=D64) * 2
    old = logp + 0.6 * torch.randn(B, L, generator=g, dtype=D64)
    adv = torch.randn(B, generator=g, dtype=D64)
    mask = (torch.rand(B, L, generator=g) > 0.3).to(D64)
    mask[0] = 1
    mask[-1] = 0
    return logp, old, adv, mask


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.3, 4.0)])
def test_sequence_level_value_and_gradient(tau_pos, tau_neg):
    logp, old, adv, mask = _seq_batch()
    lp = logp.clone().requires_grad_(True)
    res = sapo_loss(lp, old, adv, mask, tau_pos=tau_pos, tau_neg=tau_neg, level="sequence")
    res.loss.backward()
    lengths = mask.sum(-1)
    nonempty = lengths > 0
    s = torch.exp(((logp - old) * mask).sum(-1) / lengths.clamp_min(1))
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    p = torch.sigmoid(tau * (s - 1))
    f = 4 / tau * p
    G = nonempty.sum()
    assert res.loss.item() == pytest.approx(-(f * adv)[nonempty].sum().item() / G.item(), rel=1e-12)
    # d/dlogp_t = -(1/G) 4p(1-p) s A / L_i : one weight per response
    want = -(4 * p * (1 - p) * s * adv / lengths.clamp_min(1))[:, None] * mask / G
    assert torch.allclose(lp.grad, want, atol=1e-14)
    assert res.metrics["sequences"].item() == G.item()
    gate = 4 * p * (1 - p)
    assert res.metrics["gate/mean"].item() == pytest.approx(gate[nonempty].mean().item())


def test_sequence_level_matches_token_level_for_uniform_log_ratios():
    # with one log ratio per response the two levels give the same gradient (the §18 regime)
    logp, _, adv, mask = _seq_batch(1)
    shift = torch.tensor([0.1, -0.2, 0.05, 0.3, 0.0], dtype=D64)[:, None]
    old = logp - shift
    g = {}
    for level in ("token", "sequence"):
        lp = logp.clone().requires_grad_(True)
        sapo_loss(lp, old, adv, mask, level=level).loss.backward()
        g[level] = lp.grad
    assert torch.allclose(g["token"], g["sequence"], atol=1e-14)


def test_sequence_level_rejects_token_advantages_and_bad_level():
    logp, old, _, mask = _seq_batch()
    with pytest.raises(ValueError, match="advantages"):
        sapo_loss(logp, old, torch.randn(logp.shape, dtype=D64), mask, level="sequence")
    with pytest.raises(ValueError, match="level"):
        sapo_loss(logp, old, torch.ones(logp.shape[0], dtype=D64), mask, level="turn")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_sequence_level_masked_slots_change_nothing(bad):
    logp, old, adv, mask = _seq_batch(2)
    mask[0, 3] = 0
    out = []
    for v in (0.0, bad):
        lp = logp.clone()
        lp[0, 3] = v
        o = old.clone()
        o[0, 3] = v
        lp.requires_grad_(True)
        res = sapo_loss(lp, o, adv, mask, level="sequence")
        res.loss.backward()
        out.append((res.loss.item(), lp.grad))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-12)
    assert torch.isfinite(out[1][1]).all() and torch.equal(out[0][1], out[1][1])
