"""Tests for trajgrad.losses.cov (Clip-Cov and KL-Cov, Cui et al. 2025)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.losses import clip_cov_loss, kl_cov_loss, ppo_clip_loss

D64 = torch.float64


def batch(seed=0, B=8, L=32, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=D64) * 4
    old = logp + noise * torch.randn(B, L, generator=g, dtype=D64)
    adv = 3 * torch.randn(B, generator=g, dtype=D64)[:, None].expand(B, L).contiguous()
    mask = (torch.rand(B, L, generator=g) > 0.2).to(D64)
    return logp, old, adv, mask


def run(fn, logp, old, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    res = fn(lp, old, adv, mask, **kw)
    res.loss.backward()
    return res, lp.grad


def covariance(logp, adv, mask):
    m = mask > 0
    return (logp - logp[m].mean()) * (adv - adv[m].mean())


def test_clip_cov_value_gradient_and_selection():
    logp, old, adv, mask = batch()
    ratio = 0.05
    res, grad = run(clip_cov_loss, logp, old, adv, mask, clip_ratio=ratio, cov_low=0.5, cov_high=5.0, seed=3)
    res_ppo, g_ppo = run(ppo_clip_loss, logp, old, adv, mask, eps_low=0.2)
    # value: the PPO value (selected tokens keep their value, lose their gradient)
    assert res.loss.item() == pytest.approx(res_ppo.loss.item(), rel=1e-12)
    n = int(mask.sum())
    mass = ratio * n
    active = g_ppo != 0
    # each token's gradient is (1 - w) times PPO's, w in [0, 1] its selection weight
    w = torch.where(active, 1 - grad / torch.where(active, g_ppo, torch.ones_like(g_ppo)), torch.zeros_like(grad))
    assert w.sum().item() == pytest.approx(mass, rel=1e-9)
    assert res.metrics["cov/selected_frac"].item() == pytest.approx(ratio)
    full = w > 1 - 1e-9
    partial = (w > 1e-9) & ~full
    assert int(full.sum()) == math.floor(mass) and int(partial.sum()) == 1
    assert w[partial].item() == pytest.approx(mass - math.floor(mass))
    # every selected token is a candidate: covariance inside the window, not clipped by PPO
    cov = covariance(logp, adv, mask)
    sel = full | partial
    assert ((cov[sel] > 0.5) & (cov[sel] < 5.0)).all()
    # all other tokens have exactly PPO's gradient
    assert torch.equal(grad[~sel], g_ppo[~sel])


def test_clip_cov_selection_is_deterministic_given_the_seed():
    logp, old, adv, mask = batch(1)
    kw = dict(clip_ratio=0.05, cov_low=0.1, cov_high=10.0)
    _, g1 = run(clip_cov_loss, logp, old, adv, mask, seed=7, **kw)
    _, g2 = run(clip_cov_loss, logp, old, adv, mask, seed=7, **kw)
    _, g3 = run(clip_cov_loss, logp, old, adv, mask, generator=torch.Generator().manual_seed(7), **kw)
    _, g4 = run(clip_cov_loss, logp, old, adv, mask, seed=8, **kw)
    assert torch.equal(g1, g2) and torch.equal(g1, g3)
    assert not torch.equal(g1, g4)


def test_kl_cov_value_and_gradient_match_the_analytic_form():
    logp, old, adv, mask = batch(2)
    ratio, beta = 0.03, 0.7
    res, grad = run(kl_cov_loss, logp, old, adv, mask, kl_ratio=ratio, kl_coef=beta)
    cov = covariance(logp, adv, mask)
    n = int(mask.sum())
    mass = ratio * n
    k = math.floor(mass)
    flat = torch.where((mask > 0) & (cov > 0), cov, torch.full_like(cov, -math.inf)).reshape(-1)
    order = torch.argsort(flat, descending=True)
    sel = torch.zeros(flat.shape, dtype=D64)
    sel[order[:k]] = 1.0
    sel[order[k]] = mass - k  # the partly selected token
    sel = sel.reshape(cov.shape)
    z = logp - old
    r = z.exp()
    value = ((-r * adv + beta * z.abs() * sel) * mask).sum() / n
    assert res.loss.item() == pytest.approx(value.item(), rel=1e-12)
    want = (-r * adv + beta * sel * torch.sign(z)) * mask / n
    assert torch.allclose(grad, want, atol=1e-14)
    assert res.metrics["cov/selected_frac"].item() == pytest.approx(ratio)


def test_kl_cov_zero_advantages_select_nothing_and_the_mass_is_continuous():
    logp, old, adv, mask = batch(4)
    res, g = run(kl_cov_loss, logp, old, torch.zeros_like(adv), mask)
    assert (g == 0).all() and res.metrics["cov/selected_frac"].item() == 0.0
    losses = [run(kl_cov_loss, logp, old, adv, mask, kl_ratio=r)[0].loss.item() for r in (2e-3, 3e-3, 4e-3)]
    assert losses[0] < losses[1] < losses[2]  # rN < 1 here: still a continuous (fractional) selection


@pytest.mark.parametrize("fn", [clip_cov_loss, kl_cov_loss])
@settings(max_examples=15, deadline=None)
@given(v=st.sampled_from([math.nan, math.inf, -math.inf]), which=st.sampled_from(["logp", "old", "adv"]))
def test_nonfinite_at_masked_positions_is_inert(fn, v, which):
    logp, old, adv, mask = batch(3)
    mask[0, 0] = 0
    res0, g0 = run(fn, logp, old, adv, mask)
    x = {"logp": logp.clone(), "old": old.clone(), "adv": adv.clone()}
    x[which][0, 0] = v
    res, g = run(fn, x["logp"], x["old"], x["adv"], mask)
    assert torch.isfinite(g).all()
    assert res.loss.item() == pytest.approx(res0.loss.item(), rel=1e-12)
    assert torch.allclose(g, g0, atol=0)


def test_empty_mask_gives_zero_and_finite_metrics():
    logp, old, adv, mask = batch()
    for fn in (clip_cov_loss, kl_cov_loss):
        res, g = run(fn, logp, old, adv, torch.zeros_like(mask))
        assert res.loss.item() == 0.0 and (g == 0).all()
        assert all(torch.isfinite(v) for v in res.metrics.values())


@pytest.mark.parametrize(
    "fn,kw,name",
    [
        (clip_cov_loss, {"clip_ratio": 0.0}, "clip_ratio"),
        (clip_cov_loss, {"cov_low": 5.0, "cov_high": 1.0}, "cov_low"),
        (clip_cov_loss, {"generator": 3}, "generator"),
        (kl_cov_loss, {"kl_ratio": 2.0}, "kl_ratio"),
        (kl_cov_loss, {"kl_coef": -1.0}, "kl_coef"),
        (kl_cov_loss, {"aggregation": "x"}, "aggregation"),
    ],
)
def test_bad_arguments_name_themselves(fn, kw, name):
    logp, old, adv, mask = batch()
    with pytest.raises(ValueError, match=name):
        fn(logp, old, adv, mask, **kw)
