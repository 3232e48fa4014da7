"""VESPO: value and gradient against the hand-written Gamma weight; φ(1) = 1; masked NaN; bad input."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from trajgrad.aggregate import aggregate
from trajgrad.losses import reinforce_loss, vespo_loss
from trajgrad.objective import get_recipe

F64 = torch.float64


def _batch(seed=0, B=5, L=9, noise=0.1):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=F64) * 3
    old = logp + noise * torch.randn(B, L, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    mask = torch.rand(B, L, generator=g) > 0.25
    mask[:, 0] = True
    return logp, old, adv, mask


def _phi(log_w, k, lam):
    w = math.exp(log_w)
    return math.exp(lam) * w ** k * math.exp(-lam * w)


def test_value_and_gradient_against_the_formula():
    logp, old, adv, mask = _batch()
    lp = logp.clone().requires_grad_(True)
    got = vespo_loss(lp, old, adv, mask).loss
    (g_got,) = torch.autograd.grad(got, lp)
    B, L = logp.shape
    phi = torch.zeros(B, dtype=F64)
    for i in range(B):
        z = sum(float(logp[i, t] - old[i, t]) for t in range(L) if mask[i, t])
        z = min(max(z, math.log(1e-8)), 20.0)
        k, lam = (2.0, 3.0) if adv[i] >= 0 else (3.0, 2.0)
        phi[i] = _phi(z, k, lam)
    lp2 = logp.clone().requires_grad_(True)
    want = aggregate(torch.where(mask, -(phi * adv)[:, None] * lp2, 0.0), mask, "token_mean")
    (g_want,) = torch.autograd.grad(want, lp2)
    assert torch.allclose(got, want, atol=1e-12) and torch.allclose(g_got, g_want, atol=1e-12)
    assert (phi != 1).all()  # the weight is exercised


def test_on_policy_it_is_reinforce_and_the_mode_is_k_over_lambda():
    logp, _, adv, mask = _batch(1)
    a = vespo_loss(logp, logp, adv, mask).loss
    b = reinforce_loss(logp, adv, mask).loss
    assert torch.allclose(a, b, atol=1e-12)
    # one token per row: w = exp(z); φ peaks at w = k/λ (2/3 for A ≥ 0)
    lp = torch.zeros(3, 1, dtype=F64)
    ws = torch.tensor([0.5, 2 / 3, 0.9], dtype=F64)
    res = vespo_loss(lp, -torch.log(ws)[:, None], torch.ones(3, dtype=F64), torch.ones(3, 1, dtype=torch.bool))
    phis = [_phi(math.log(w), 2.0, 3.0) for w in ws.tolist()]
    assert phis[1] > phis[0] and phis[1] > phis[2]
    assert math.isclose(float(res.metrics["vespo/weight_mean"]), sum(phis) / 3, rel_tol=1e-12)


def test_huge_log_ratios_stay_finite_and_the_old_logp_is_detached():
    logp, old, adv, mask = _batch(2, L=4096, noise=2.0)
    lp = logp.clone().requires_grad_(True)
    o = old.clone().requires_grad_(True)
    loss = vespo_loss(lp, o, adv, mask).loss
    g_lp, g_o = torch.autograd.grad(loss, (lp, o), allow_unused=True)
    assert torch.isfinite(loss) and torch.isfinite(g_lp).all()
    assert g_o is None or (g_o == 0).all()


def test_nan_and_inf_at_masked_positions_change_nothing():
    logp, old, adv, mask = _batch(3)
    lp = logp.clone().requires_grad_(True)
    ref = vespo_loss(lp, old, adv, mask).loss
    (g_ref,) = torch.autograd.grad(ref, lp)
    raw = logp.clone().requires_grad_(True)
    loss = vespo_loss(torch.where(mask, raw, torch.tensor(float("nan"), dtype=F64)),
                      torch.where(mask, old, torch.tensor(float("inf"), dtype=F64)), adv, mask).loss
    (g,) = torch.autograd.grad(loss, raw)
    assert torch.equal(loss.detach(), ref.detach()) and torch.isfinite(g).all() and torch.allclose(g, g_ref, atol=0)


def test_bad_input_names_the_argument():
    logp, old, adv, mask = _batch()
    for name, bad in (("k_pos", -1.0), ("k_neg", float("nan")), ("lambda_pos", 0.0), ("lambda_neg", float("inf"))):
        with pytest.raises(ValueError, match=name):
            vespo_loss(logp, old, adv, mask, **{name: bad})
    with pytest.raises(ValueError, match="old_logp"):
        vespo_loss(logp, old[:, :3], adv, mask)


def test_the_recipe_calls_it():
    logp, old, adv, mask = _batch(4)
    got = get_recipe("vespo").policy_loss(logp, adv, mask, old_logp=old).loss
    assert torch.equal(got, vespo_loss(logp, old, adv, mask).loss)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 4.0), st.floats(0.1, 4.0))
def test_weight_peaks_at_k_over_lambda_and_is_one_on_policy(seed, k, lam):
    """One token per row, A > 0: φ(w) ≤ φ(k/λ) for every w, and φ(1) = 1."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(6, 1, generator=g, dtype=F64)
    lp = torch.zeros(6, 1, dtype=F64)
    adv = torch.ones(6, dtype=F64)
    m = torch.ones(6, 1, dtype=torch.bool)
    phi = lambda old: float(vespo_loss(lp, old, adv, m, k_pos=k, lambda_pos=lam).metrics["vespo/weight_mean"])  # noqa: E731
    peak = phi(-torch.full((6, 1), math.log(max(k / lam, 1e-8)), dtype=F64))
    assert phi(-z) <= peak * (1 + 1e-9) + 1e-300
    assert math.isclose(phi(torch.zeros(6, 1, dtype=F64)), 1.0, rel_tol=1e-12)
