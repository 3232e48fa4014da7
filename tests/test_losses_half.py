"""16-bit log-probs: every loss computes its ratios in float32 (losses/_common.prepare), so
a log-ratio near 12 (e^12 > float16's 65504) gives a finite loss and gradient, equal to
the float32 computation."""
from __future__ import annotations

import pytest
import torch

from trajgrad.losses.cispo import cispo_loss
from trajgrad.losses.gspo import gspo_loss, gspo_token_loss
from trajgrad.losses.kl import kl_estimate
from trajgrad.losses.ppo import ppo_clip_loss
from trajgrad.losses.sapo import sapo_loss
from trajgrad.logprobs.ratios import gspo_sequence_ratio, gspo_token_ratio

LOSSES = {
    "ppo": lambda lp, old, adv, m: ppo_clip_loss(lp, old, adv, m),
    "ppo_dual": lambda lp, old, adv, m: ppo_clip_loss(lp, old, adv, m, dual_clip=1e6),
    "gspo": lambda lp, old, adv, m: gspo_loss(lp, old, adv, m),
    "gspo_token": lambda lp, old, adv, m: gspo_token_loss(lp, old, adv[:, None].expand_as(lp).contiguous(), m),
    "sapo": lambda lp, old, adv, m: sapo_loss(lp, old, adv, m),
    "cispo": lambda lp, old, adv, m: cispo_loss(lp, old, adv, m),
}


def _inputs(dtype):
    # log-ratio 12 on every valid token (e^12 = 162755 overflows float16); A < 0 so PPO's
    # surrogate is rho * A, unclipped above
    old = torch.full((2, 8), -14.0)
    logp = old + 12.0
    mask = torch.ones(2, 8)
    mask[1, 5:] = 0
    adv = torch.tensor([-0.01, -0.02])
    return logp.to(dtype).requires_grad_(True), old.to(dtype), adv.to(dtype), mask


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_give_the_float32_loss_and_gradient(name, dtype):
    fn = LOSSES[name]
    lp16, old16, adv16, mask = _inputs(dtype)
    res16 = fn(lp16, old16, adv16, mask)
    res16.loss.backward()
    # the float32 computation on the very same (rounded) values
    lp32 = lp16.detach().float().requires_grad_(True)
    res32 = fn(lp32, old16.float(), adv16.float(), mask)
    res32.loss.backward()
    assert res16.loss.dtype == torch.float32  # documented: 16-bit inputs compute in float32
    assert torch.isfinite(res16.loss) and torch.isfinite(lp16.grad).all()
    assert torch.allclose(res16.loss, res32.loss, rtol=1e-6, atol=0), (res16.loss, res32.loss)
    assert lp16.grad.dtype == dtype
    assert torch.allclose(lp16.grad.float(), lp32.grad.to(dtype).float(), rtol=0, atol=0)
    for key, value in res16.metrics.items():
        if torch.is_tensor(value) and value.is_floating_point():
            ref = res32.metrics[key]
            assert torch.equal(torch.isfinite(value), torch.isfinite(ref)), key


def test_half_ratios_are_float32_and_finite():
    lp16, old16, _, mask = _inputs(torch.float16)
    s = gspo_sequence_ratio(lp16, old16, mask)
    assert s.dtype == torch.float32 and torch.isfinite(s).all()
    assert torch.allclose(s, torch.exp(torch.tensor(12.0)), rtol=1e-3)
    t = gspo_token_ratio(lp16, old16, mask)
    assert t.dtype == torch.float32 and torch.isfinite(t).all()


@pytest.mark.parametrize("kind", ["k3", "k3+"])
def test_half_kl_estimate_with_the_ratio_is_finite_and_float32(kind):
    lp16, old16, _, mask = _inputs(torch.float16)
    ref = (lp16.detach().float() + 12.0).to(torch.float16)  # z = -12: e^{-z} overflows float16
    est = kl_estimate(lp16, ref, mask, kind=kind, old_logp=old16)
    ref32 = kl_estimate(lp16.detach().float(), ref.float(), mask, kind=kind, old_logp=old16.float())
    assert est.dtype == torch.float32 and torch.isfinite(est).all()
    assert torch.equal(est.detach(), ref32)
