"""Tests for trajgrad.losses.cispo (MiniMax-M1's CISPO)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.losses import cispo_loss, ppo_clip_loss

D64 = torch.float64


def t(x):
    return torch.as_tensor(x, dtype=D64).clone()


def batch(seed=0, B=4, L=7, noise=0.4):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=D64) * 3
    old = logp + noise * torch.randn(B, L, generator=g, dtype=D64)
    adv = torch.randn(B, L, generator=g, dtype=D64)
    mask = (torch.rand(B, L, generator=g) > 0.3).to(D64)
    mask[0] = 1
    return logp, old, adv, mask


def run(logp, old, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    res = cispo_loss(lp, old, adv, mask, **kw)
    res.loss.backward()
    return res, lp.grad


@pytest.mark.parametrize("eps_low", [None, 0.2])
def test_value_and_gradient_match_the_analytic_form(eps_low):
    logp, old, adv, mask = batch()
    res, grad = run(logp, old, adv, mask, eps_low=eps_low, eps_high=0.28)
    r = torch.exp(logp - old)
    lo = 0.0 if eps_low is None else 1 - eps_low
    r_hat = r.clamp(min=lo, max=1.28)
    n = mask.sum()
    # value: -(1/N) sum sg(r_hat) A logp ; gradient: -(1/N) r_hat A
    assert res.loss.item() == pytest.approx(-(r_hat * adv * logp * mask).sum().item() / n.item(), rel=1e-12)
    assert torch.allclose(grad, -r_hat * adv * mask / n, atol=1e-14)
    assert res.metrics["weight/clipped_high"].item() == pytest.approx(((r > 1.28) & (mask > 0)).sum().item() / n.item())


def test_no_token_loses_its_gradient_unlike_ppo():
    # ratio 2 with A > 0: PPO saturates (gradient 0); CISPO keeps weight 1 + eps_high
    logp, old, adv, mask = t([[math.log(2.0) - 1.0]]), t([[-1.0]]), t([[1.0]]), torch.ones(1, 1)
    _, g = run(logp, old, adv, mask, eps_high=0.28)
    assert g.item() == pytest.approx(-1.28)
    lp = logp.clone().requires_grad_(True)
    ppo_clip_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28).loss.backward()
    assert lp.grad.item() == 0.0


def test_on_policy_equals_reinforce():
    logp, _, adv, mask = batch(1)
    res, grad = run(logp, logp.clone(), adv, mask)
    n = mask.sum()
    assert torch.allclose(grad, -adv * mask / n, atol=1e-14)
    assert res.metrics["weight/mean"].item() == pytest.approx(1.0)


@settings(max_examples=25, deadline=None)
@given(v=st.sampled_from([math.nan, math.inf, -math.inf, 1e30]), which=st.sampled_from(["logp", "old", "adv"]))
def test_nonfinite_at_masked_positions_is_inert(v, which):
    logp, old, adv, mask = batch(2)
    mask[1, 2] = 0
    res0, g0 = run(logp, old, adv, mask)
    x = {"logp": logp.clone(), "old": old.clone(), "adv": adv.clone()}
    x[which][1, 2] = v
    res, g = run(x["logp"], x["old"], x["adv"], mask)
    assert torch.isfinite(res.loss) and torch.isfinite(g).all()
    assert res.loss.item() == pytest.approx(res0.loss.item(), rel=1e-12)
    assert torch.allclose(g, g0, atol=0)


@pytest.mark.parametrize(
    "kw,name",
    [
        ({"eps_high": 0.0}, "eps_high"),
        ({"eps_low": 1.5}, "eps_low"),
        ({"aggregation": "mean"}, "aggregation"),
        ({"denominator": float("inf")}, "denominator"),
        ({"weights": torch.ones(2, 2)}, "weights"),
    ],
)
def test_bad_arguments_name_themselves(kw, name):
    logp, old, adv, mask = batch()
    with pytest.raises(ValueError, match=name):
        cispo_loss(logp, old, adv, mask, **kw)


def test_bad_tensors_name_themselves():
    logp, old, adv, mask = batch()
    bad = old.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="old_logp"):
        cispo_loss(logp, bad, adv, mask)
    with pytest.raises(ValueError, match="mask"):
        cispo_loss(logp, old, adv, mask * 2)
    with pytest.raises(ValueError, match="advantages"):
        cispo_loss(logp, old, adv[:, :3], mask)


def test_weights_scale_the_numerator_only():
    logp, old, adv, mask = batch(3)
    w = torch.rand(logp.shape, dtype=D64)
    res_w, g_w = run(logp, old, adv, mask, weights=w)
    r_hat = torch.exp(logp - old).clamp(max=1.28)
    n = mask.sum()
    assert torch.allclose(g_w, -w * r_hat * adv * mask / n, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("bound", [math.log(1.28), math.log1p(3e-4), math.log(0.8), -1e-30, 1e-42, 2.0 ** -3])
def test_count_positive_equals_strict_comparison(dtype, bound):
    from trajgrad.losses.cispo import _count_positive

    g = torch.Generator().manual_seed(5)
    b = torch.tensor(bound, dtype=dtype)
    up, down = torch.nextafter(b, torch.tensor(math.inf, dtype=dtype)), torch.nextafter(b, torch.tensor(-math.inf, dtype=dtype))
    z = torch.cat([torch.randn(3000, generator=g).to(dtype) * abs(bound) * 3, torch.stack([b, up, down] * 50),
                   torch.zeros(7, dtype=dtype), torch.tensor([1e30, -1e30], dtype=dtype).clamp(-1e4, 1e4)])
    for diff, want in ((z - bound, (z > b).sum()), (bound - z, (z < b).sum())):
        got = _count_positive(diff.clone(), bound)
        assert got.item() == want.item()


def _reference_metrics(logp, old, adv, mask, eps_low, eps_high):
    valid = mask > 0
    z = (logp - old).to(D64)[valid]
    n = z.numel()
    hi = math.log1p(eps_high)
    lo = -math.inf if eps_low is None else math.log1p(-eps_low)
    r_hat = torch.exp(z.clamp(min=lo, max=hi))
    return {
        "tokens": float(n), "ratio/mean": torch.exp(z).mean().item(), "ratio/min": torch.exp(z.min()).item(),
        "ratio/max": torch.exp(z.max()).item(), "kl/k1": (-z).mean().item(), "kl/k3": (torch.expm1(z) - z).mean().item(),
        "weight/clipped_high": (z > hi).sum().item() / n, "weight/clipped_low": (z < lo).sum().item() / n,
        "weight/mean": r_hat.mean().item(),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eps_low", [None, 0.2])
@pytest.mark.parametrize("quantiles", [False, True])
@pytest.mark.parametrize("shift", [0.0, 0.05])
def test_large_batch_metrics_equal_their_definitions(dtype, eps_low, quantiles, shift):
    # B * L above the interpreter-summarized size: the tensor path, which reuses the check's buffer for
    # the counts; shift > 0 puts every valid log ratio above 0 (the masked-extremum case)
    from trajgrad import diagnostics

    g = torch.Generator().manual_seed(5)
    B, L = 8, 96
    logp = -torch.rand(B, L, generator=g, dtype=D64) * 3
    noise = 0.3 * torch.randn(B, L, generator=g, dtype=D64)
    old = logp - (noise.abs() + shift if shift else noise)
    adv = torch.randn(B, L, generator=g, dtype=D64)
    mask = (torch.rand(B, L, generator=g) > 0.3).to(D64)
    logp, old, adv, mask = (v.to(dtype) for v in (logp, old, adv, mask))
    with diagnostics.loss_quantiles(quantiles):
        res, grad = run(logp, old, adv, mask, eps_low=eps_low, eps_high=0.28)
    ref = _reference_metrics(logp, old, adv, mask, eps_low, 0.28)
    tol = 1e-5 if dtype == torch.float32 else 1e-11
    for k, v in ref.items():
        assert res.metrics[k].dtype == dtype
        assert res.metrics[k].item() == pytest.approx(v, rel=tol, abs=tol), k
    assert ("log_ratio/q50" in res.metrics) == quantiles
    if quantiles:
        pm = diagnostics.policy_metrics(logp - old, adv, mask)
        assert res.metrics["log_ratio/q50"].item() == pytest.approx(pm["log_ratio/q50"].item(), rel=tol)
    lo = 0.0 if eps_low is None else 1 - eps_low
    r_hat = torch.exp((logp - old).to(D64)).clamp(min=lo, max=1.28)
    expected = -(r_hat * adv.to(D64) * mask.to(D64)) / mask.to(D64).sum()
    assert torch.allclose(grad.to(D64), expected, rtol=tol, atol=tol * 1e-3)
    if shift:
        assert res.metrics["ratio/min"].item() > 1.0
