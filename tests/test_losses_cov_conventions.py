"""Clip-Cov / KL-Cov conventions and their public token sets, against hand loops written from
Cui et al. 2025 and the authors' verl code."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.losses import clip_cov_candidates, clip_cov_loss, kl_cov_loss, kl_cov_top_tokens, token_covariance

D64 = torch.float64


def batch(seed=0, B=6, L=10, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=D64) * 4
    old = logp + noise * torch.randn(B, L, generator=g, dtype=D64)
    adv = 3 * torch.randn(B, L, generator=g, dtype=D64)
    mask = torch.rand(B, L, generator=g) > 0.2
    return logp, old, adv, mask


def valid(mask):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]


def hand_cov(logp, adv, mask):
    v = valid(mask)
    lbar = sum(float(logp[i, t]) for i, t in v) / len(v)
    abar = sum(float(adv[i, t]) for i, t in v) / len(v)
    out = torch.zeros(logp.shape, dtype=D64)
    for i, t in v:
        out[i, t] = (float(logp[i, t]) - lbar) * (float(adv[i, t]) - abar)
    return out


def hand_ppo_term(lp, old, a, eps=0.2):
    r = torch.exp(lp - old)
    return torch.minimum(r * a, torch.clamp(r, 1 - eps, 1 + eps) * a)


def test_token_covariance_matches_the_hand_loop_and_its_worked_example():
    logp, old, adv, mask = batch()
    assert torch.allclose(token_covariance(logp, adv, mask), hand_cov(logp, adv, mask), atol=1e-12)
    ex = token_covariance(torch.tensor([[-1.0, -3.0]], dtype=D64), torch.tensor([[2.0, 0.0]], dtype=D64),
                          torch.ones(1, 2))
    assert ex.tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("band", ["open", "closed"])
@pytest.mark.parametrize("exclude", [True, False])
def test_clip_cov_candidates_match_the_hand_loop(band, exclude):
    logp, old, adv, mask = batch(1, noise=0.5)
    cov = hand_cov(logp, adv, mask)
    lo, hi = 0.3, 4.0
    got = clip_cov_candidates(logp, old, adv, mask, cov_low=lo, cov_high=hi, cov_band=band, exclude_clipped=exclude)
    want = torch.zeros(logp.shape, dtype=torch.bool)
    for i, t in valid(mask):
        c, a, r = float(cov[i, t]), float(adv[i, t]), math.exp(float(logp[i, t] - old[i, t]))
        inside = lo < c < hi if band == "open" else lo <= c <= hi
        clipped = (a > 0 and r > 1.2) or (a < 0 and r < 0.8)
        want[i, t] = inside and not (exclude and clipped)
    assert torch.equal(got, want) and 0 < int(got.sum())
    if not exclude:
        assert int(got.sum()) > int(clip_cov_candidates(logp, old, adv, mask, cov_low=lo, cov_high=hi,
                                                        cov_band=band).sum())


def test_clip_cov_candidates_docstring_worked_example():
    x = torch.tensor([[0.0, 2.0, 4.0]], dtype=D64)
    one = torch.ones(1, 3)
    assert token_covariance(x, x, one).tolist() == [[4.0, 0.0, 4.0]]
    kw = dict(cov_low=0.0, cov_high=4.0)
    assert clip_cov_candidates(x, x, x, one, **kw).tolist() == [[False] * 3]
    assert clip_cov_candidates(x, x, x, one, cov_band="closed", **kw).tolist() == [[True] * 3]


@pytest.mark.parametrize("positive_only", [True, False])
@pytest.mark.parametrize("ratio", [0.05, 0.13, 0.5])
def test_kl_cov_top_tokens_match_the_hand_loop(positive_only, ratio):
    logp, old, adv, mask = batch(2)
    cov = hand_cov(logp, adv, mask)
    got = kl_cov_top_tokens(logp, adv, mask, kl_ratio=ratio, positive_only=positive_only)
    v = [(float(cov[i, t]), i, t) for i, t in valid(mask) if (float(cov[i, t]) > 0 or not positive_only)]
    v.sort(reverse=True)
    mass = ratio * len(valid(mask))
    want = torch.zeros(logp.shape, dtype=D64)
    for k, (_, i, t) in enumerate(v):
        want[i, t] = 1.0 if k < math.floor(mass) else (mass - math.floor(mass) if k == math.floor(mass) else 0.0)
    assert torch.allclose(got, want, atol=1e-12)


def test_kl_cov_top_tokens_docstring_worked_example():
    # Cov = (2, -1, -3) needs l - lbar and A - abar; take l = (1, 0, -1), A = (2, 1, 3) + shift:
    logp = torch.tensor([[1.0, 0.0, -1.0]], dtype=D64)
    adv = torch.tensor([[2.0, -1.0, 3.0]], dtype=D64)  # abar = 4/3; Cov = (1*(2/3), 0, -1*(5/3))
    cov = token_covariance(logp, adv, torch.ones(1, 3))
    order = cov[0].argsort(descending=True).tolist()
    pos = kl_cov_top_tokens(logp, adv, torch.ones(1, 3), kl_ratio=0.5)
    allv = kl_cov_top_tokens(logp, adv, torch.ones(1, 3), kl_ratio=0.5, positive_only=False)
    assert pos[0, order[0]] == 1.0 and pos.sum() == 1.0  # one positive covariance: only it
    assert allv[0, order[0]] == 1.0 and allv[0, order[1]] == 0.5 and allv[0, order[2]] == 0.0


@pytest.mark.parametrize("selected", ["detach", "zero"])
def test_clip_cov_caller_mask_matches_the_hand_form_in_value_and_gradient(selected):
    logp, old, adv, mask = batch(3)
    g = torch.Generator().manual_seed(9)
    sel = torch.rand(logp.shape, generator=g) > 0.7
    lp = logp.clone().requires_grad_(True)
    res = clip_cov_loss(lp, old, adv, mask, selection_mask=sel, selected=selected)
    g_got, = torch.autograd.grad(res.loss, lp)
    lp2 = logp.clone().requires_grad_(True)
    total = 0.0
    for i, t in valid(mask):
        s = hand_ppo_term(lp2[i, t], old[i, t], adv[i, t])
        if sel[i, t]:
            s = s.detach() if selected == "detach" else 0.0 * s
        total = total - s
    want = total / len(valid(mask))
    g_want, = torch.autograd.grad(want, lp2)
    assert res.loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(g_got, g_want, atol=1e-14)
    assert res.metrics["cov/selected_frac"].item() == pytest.approx(int((sel & mask).sum()) / len(valid(mask)))


def test_clip_cov_zero_and_detach_select_the_same_tokens_and_differ_by_their_value():
    logp, old, adv, mask = batch(4, B=16, L=40)
    kw = dict(clip_ratio=0.05, cov_low=0.5, cov_high=5.0, seed=2)
    lp = logp.clone().requires_grad_(True)
    d = clip_cov_loss(lp, old, adv, mask, **kw)
    gd, = torch.autograd.grad(d.loss, lp)
    lp = logp.clone().requires_grad_(True)
    z = clip_cov_loss(lp, old, adv, mask, selected="zero", **kw)
    gz, = torch.autograd.grad(z.loss, lp)
    assert torch.equal(gd, gz) and z.loss.item() != d.loss.item()


def test_clip_cov_docstring_worked_example():
    lp0 = torch.tensor([[0.1]], dtype=D64)
    old, adv, m = torch.zeros(1, 1, dtype=D64), torch.ones(1, 1, dtype=D64), torch.ones(1, 1, dtype=torch.bool)
    out = {}
    for name, kw in {"detach": dict(selection_mask=m), "zero": dict(selection_mask=m, selected="zero"),
                     "none": dict(selection_mask=~m)}.items():
        lp = lp0.clone().requires_grad_(True)
        r = clip_cov_loss(lp, old, adv, m, **kw)
        out[name] = (round(r.loss.item(), 6), round(torch.autograd.grad(r.loss, lp)[0].item(), 6))
    assert out == {"detach": (-1.105171, 0.0), "zero": (0.0, 0.0), "none": (-1.105171, -1.105171)}


@pytest.mark.parametrize("base", ["unclipped", "ppo_clip"])
@pytest.mark.parametrize("positive_only", [True, False])
def test_kl_cov_conventions_match_the_hand_form_in_value_and_gradient(base, positive_only):
    logp, old, adv, mask = batch(5, noise=0.5)
    w = kl_cov_top_tokens(logp, adv, mask, kl_ratio=0.2, positive_only=positive_only)
    lp = logp.clone().requires_grad_(True)
    res = kl_cov_loss(lp, old, adv, mask, kl_ratio=0.2, kl_coef=0.7, positive_only=positive_only, base=base)
    g_got, = torch.autograd.grad(res.loss, lp)
    lp2 = logp.clone().requires_grad_(True)
    total = 0.0
    for i, t in valid(mask):
        z = lp2[i, t] - old[i, t]
        s = hand_ppo_term(lp2[i, t], old[i, t], adv[i, t]) if base == "ppo_clip" else torch.exp(z) * adv[i, t]
        total = total - s + 0.7 * float(w[i, t]) * z.abs()
    want = total / len(valid(mask))
    g_want, = torch.autograd.grad(want, lp2)
    assert res.loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(g_got, g_want, atol=1e-14)


def test_kl_cov_docstring_worked_example():
    m = torch.ones(1, 1, dtype=torch.bool)
    old, adv = torch.zeros(1, 1, dtype=D64), torch.ones(1, 1, dtype=D64)
    # one token: its covariance is 0, so select it with positive_only=False (top-k over every valid token)
    out = {}
    for base in ("unclipped", "ppo_clip"):
        lp = torch.tensor([[0.5]], dtype=D64, requires_grad=True)
        r = kl_cov_loss(lp, old, adv, m, kl_ratio=1.0, positive_only=False, base=base)
        out[base] = (round(r.loss.item(), 6), round(torch.autograd.grad(r.loss, lp)[0].item(), 6))
    assert out == {"unclipped": (-1.148721, -0.648721), "ppo_clip": (-0.7, 1.0)}


@settings(max_examples=20, deadline=None)
@given(v=st.sampled_from([math.nan, math.inf, -math.inf]), which=st.sampled_from(["logp", "old", "adv"]))
def test_new_options_keep_masked_positions_inert(v, which):
    logp, old, adv, mask = batch(6)
    mask[0, 0] = False
    sel = torch.zeros(mask.shape, dtype=torch.bool)
    sel[0, 0] = sel[1, 1] = True
    cases = [(clip_cov_loss, dict(selection_mask=sel, selected="zero")),
             (clip_cov_loss, dict(cov_band="closed", exclude_clipped=False, clip_ratio=0.1, cov_low=0.1)),
             (kl_cov_loss, dict(positive_only=False, base="ppo_clip", kl_ratio=0.1))]
    for fn, kw in cases:
        x = {"logp": logp.clone(), "old": old.clone(), "adv": adv.clone()}
        lp0 = logp.clone().requires_grad_(True)
        r0 = fn(lp0, old, adv, mask, **kw)
        g0, = torch.autograd.grad(r0.loss, lp0)
        x[which][0, 0] = v
        lp = x["logp"].clone().requires_grad_(True)
        r = fn(lp, x["old"], x["adv"], mask, **kw)
        g, = torch.autograd.grad(r.loss, lp)
        assert r.loss.item() == r0.loss.item() and torch.equal(g, g0) and torch.isfinite(g).all()
    poisoned = logp.clone()
    poisoned[0, 0] = v
    assert torch.equal(token_covariance(poisoned, adv, mask), token_covariance(logp, adv, mask))


@pytest.mark.parametrize("fn,kw,name", [
    (clip_cov_loss, {"selected": "drop"}, "selected"),
    (clip_cov_loss, {"cov_band": "half"}, "cov_band"),
    (clip_cov_loss, {"selection_mask": torch.ones(2, 2)}, "selection_mask"),
    (kl_cov_loss, {"base": "gspo"}, "base"),
    (kl_cov_loss, {"base": "ppo_clip", "eps_low": -0.1}, "eps_low"),
    (clip_cov_candidates, {"cov_band": "x"}, "cov_band"),
])
def test_new_arguments_name_themselves(fn, kw, name):
    logp, old, adv, mask = batch()
    with pytest.raises(ValueError, match=name):
        fn(logp, old, adv, mask, **kw)
    with pytest.raises(ValueError, match="kl_ratio"):
        kl_cov_top_tokens(logp, adv, mask, kl_ratio=0.0)
