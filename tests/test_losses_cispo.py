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


# ---------------------------------------------------------------------- the unified PPO mask (MiniMax-M1 §3.1)
def _hand_unified(logp, old, adv, mask, *, eps_high, eps_low=None, d_low=None, d_high=None, denominator=None):
    """The paper's J_unify written token by token: −(1/Σ|o_i|) Σ sg[r̂] A log π_θ M, M by strict comparisons."""
    B, L = logp.shape
    adv = adv if adv.ndim == 2 else adv[:, None].expand(B, L)
    total, n = 0.0, 0
    for b in range(B):
        for t_ in range(L):
            if not mask[b, t_]:
                continue
            n += 1
            r = math.exp(float(logp[b, t_].detach() - old[b, t_]))
            r_hat = min(max(r, 0.0 if eps_low is None else 1 - eps_low), 1 + eps_high)
            a = float(adv[b, t_])
            m = 0.0 if ((d_high is not None and a > 0 and r > 1 + d_high)
                        or (d_low is not None and a < 0 and r < 1 - d_low)) else 1.0
            total = total + r_hat * a * logp[b, t_] * m  # r_hat, a, m are numbers: stop-gradient
    return -total / (n if denominator is None else denominator)


@pytest.mark.parametrize("d_low,d_high,eps_low", [(0.2, 0.2, None), (0.1, 0.3, 0.5), (None, 0.15, None),
                                                  (0.25, None, None), (1.0, 0.2, None)])
@pytest.mark.parametrize("seed", [0, 3])
def test_unified_mask_matches_the_papers_equation_in_value_and_gradient(d_low, d_high, eps_low, seed):
    logp, old, adv, mask = batch(seed, noise=0.5)
    res, grad = run(logp, old, adv, mask, eps_low=eps_low, eps_high=0.28, mask_eps_low=d_low, mask_eps_high=d_high)
    lp = logp.clone().requires_grad_(True)
    ref = _hand_unified(lp, old, adv, mask, eps_high=0.28, eps_low=eps_low, d_low=d_low, d_high=d_high)
    ref.backward()
    assert res.loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(grad, lp.grad, rtol=1e-12, atol=1e-15)
    r, valid = torch.exp(logp - old), mask > 0
    n = valid.sum().item()
    hi = ((adv > 0) & (r > 1 + d_high) & valid).sum().item() if d_high is not None else 0
    lo = ((adv < 0) & (r < 1 - d_low) & valid).sum().item() if d_low is not None else 0
    assert res.metrics["mask/dropped_high"].item() == pytest.approx(hi / n)
    assert res.metrics["mask/dropped_low"].item() == pytest.approx(lo / n)
    if d_high == 0.2 and d_low == 0.2:
        assert hi > 0 and lo > 0  # both sides exercised


def test_unified_mask_with_sequence_advantages_and_a_global_denominator():
    logp, old, _, mask = batch(5, noise=0.5)
    adv = t([1.0, -0.5, 0.7, -2.0])
    res, grad = run(logp, old, adv, mask, mask_eps_low=0.2, mask_eps_high=0.2, denominator=40.0)
    lp = logp.clone().requires_grad_(True)
    ref = _hand_unified(lp, old, adv, mask, eps_high=0.28, d_low=0.2, d_high=0.2, denominator=40.0)
    ref.backward()
    assert res.loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(grad, lp.grad, rtol=1e-12, atol=1e-15)


