"""DRO's policy term: value and gradient against the hand-written form; masked NaN; bad input."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from trajgrad.aggregate import aggregate
from trajgrad.losses import dro_loss
from trajgrad.objective import get_recipe

F64 = torch.float64


def _batch(seed=0, B=4, L=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=F64) * 3
    old = logp + 0.4 * torch.randn(B, L, generator=g, dtype=F64)
    adv = torch.randn(B, L, generator=g, dtype=F64)
    mask = torch.rand(B, L, generator=g) > 0.3
    mask[:, 0] = True
    return logp, old, adv, mask


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_value_and_gradient_against_the_formula(aggregation):
    logp, old, adv, mask = _batch()
    beta = 0.3
    lp = logp.clone().requires_grad_(True)
    got = dro_loss(lp, old, adv, mask, beta=beta, aggregation=aggregation).loss
    (g_got,) = torch.autograd.grad(got, lp)
    lp2 = logp.clone().requires_grad_(True)
    m = mask.to(F64)
    per_token = -adv * lp2 + 0.5 * beta * (lp2 - old) ** 2
    want = aggregate(torch.where(mask, per_token, 0.0), mask, aggregation)
    (g_want,) = torch.autograd.grad(want, lp2)
    assert torch.allclose(got, want, atol=1e-12) and torch.allclose(g_got, g_want, atol=1e-12)
    # the analytic gradient for token_mean: (β z − A) / N at valid tokens
    if aggregation == "token_mean":
        analytic = torch.where(mask, (beta * (logp - old) - adv) / m.sum(), 0.0)
        assert torch.allclose(g_got, analytic, atol=1e-12)


def test_zero_log_ratio_is_reinforce_and_old_is_detached():
    logp, _, adv, mask = _batch(1)
    lp = logp.clone().requires_grad_(True)
    old = logp.clone().requires_grad_(True)
    loss = dro_loss(lp, old, adv, mask, beta=5.0).loss
    g_lp, g_old = torch.autograd.grad(loss, (lp, old), allow_unused=True)
    assert g_old is None or (g_old == 0).all()
    assert torch.allclose(g_lp, torch.where(mask, -adv / mask.sum(), 0.0), atol=1e-12)


def test_nan_and_inf_at_masked_positions_change_nothing():
    logp, old, adv, mask = _batch(2)
    lp = logp.clone().requires_grad_(True)
    ref = dro_loss(lp, old, adv, mask, beta=0.2).loss
    (g_ref,) = torch.autograd.grad(ref, lp)
    bad = torch.tensor(float("nan"), dtype=F64)
    lp_raw = logp.clone().requires_grad_(True)
    lp_bad = torch.where(mask, lp_raw, bad)
    old_bad = torch.where(mask, old, torch.tensor(float("inf"), dtype=F64))
    adv_bad = torch.where(mask, adv, torch.tensor(-float("inf"), dtype=F64))
    loss = dro_loss(lp_bad, old_bad, adv_bad, mask, beta=0.2).loss
    (g,) = torch.autograd.grad(loss, lp_raw)
    assert torch.isfinite(loss) and torch.equal(loss.detach(), ref.detach())
    assert torch.isfinite(g).all() and torch.allclose(g, g_ref, atol=0)


def test_bad_input_names_the_argument():
    logp, old, adv, mask = _batch()
    for beta in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="beta"):
            dro_loss(logp, old, adv, mask, beta=beta)
    with pytest.raises(ValueError, match="old_logp"):
        dro_loss(logp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="mask"):
        dro_loss(logp, old, adv, mask[:, :-1])


def test_the_recipe_calls_it():
    logp, old, adv, mask = _batch(3)
    o = get_recipe("dro", beta=0.7)
    got = o.policy_loss(logp, adv, mask, old_logp=old).loss
    assert torch.equal(got, dro_loss(logp, old, adv, mask, beta=0.7).loss)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.floats(1e-3, 10.0))
def test_gradient_is_beta_z_minus_a_over_n(seed, beta):
    logp, old, adv, mask = _batch(seed)
    lp = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(dro_loss(lp, old, adv, mask, beta=beta).loss, lp)
    want = torch.where(mask, (beta * (logp - old) - adv) / mask.sum(), 0.0)
    assert torch.allclose(g, want, atol=1e-12, rtol=1e-10)
