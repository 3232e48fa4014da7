"""Tests for trajgrad.control.lagrange (spec §22)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.losses import LagrangeMultiplier, reinforce_loss

D64 = torch.float64


def test_update_hand_values():
    lam = LagrangeMultiplier(init=0.0, lr=0.1, budget=0.5)
    assert lam.value == 0.0
    assert lam.update(1.0) == pytest.approx(0.05)  # 0 + 0.1 * (1.0 - 0.5)
    assert lam.update(2.5) == pytest.approx(0.25)  # 0.05 + 0.1 * 2.0
    assert lam.update(0.0) == pytest.approx(0.20)  # under budget: decreases
    assert lam.update(-10.0) == 0.0  # would go to -0.85: clamped at 0
    assert lam.update(0.0) == 0.0  # stays at 0 while under budget
    assert lam.value == 0.0 and float(lam) == 0.0


def test_update_accepts_tensors():
    lam = LagrangeMultiplier(init=1.0, lr=0.5, budget=0.0)
    assert lam.update(torch.tensor(2.0)) == pytest.approx(2.0)
    assert lam.update(torch.tensor([0.5], dtype=D64)) == pytest.approx(2.25)


@settings(max_examples=40, deadline=None)
@given(init=st.floats(0, 10), lr=st.floats(1e-4, 1), budget=st.floats(-5, 5), costs=st.lists(st.floats(-10, 10),
                                                                                              max_size=10))
def test_multiplier_stays_non_negative_and_moves_with_the_violation(init, lr, budget, costs):
    lam = LagrangeMultiplier(init=init, lr=lr, budget=budget)
    for c in costs:
        before = lam.value
        after = lam.update(c)
        assert after >= 0.0
        if c > budget:
            assert after >= before
        elif c < budget:
            assert after <= before
        assert after == pytest.approx(max(0.0, before + lr * (c - budget)))


def test_penalized_advantages_and_section_22_equivalence():
    lam = LagrangeMultiplier(init=0.4)
    ra = torch.tensor([[1.0, -0.5], [0.2, 0.0]], dtype=D64)
    ca = torch.tensor([[0.5, 0.5], [-1.0, 2.0]], dtype=D64)
    adv = lam.penalized_advantages(ra, ca)
    assert torch.allclose(adv, ra - 0.4 * ca)
    # §22: -(reward_surrogate - lambda * cost_surrogate) has the same gradient
    logp = -torch.rand(2, 2, generator=torch.Generator().manual_seed(0), dtype=D64)
    mask = torch.tensor([[1, 1], [1, 0]])
    lp1 = logp.clone().requires_grad_(True)
    reinforce_loss(lp1, adv, mask).loss.backward()
    lp2 = logp.clone().requires_grad_(True)
    reward_obj = -reinforce_loss(lp2, ra, mask).loss
    cost_obj = -reinforce_loss(lp2, ca, mask).loss
    (-(reward_obj - lam.value * cost_obj)).backward()
    assert torch.allclose(lp1.grad, lp2.grad, atol=1e-15)


def test_lambda_is_a_constant_in_the_policy_loss():
    lam = LagrangeMultiplier(init=2.0)
    ra = torch.tensor([1.0], requires_grad=True)
    ca = torch.tensor([1.0], requires_grad=True)
    out = lam.penalized_advantages(ra, ca)
    out.sum().backward()
    assert ra.grad.item() == 1.0 and ca.grad.item() == -2.0  # d/d ca = -lambda; lambda has no gradient
    assert isinstance(lam.value, float)


def test_state_dict_round_trip():
    lam = LagrangeMultiplier(init=0.3, lr=0.2, budget=1.5)
    lam.update(3.0)
    state = lam.state_dict()
    other = LagrangeMultiplier()
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert other.update(0.0) == lam.update(0.0)
    assert "LagrangeMultiplier" in repr(lam)


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: LagrangeMultiplier(init=-0.1), "init"),
        (lambda: LagrangeMultiplier(init=math.nan), "init"),
        (lambda: LagrangeMultiplier(lr=0.0), "lr"),
        (lambda: LagrangeMultiplier(lr=-1.0), "lr"),
        (lambda: LagrangeMultiplier(budget=math.inf), "budget"),
        (lambda: LagrangeMultiplier().update(math.nan), "mean_cost"),
        (lambda: LagrangeMultiplier().update(torch.tensor([1.0, 2.0])), "mean_cost"),
        (lambda: LagrangeMultiplier().update("high"), "mean_cost"),
        (lambda: LagrangeMultiplier().penalized_advantages(torch.ones(2), torch.ones(3)), "cost_adv"),
        (lambda: LagrangeMultiplier().penalized_advantages(torch.ones(2, dtype=torch.long), torch.ones(2)),
         "reward_adv"),
        (lambda: LagrangeMultiplier().load_state_dict({"value": 1.0}), "state"),
        (lambda: LagrangeMultiplier().load_state_dict({"value": -1.0, "lr": 0.1, "budget": 0.0}), "value"),
        (lambda: LagrangeMultiplier().load_state_dict([1, 2]), "state"),
    ],
)
def test_bad_inputs(call, name):
    with pytest.raises(ValueError, match=name):
        call()