def test_unified_mask_worked_example_of_the_docstring():
    r = t([[1.5, 1.1, 0.5, 0.9]])
    logp = t([[-1.0, -1.0, -1.0, -1.0]])
    old, adv, mask = logp - torch.log(r), t([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4)
    res, grad = run(logp, old, adv, mask, eps_high=0.28, mask_eps_low=0.2, mask_eps_high=0.2)
    assert res.loss.item() == pytest.approx(0.05, rel=1e-12)
    assert torch.allclose(grad, t([[0.0, -0.275, 0.0, 0.225]]), atol=1e-14)
    res, grad = run(logp, old, adv, mask, eps_high=0.28)
    assert res.loss.item() == pytest.approx(0.245, rel=1e-12)
    assert torch.allclose(grad, t([[-0.32, -0.275, 0.125, 0.225]]), atol=1e-14)


def test_unified_mask_is_strict_and_keeps_the_token_in_the_denominator():
    # a ratio exactly on a bound keeps its token (strict inequalities, compared in log space)
    z_hi, z_lo = math.log1p(0.2), math.log1p(-0.2)
    logp = t([[z_hi, z_lo, -1.0]])  # old log-probs 0: the log-ratio is exactly the bound
    old, adv, mask = t([[0.0, 0.0, -1.0]]), t([[1.0, -1.0, 1.0]]), torch.ones(1, 3)
    _, g = run(logp, old, adv, mask, mask_eps_low=0.2, mask_eps_high=0.2)
    assert (g[0, :2] != 0).all()
    # just past the bounds: dropped, and the remaining token's gradient is still divided by 3
    logp2 = t([[z_hi + 1e-9, z_lo - 1e-9, -1.0]])
    _, g2 = run(logp2, old, adv, mask, mask_eps_low=0.2, mask_eps_high=0.2)
    assert g2[0, 0].item() == 0.0 and g2[0, 1].item() == 0.0
    assert g2[0, 2].item() == pytest.approx(-1.0 / 3, rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(v=st.sampled_from([math.nan, math.inf, -math.inf, 1e30]), which=st.sampled_from(["logp", "old", "adv"]))
def test_unified_mask_nonfinite_at_masked_positions_is_inert(v, which):
    logp, old, adv, mask = batch(2, noise=0.5)
    mask[1, 2] = 0
    kw = dict(mask_eps_low=0.2, mask_eps_high=0.2)
    res0, g0 = run(logp, old, adv, mask, **kw)
    x = {"logp": logp.clone(), "old": old.clone(), "adv": adv.clone()}
    x[which][1, 2] = v
    res, g = run(x["logp"], x["old"], x["adv"], mask, **kw)
    assert torch.isfinite(res.loss) and torch.isfinite(g).all()
    assert res.loss.item() == pytest.approx(res0.loss.item(), rel=1e-12)
    assert torch.equal(g, g0)


@pytest.mark.parametrize("kw,name", [(dict(mask_eps_low=0.0), "mask_eps_low"), (dict(mask_eps_low=1.5), "mask_eps_low"),
                                     (dict(mask_eps_high=-0.1), "mask_eps_high"),
                                     (dict(mask_eps_high=math.inf), "mask_eps_high")])
def test_unified_mask_bad_bounds_name_the_argument(kw, name):
    logp, old, adv, mask = batch()
    with pytest.raises(ValueError, match=f"^{name}:"):
        cispo_loss(logp, old, adv, mask, **kw)


def test_unified_mask_in_the_recipe_explain_verify():
    from trajgrad.objective import explain, explain_diff, get_recipe
    from trajgrad.verify import verify

    o = get_recipe("cispo", mask_eps_low=0.2, mask_eps_high=0.25)
    assert get_recipe("cispo").mask_eps_low is None and get_recipe("cispo").mask_eps_high is None
    text = explain(o)
    assert "M_it = 0 if (A_it > 0 and r_it > 1.25) or (A_it < 0 and r_it < 0.8), else 1" in text
    assert "stays in the denominator" in text and "the mask" in text
    assert "M_it" not in explain("cispo")
    diff = explain_diff("cispo", o)
    assert "mask_eps_low" in diff and "mask_eps_high" in diff and "None  →  0.2" in diff
    with pytest.raises(ValueError, match="^mask_eps_low:"):
        get_recipe("cispo", mask_eps_low=2.0)
    with pytest.raises(ValueError, match="^mask_eps_high:"):
        get_recipe("cispo", mask_eps_high=0.0)
    with pytest.raises(ValueError, match="^mask_eps_high: has no effect"):
        get_recipe("grpo", mask_eps_high=0.2)
    # the recipe's loss is the paper's equation, and verify tells it from plain CISPO
    logp, old, adv, mask = batch(4, noise=0.5)
    lp = logp.clone().requires_grad_(True)
    o.policy_loss(lp, adv, mask, old_logp=old).loss.backward()
    lp2 = logp.clone().requires_grad_(True)
    _hand_unified(lp2, old, adv, mask, eps_high=0.28, d_low=0.2, d_high=0.25).backward()
    assert torch.allclose(lp.grad, lp2.grad, rtol=1e-12, atol=1e-15)

    def paper(logp, old_logp, advantages, mask, denominator=None):
        return cispo_loss(logp, old_logp, advantages, mask, eps_high=0.28, mask_eps_low=0.2, mask_eps_high=0.25,
                          denominator=denominator)

    def unmasked(logp, old_logp, advantages, mask, denominator=None):
        return cispo_loss(logp, old_logp, advantages, mask, eps_high=0.28, denominator=denominator)

    assert verify(paper, o).passed
    rep = verify(unmasked, o)
    assert not rep.passed and not {c.name: c for c in rep.checks}["gradient"].passed
