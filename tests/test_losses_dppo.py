"""Tests for trajgrad.losses.dppo (DPPO binary-TV and binary-KL trust regions)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.losses import dppo_kl_loss, dppo_tv_loss

D64 = torch.float64


def batch(seed=0, B=4, L=8, noise=0.8):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=D64) * 2.5
    old = (logp + noise * torch.randn(B, L, generator=g, dtype=D64)).clamp(max=-1e-3)
    adv = torch.randn(B, L, generator=g, dtype=D64)
    mask = (torch.rand(B, L, generator=g) > 0.25).to(D64)
    mask[0] = 1
    return logp, old, adv, mask


def run(fn, logp, old, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    res = fn(lp, old, adv, mask, **kw)
    res.loss.backward()
    return res, lp.grad


def binary_kl(q, p):
    return q * torch.log(q / p) + (1 - q) * torch.log((1 - q) / (1 - p))


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("cap", [None, 1.5])
def test_value_and_gradient_match_the_analytic_form(kind, cap):
    logp, old, adv, mask = batch()
    p, q = logp.exp(), old.exp()
    if kind == "tv":
        fn, delta = dppo_tv_loss, 0.1
        masked = ((adv > 0) & (p - q > delta)) | ((adv < 0) & (p - q < -delta))
    else:
        fn, delta = dppo_kl_loss, 0.05
        d = binary_kl(q, p)
        masked = ((adv > 0) & (p > q) & (d > delta)) | ((adv < 0) & (p < q) & (d > delta))
    res, grad = run(fn, logp, old, adv, mask, delta_low=delta, delta_high=delta, ratio_cap=cap)
    r = torch.exp(logp - old)
    if cap is not None:
        r = r.clamp(max=cap)
    keep = (~masked).to(D64) * mask
    n = mask.sum()
    assert res.loss.item() == pytest.approx(-(keep * r * adv * logp).sum().item() / n.item(), rel=1e-12)
    assert torch.allclose(grad, -keep * r * adv / n, atol=1e-14)
    frac = (masked.to(D64) * mask).sum() / n
    assert res.metrics["mask_frac"].item() == pytest.approx(frac.item())
    assert 0 < frac < 1  # the batch exercises both branches


def test_tv_uses_absolute_probability_not_the_ratio():
    # q = 0.001 -> p = 0.05: ratio 50 (PPO would clip), |p - q| < 0.1: kept
    # q = 0.9 -> p = 0.75: ratio 0.83 (inside PPO's range), but with A < 0 |p - q| > 0.1: masked
    logp = torch.tensor([[math.log(0.05), math.log(0.75)]], dtype=D64)
    old = torch.tensor([[math.log(0.001), math.log(0.9)]], dtype=D64)
    adv = torch.tensor([[1.0, -1.0]], dtype=D64)
    res, g = run(dppo_tv_loss, logp, old, adv, torch.ones(1, 2))
    assert g[0, 0].item() == pytest.approx(-50.0 / 2)
    assert g[0, 1].item() == 0.0
    # moving back toward q is never masked: A > 0 with p < q
    res, g = run(dppo_tv_loss, logp.flip(-1), old.flip(-1), torch.tensor([[1.0, 1.0]], dtype=D64), torch.ones(1, 2))
    assert g[0, 0].item() != 0.0


def test_kl_boundary_and_certain_tokens_are_finite():
    # q = 1 exactly (log 0): the binary KL caps p, q below 1 and stays finite
    logp = torch.tensor([[-0.5, -1e-9]], dtype=D64)
    old = torch.tensor([[0.0, 0.0]], dtype=D64)
    res, g = run(dppo_kl_loss, logp, old, torch.tensor([[-1.0, -1.0]], dtype=D64), torch.ones(1, 2))
    assert torch.isfinite(res.loss) and torch.isfinite(g).all()
    assert all(torch.isfinite(v) for v in res.metrics.values())


@pytest.mark.parametrize("fn", [dppo_tv_loss, dppo_kl_loss])
@settings(max_examples=20, deadline=None)
@given(v=st.sampled_from([math.nan, math.inf, -math.inf]), which=st.sampled_from(["logp", "old", "adv"]))
def test_nonfinite_at_masked_positions_is_inert(fn, v, which):
    logp, old, adv, mask = batch(2)
    mask[2, 3] = 0
    res0, g0 = run(fn, logp, old, adv, mask)
    x = {"logp": logp.clone(), "old": old.clone(), "adv": adv.clone()}
    x[which][2, 3] = v
    res, g = run(fn, x["logp"], x["old"], x["adv"], mask)
    assert torch.isfinite(g).all()
    assert res.loss.item() == pytest.approx(res0.loss.item(), rel=1e-12)
    assert torch.allclose(g, g0, atol=0)


def test_huge_ratio_on_a_masked_token_gives_no_nan():
    # z = 800 overflows exp in float64; the token is masked (A > 0, p - q > delta): gradient 0, no NaN
    logp = torch.tensor([[-0.1]], dtype=D64)
    old = torch.tensor([[-800.0]], dtype=D64)
    res, g = run(dppo_tv_loss, logp, old, torch.tensor([[1.0]], dtype=D64), torch.ones(1, 1))
    assert g.item() == 0.0 and torch.isfinite(res.loss)


@pytest.mark.parametrize("fn", [dppo_tv_loss, dppo_kl_loss])
@pytest.mark.parametrize("kw,name", [({"delta_low": 0.0}, "delta_low"), ({"delta_high": math.nan}, "delta_high"),
                                     ({"ratio_cap": -1.0}, "ratio_cap"), ({"aggregation": "x"}, "aggregation")])
def test_bad_arguments_name_themselves(fn, kw, name):
    logp, old, adv, mask = batch()
    with pytest.raises(ValueError, match=name):
        fn(logp, old, adv, mask, **kw)
