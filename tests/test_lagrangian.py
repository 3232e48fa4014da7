"""§22's Lagrangian policy loss -(J_R - sg[lambda](J_C - d)) against the spec's two lines written out."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.losses import LagrangeMultiplier, lagrangian_loss, reinforce_loss

D64 = torch.float64


def test_value_and_gradient_match_the_spec_with_reinforce_surrogates():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=g, dtype=D64)
    a_r, a_c = torch.randn(3, 4, generator=g, dtype=D64), torch.rand(3, 4, generator=g, dtype=D64)
    mask = torch.rand(3, 4, generator=g) > 0.3
    mask[0, 0] = True
    lam = LagrangeMultiplier(init=0.7, lr=0.1, budget=0.05)
    lp = logp.clone().requires_grad_(True)
    jr = -reinforce_loss(lp, a_r, mask.to(D64)).loss
    jc = -reinforce_loss(lp, a_c, mask.to(D64)).loss
    res = lagrangian_loss(jr, jc, lam)
    got, = torch.autograd.grad(res.loss, lp)
    # the spec: policy_loss = -(reward_surrogate - lambda_cost * cost_surrogate) (+ lambda d, a constant)
    lp2 = logp.clone().requires_grad_(True)
    n = int(mask.sum())
    reward_s = sum(float(a_r[i, t]) * lp2[i, t] for i in range(3) for t in range(4) if mask[i, t]) / n
    cost_s = sum(float(a_c[i, t]) * lp2[i, t] for i in range(3) for t in range(4) if mask[i, t]) / n
    want = -(reward_s - 0.7 * (cost_s - 0.05))
    wg, = torch.autograd.grad(want, lp2)
    assert res.loss.item() == pytest.approx(want.item(), rel=1e-12) and torch.allclose(got, wg, atol=1e-14)
    # the same advantage form the multiplier already offers: A_R - lambda A_C
    lp3 = logp.clone().requires_grad_(True)
    g3, = torch.autograd.grad(reinforce_loss(lp3, lam.penalized_advantages(a_r, a_c), mask.to(D64)).loss, lp3)
    assert torch.allclose(got, g3, atol=1e-14)
    assert res.metrics["lagrangian/violation"].item() == pytest.approx(cost_s.item() - 0.05)


def test_docstring_worked_example_and_lambda_is_detached():
    jr = torch.tensor(0.5, dtype=D64, requires_grad=True)
    jc = torch.tensor(0.3, dtype=D64, requires_grad=True)
    lam = torch.tensor(2.0, dtype=D64, requires_grad=True)
    res = lagrangian_loss(jr, jc, lam, budget=0.1)
    assert res.loss.item() == pytest.approx(-0.1, abs=1e-15)
    g = torch.autograd.grad(res.loss, [jr, jc, lam], allow_unused=True)
    assert g[0].item() == -1.0 and g[1].item() == 2.0 and g[2] is None
    assert res.metrics["lagrangian/lambda"].item() == 2.0


@settings(max_examples=30, deadline=None)
@given(lam=st.floats(0, 10), d=st.floats(-5, 5), jr=st.floats(-5, 5), jc=st.floats(-5, 5))
def test_budget_shifts_the_value_not_the_gradient(lam, d, jr, jc):
    a = torch.tensor([jr, jc], dtype=D64, requires_grad=True)
    r0 = lagrangian_loss(a[0], a[1], lam, budget=0.0)
    r1 = lagrangian_loss(a[0], a[1], lam, budget=d)
    g0 = torch.autograd.grad(r0.loss, a)[0]
    g1 = torch.autograd.grad(r1.loss, a)[0]
    assert torch.equal(g0, g1) and r1.loss.item() == pytest.approx(r0.loss.item() - lam * d, abs=1e-9)


@pytest.mark.parametrize("args,kw,name", [
    ((torch.zeros(2), torch.tensor(0.0), 1.0), {"budget": 0.0}, "reward_surrogate"),
    ((torch.tensor(0.0), torch.tensor(math.nan), 1.0), {"budget": 0.0}, "cost_surrogate"),
    ((torch.tensor(0.0), torch.tensor(0.0), -1.0), {"budget": 0.0}, "multiplier"),
    ((torch.tensor(0.0), torch.tensor(0.0), math.inf), {"budget": 0.0}, "multiplier"),
    ((torch.tensor(0.0), torch.tensor(0.0), 1.0), {}, "budget"),
    ((torch.tensor(0.0), torch.tensor(0.0), LagrangeMultiplier(budget=0.1)), {"budget": 0.2}, "budget"),
])
def test_bad_arguments_name_themselves(args, kw, name):
    with pytest.raises(ValueError, match=name):
        lagrangian_loss(*args, **kw)
