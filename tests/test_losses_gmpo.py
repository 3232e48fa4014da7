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
