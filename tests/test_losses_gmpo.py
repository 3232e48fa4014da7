"""Tests for trajgrad.losses.gmpo (Geometric-Mean Policy Optimization)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.losses import gmpo_loss, gspo_loss

D64 = torch.float64


def batch(seed=0, B=5, L=6, noise=0.5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=D64) * 3
    old = logp + noise * torch.randn(B, L, generator=g, dtype=D64)
    adv = torch.randn(B, generator=g, dtype=D64)
    mask = (torch.rand(B, L, generator=g) > 0.3).to(D64)
    mask[0] = 1
    mask[-1] = 0  # an empty response
    return logp, old, adv, mask


def run(logp, old, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    res = gmpo_loss(lp, old, adv, mask, **kw)
    res.loss.backward()
    return res, lp.grad


def reference(logp, old, adv, mask, cl=0.4, ch=0.4):
    """The paper's sign trick written out: z~ = sgn * min(sgn z, sgn clamp(z))."""
    z = logp - old
    sgn = torch.sign(adv)[:, None]
    zt = sgn * torch.minimum(sgn * z, sgn * z.clamp(-cl, ch))
    lengths = mask.sum(-1)
    s = torch.exp((zt * mask).sum(-1) / lengths.clamp_min(1))
    j = adv * s
    nonempty = lengths > 0
    active = ((adv[:, None] > 0) & (z <= ch)) | ((adv[:, None] < 0) & (z >= -cl))
    return -j[nonempty].mean(), s, active, lengths, nonempty


def test_value_and_gradient_match_the_analytic_form():
    logp, old, adv, mask = batch()
    res, grad = run(logp, old, adv, mask)
    loss, s, active, lengths, nonempty = reference(logp, old, adv, mask)
    assert res.loss.item() == pytest.approx(loss.item(), rel=1e-12)
    G = nonempty.sum()
    # dL/dlogp_t = -(1/G) A_i s_i / L_i * 1[t active]
    want = -(adv * s / lengths.clamp_min(1))[:, None] * active.to(D64) * mask / G
    assert torch.allclose(grad, want, atol=1e-14)
    assert 0 < res.metrics["clip_frac"].item() < 1


def test_unclipped_equals_gspo_with_a_wide_range():
    # inside every bound, GMPO's J_i = A_i exp(mean z) is GSPO's unclipped objective
    logp, old, adv, mask = batch(1, noise=0.05)
    res, g = run(logp, old, adv, mask, clip_low=5.0, clip_high=5.0)
    lp = logp.clone().requires_grad_(True)
    gs = gspo_loss(lp, old, adv, mask, eps_low=0.99, eps_high=100.0)
    gs.loss.backward()
    assert res.loss.item() == pytest.approx(gs.loss.item(), rel=1e-12)
    assert torch.allclose(g, lp.grad, atol=1e-14)


def test_boundary_is_active():
    # A > 0 with z exactly c_h: still active (clamp passes the gradient at equality)
    logp, old, adv, mask = torch.tensor([[0.4 - 1.0]], dtype=D64), torch.tensor([[-1.0]], dtype=D64), \
        torch.tensor([1.0], dtype=D64), torch.ones(1, 1)
    z = (logp - old).item()
    _, g = run(logp, old, adv, mask, clip_high=z)
    assert g.item() == pytest.approx(-math.exp(z))


def test_token_advantages_must_be_constant_per_response():
    logp, old, _, mask = batch()
    adv = torch.randn(logp.shape, dtype=D64)
    with pytest.raises(ValueError, match="advantages"):
        gmpo_loss(logp, old, adv, mask)


@settings(max_examples=25, deadline=None)
@given(v=st.sampled_from([math.nan, math.inf, -math.inf]), which=st.sampled_from(["logp", "old"]))
def test_nonfinite_at_masked_positions_is_inert(v, which):
    logp, old, adv, mask = batch(2)
    mask[1, 0] = 0
    res0, g0 = run(logp, old, adv, mask)
    x = {"logp": logp.clone(), "old": old.clone()}
    x[which][1, 0] = v
    res, g = run(x["logp"], x["old"], adv, mask)
    assert torch.isfinite(g).all()
    assert res.loss.item() == pytest.approx(res0.loss.item(), rel=1e-12)
    assert torch.allclose(g, g0, atol=0)


@pytest.mark.parametrize("kw,name", [({"clip_low": 0.0}, "clip_low"), ({"clip_high": math.inf}, "clip_high"),
                                     ({"aggregation": "x"}, "aggregation")])
def test_bad_arguments_name_themselves(kw, name):
    logp, old, adv, mask = batch()
    with pytest.raises(ValueError, match=name):
        gmpo_loss(logp, old, adv, mask, **kw)


