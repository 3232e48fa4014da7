"""DPPO's public token sets (the binary divergence and the trust mask) against hand loops written
from Qi et al. 2026, and the losses' use of them."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.losses import dppo_binary_divergence, dppo_kl_loss, dppo_trust_mask, dppo_tv_loss

D64 = torch.float64


def batch(seed=0, B=5, L=8):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=D64) * 3
    old = (logp + 0.6 * torch.randn(B, L, generator=g, dtype=D64)).clamp(max=-1e-3)
    adv = torch.randn(B, L, generator=g, dtype=D64)
    mask = torch.rand(B, L, generator=g) > 0.25
    return logp, old, adv, mask


def hand(logp, old, adv, mask, kind, dl, dh):
    """The paper's binary TV / KL of (q, 1-q) vs (p, 1-p) and its one-sided mask, token by token."""
    B, L = mask.shape
    div = torch.zeros(B, L, dtype=D64)
    keep = torch.zeros(B, L, dtype=torch.bool)
    for i in range(B):
        for t in range(L):
            if not mask[i, t]:
                continue
            p, q, a = math.exp(float(logp[i, t])), math.exp(float(old[i, t])), float(adv[i, t])
            if kind == "tv":
                d = abs(p - q)
                out = (a > 0 and p - q > dh) or (a < 0 and p - q < -dl)
            else:
                d = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
                out = (a > 0 and p > q and d > dh) or (a < 0 and p < q and d > dl)
            div[i, t], keep[i, t] = d, not out
    return div, keep


@pytest.mark.parametrize("kind,dl,dh", [("tv", 0.1, 0.05), ("kl", 0.03, 0.06)])
def test_token_sets_match_the_hand_loop_and_drive_the_loss(kind, dl, dh):
    logp, old, adv, mask = batch()
    div, keep = hand(logp, old, adv, mask, kind, dl, dh)
    assert torch.allclose(dppo_binary_divergence(logp, old, mask, kind=kind), div, atol=1e-9)
    got = dppo_trust_mask(logp, old, adv, mask, kind=kind, delta_low=dl, delta_high=dh)
    assert torch.equal(got, keep) and 0 < int((mask & ~keep).sum())
    # the loss: -mean_t M_t sg[r_t] A_t logp_t, value and gradient, with the hand mask
    fn = dppo_tv_loss if kind == "tv" else dppo_kl_loss
    lp = logp.clone().requires_grad_(True)
    res = fn(lp, old, adv, mask, delta_low=dl, delta_high=dh)
    g, = torch.autograd.grad(res.loss, lp)
    lp2 = logp.clone().requires_grad_(True)
    n = int(mask.sum())
    want = -sum(math.exp(float(logp[i, t] - old[i, t])) * float(adv[i, t]) * lp2[i, t]
                for i in range(5) for t in range(8) if keep[i, t]) / n
    gw, = torch.autograd.grad(want, lp2)
    assert res.loss.item() == pytest.approx(want.item(), rel=1e-12) and torch.allclose(g, gw, atol=1e-14)
    assert res.metrics["mask_frac"].item() == pytest.approx(int((mask & ~keep).sum()) / n)


def test_docstring_worked_examples():
    one = torch.ones(1, 1)
    q, p = torch.tensor([[math.log(0.5)]], dtype=D64), torch.tensor([[math.log(0.25)]], dtype=D64)
    assert dppo_binary_divergence(p, q, one).item() == pytest.approx(0.25, abs=1e-15)
    assert dppo_binary_divergence(p, q, one, kind="kl").item() == pytest.approx(0.143841, abs=1e-6)
    up = torch.tensor([[math.log(0.65)]], dtype=D64)
    down = torch.tensor([[math.log(0.35)]], dtype=D64)
    pos, neg = torch.ones(1, 1, dtype=D64), -torch.ones(1, 1, dtype=D64)
    assert dppo_trust_mask(up, q, pos, one).tolist() == [[False]]
    assert dppo_trust_mask(up, q, neg, one).tolist() == [[True]]
    assert dppo_trust_mask(down, q, neg, one).tolist() == [[False]]


@settings(max_examples=20, deadline=None)
@given(v=st.sampled_from([math.nan, math.inf, -math.inf]), kind=st.sampled_from(["tv", "kl"]))
def test_masked_positions_do_not_leak(v, kind):
    logp, old, adv, mask = batch(1)
    mask[0, 0] = False
    d0 = dppo_binary_divergence(logp, old, mask, kind=kind)
    k0 = dppo_trust_mask(logp, old, adv, mask, kind=kind)
    lp, od, ad = logp.clone(), old.clone(), adv.clone()
    lp[0, 0] = od[0, 0] = ad[0, 0] = v
    assert torch.equal(dppo_binary_divergence(lp, od, mask, kind=kind), d0)
    assert torch.equal(dppo_trust_mask(lp, od, ad, mask, kind=kind), k0) and not k0[0, 0]


@pytest.mark.parametrize("kw,name", [({"kind": "js"}, "kind"), ({"delta_low": 0.0}, "delta_low"),
                                     ({"delta_high": math.inf}, "delta_high")])
def test_bad_arguments_name_themselves(kw, name):
    logp, old, adv, mask = batch()
    with pytest.raises(ValueError, match=name):
        dppo_trust_mask(logp, old, adv, mask, **kw)
    with pytest.raises(ValueError, match="kind"):
        dppo_binary_divergence(logp, old, mask, kind="js")
    with pytest.raises(ValueError, match="old_logp"):
        dppo_binary_divergence(logp, old[:, :2], mask)