def test_weights_spread_the_response_term():
    logp, old, adv, mask = batch(4)
    w = torch.ones(logp.shape, dtype=D64)
    res_w, g_w = run(logp, old, adv, mask, weights=w)
    res, g = run(logp, old, adv, mask)
    assert res_w.loss.item() == pytest.approx(res.loss.item(), rel=1e-12)
    assert torch.allclose(g_w, g, atol=1e-14)


def _sequence_clip_hand(logp, adv, mask, old, cl, ch):
    """The paper's sequence-level clipping written as a loop: per response, the mean log-ratio
    zbar, clipped as min(sgn*zbar, sgn*clamp(zbar)) * sgn; J_i = A_i exp(zbar~); loss -mean_i J_i."""
    total, G = 0.0, 0
    for i in range(logp.shape[0]):
        ts = [t for t in range(logp.shape[1]) if mask[i, t]]
        if not ts:
            continue
        zbar = sum(logp[i, t] - old[i, t] for t in ts) / len(ts)
        sgn = 1.0 if adv[i] > 0 else -1.0
        zc = sgn * torch.minimum(sgn * zbar, sgn * zbar.clamp(-cl, ch))
        total = total + float(adv[i]) * torch.exp(zc)
        G += 1
    return -total / G


@pytest.mark.parametrize("cl,ch", [(0.4, 0.4), (0.1, 0.3)])
def test_sequence_level_clipping_matches_the_paper_in_value_and_gradient(cl, ch):
    logp, old, adv, mask = batch(6, B=8, noise=1.5)
    res, g = run(logp, old, adv, mask, clip_low=cl, clip_high=ch, clip_level="sequence")
    lp = logp.clone().requires_grad_(True)
    want = _sequence_clip_hand(lp, adv, mask, old, cl, ch)
    g_want, = torch.autograd.grad(want, lp)
    assert res.loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(g, g_want, atol=1e-14)
    clipped_rows = (g.abs().sum(-1) == 0) & (mask.sum(-1) > 0)
    assert 0 < int(clipped_rows.sum()) < 7
    n_clipped_tokens = (mask * clipped_rows[:, None]).sum() / mask.sum()
    assert res.metrics["clip_frac"].item() == pytest.approx(n_clipped_tokens.item())


def test_sequence_level_equals_token_level_when_nothing_clips():
    logp, old, adv, mask = batch(3, noise=0.05)
    a, ga = run(logp, old, adv, mask, clip_level="sequence", clip_low=1.0, clip_high=1.0)
    b, gb = run(logp, old, adv, mask, clip_low=1.0, clip_high=1.0)
    assert a.loss.item() == pytest.approx(b.loss.item(), rel=1e-12) and torch.allclose(ga, gb, atol=1e-14)


def test_clip_level_docstring_worked_example():
    logp = torch.tensor([[0.7, 0.3]], dtype=D64)
    old = torch.zeros(1, 2, dtype=D64)
    adv, mask = torch.tensor([1.0], dtype=D64), torch.ones(1, 2, dtype=D64)
    tok, g_tok = run(logp, old, adv, mask)
    seq, g_seq = run(logp, old, adv, mask, clip_level="sequence")
    assert tok.loss.item() == pytest.approx(-1.419068, abs=1e-6)
    assert g_tok.tolist() == [[0.0, pytest.approx(-0.709534, abs=1e-6)]]
    assert seq.loss.item() == pytest.approx(-1.491825, abs=1e-6) and g_seq.tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("v", [math.nan, math.inf, -math.inf])
def test_sequence_level_masked_positions_are_inert(v):
    logp, old, adv, mask = batch(2)
    mask[1, 0] = 0
    r0, g0 = run(logp, old, adv, mask, clip_level="sequence")
    lp, od = logp.clone(), old.clone()
    lp[1, 0], od[1, 0] = v, v
    r, g = run(lp, od, adv, mask, clip_level="sequence")
    assert r.loss.item() == pytest.approx(r0.loss.item(), rel=1e-12) and torch.equal(g, g0)


def test_bad_clip_level_names_itself():
    logp, old, adv, mask = batch()
    with pytest.raises(ValueError, match="clip_level"):
        gmpo_loss(logp, old, adv, mask, clip_level="row")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), c=st.floats(0.05, 1.0))
def test_sequence_level_ratio_stays_inside_its_one_sided_bound(seed, c):
    logp, old, adv, mask = batch(seed)
    res = gmpo_loss(logp, old, adv, mask, clip_low=c, clip_high=c, clip_level="sequence")
    # every response's clipped mean log-ratio obeys its side's bound, so |J_i| <= |A_i| e^c on the clipped side
    lengths = mask.sum(-1)
    zbar = ((logp - old) * mask).sum(-1) / lengths.clamp_min(1)
    j = torch.where(adv > 0, adv * torch.exp(zbar.clamp(max=c)), adv * torch.exp(zbar.clamp(min=-c)))
    assert res.loss.item() == pytest.approx(-j[lengths > 0].mean().item(), rel=1e-12)
