"""Tests for trajgrad.losses.ppo (spec §7, §8, §23)."""
import math

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from trajgrad.aggregate import MODES, aggregate, local_count
from trajgrad.diagnostics import loss_quantiles
from trajgrad.losses import ppo_clip_loss, reinforce_loss

D64 = torch.float64


def t(x):
    return torch.as_tensor(x, dtype=D64).clone()


def run(logp, old, adv, mask, **kw):
    lp = t(logp).requires_grad_(True)
    res = ppo_clip_loss(lp, t(old), t(adv), torch.as_tensor(mask), **kw)
    res.loss.backward()
    return res, lp.grad


# ---------------------------------------------------------------- §23 worked example
OLD = [[-1.00, -0.50], [-0.20, -0.70]]
CUR = [[-0.90, -0.60], [-0.10, -1.00]]
ADV = [[1.0, 1.0], [-0.5, -0.5]]
MASK = [[1, 1], [1, 0]]


def test_section_23_worked_numbers():
    res, grad = run(CUR, OLD, ADV, MASK, eps_low=0.2)
    # (1.10517 + 0.90484 - 0.55259) / 3 = 0.48581, minimized loss -0.48581
    assert res.loss.item() == pytest.approx(-0.48581, abs=1e-5)
    assert res.metrics["ratio/max"].item() == pytest.approx(1.10517, abs=1e-5)
    assert res.metrics["ratio/min"].item() == pytest.approx(0.90484, abs=1e-5)
    assert res.metrics["tokens"].item() == 3
    assert res.metrics["clip_frac"].item() == 0.0
    # No clipping: d loss / d logp_j = -A_j r_j / 3 ; masked token 0.
    e1, em1 = math.exp(0.1), math.exp(-0.1)
    assert torch.allclose(grad, t([[-e1 / 3, -em1 / 3], [0.5 * e1 / 3, 0.0]]), atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    cur=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf])),
    old=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf])),
    adv=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf])),
)
def test_section_23_fourth_token_is_irrelevant(cur, old, adv):
    _, clean_grad = run(CUR, OLD, ADV, MASK)
    c, o, a = t(CUR), t(OLD), t(ADV)
    c[1, 1], o[1, 1], a[1, 1] = cur, old, adv
    res, grad = run(c, o, a, MASK)
    assert res.loss.item() == pytest.approx(-0.48580762569126, abs=1e-13)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad, clean_grad)


# ------------------------------------------------------ §8 sign-specific saturation
def single(ratio, adv, **kw):
    """Loss and d loss / d logp for one valid token with the given ratio (old_logp = -1)."""
    old = -1.0
    return run([[old + math.log(ratio)]], [[old]], [[adv]], [[1]], **kw)


@pytest.mark.parametrize(
    "ratio,adv,active",
    [
        (1.5, 1.0, False),  # A > 0 above 1 + eps_high: saturated
        (1.1, 1.0, True),  # A > 0 inside
        (0.5, 1.0, True),  # A > 0 below 1 - eps_low: still active (decrease stays penalized)
        (0.5, -1.0, False),  # A < 0 below 1 - eps_low: saturated
        (0.9, -1.0, True),  # A < 0 inside
        (1.5, -1.0, True),  # A < 0 above 1 + eps_high: still active (increase stays penalized)
    ],
)
def test_sign_specific_saturation(ratio, adv, active):
    res, g = single(ratio, adv, eps_low=0.2, eps_high=0.2)
    if active:
        # analytic gradient of -(r A) w.r.t. logp: -A r
        assert g.item() == pytest.approx(-adv * ratio, rel=1e-12)
        assert res.loss.item() == pytest.approx(-adv * ratio, rel=1e-12)
    else:
        assert g.item() == 0.0
        bound = 1.2 if adv > 0 else 0.8
        assert res.loss.item() == pytest.approx(-adv * bound, rel=1e-12)


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_boundaries_follow_section_8_convention(adv):
    # §8: A>0 uses rho*A for rho <= 1+eps_h; A<0 uses rho*A for rho >= 1-eps_l (boundary active).
    old = -(2.0**-10)  # chosen so that (old + z) - old == z exactly in float64
    z = math.log1p(0.2) if adv > 0 else math.log1p(-0.2)
    assert (old + z) - old == z
    _, g = run([[old + z]], [[old]], [[adv]], [[1]], eps_low=0.2)
    assert g.item() == pytest.approx(-adv * math.exp(z), rel=1e-12)
    # just beyond the boundary the gradient vanishes
    beyond = z + 1e-9 if adv > 0 else z - 1e-9
    _, g = run([[old + beyond]], [[old]], [[adv]], [[1]], eps_low=0.2)
    assert g.item() == 0.0


def test_asymmetric_clip_higher():
    # ratio 1.25 with A > 0: clipped with eps_high = 0.2, active with DAPO's eps_high = 0.28.
    _, g_sym = single(1.25, 1.0, eps_low=0.2)
    _, g_dapo = single(1.25, 1.0, eps_low=0.2, eps_high=0.28)
    assert g_sym.item() == 0.0
    assert g_dapo.item() == pytest.approx(-1.25, rel=1e-12)
    # the low side is governed by eps_low only
    _, g_low = single(0.79, -1.0, eps_low=0.2, eps_high=0.28)
    assert g_low.item() == 0.0


def test_dual_clip():
    # A < 0: surrogate max(min(rA, clip(r)A), cA); c = 3.
    res, g = single(4.0, -1.0, dual_clip=3.0)
    assert res.loss.item() == pytest.approx(3.0, rel=1e-12)  # -(c A) = 3
    assert g.item() == 0.0
    assert res.metrics["clip_frac/dual"].item() == 1.0
    res, g = single(2.0, -1.0, dual_clip=3.0)  # below c: the ordinary active branch
    assert res.loss.item() == pytest.approx(2.0, rel=1e-12)
    assert g.item() == pytest.approx(2.0, rel=1e-12)
    assert res.metrics["clip_frac/dual"].item() == 0.0
    res, g = single(4.0, 1.0, dual_clip=3.0)  # A > 0 unaffected: ordinary saturation
    assert res.loss.item() == pytest.approx(-1.2, rel=1e-12)
    res, g = single(0.5, -1.0, dual_clip=3.0)  # low side unaffected
    assert res.loss.item() == pytest.approx(0.8, rel=1e-12) and g.item() == 0.0


def textbook(logp, old, adv, mask, eps_low, eps_high, dual=None, mode="token_mean"):
    """The §8 code, written independently: min of unclipped and clipped (plus dual max)."""
    m = mask.bool()
    ratio = torch.exp(torch.where(m, logp - old, torch.zeros_like(logp)))
    a = torch.where(m, adv, torch.zeros_like(adv))
    s = torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)
    if dual is not None:
        s = torch.where(a < 0, torch.maximum(s, dual * a), s)
    return aggregate(-s, m, mode)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from(MODES),
    eps_low=st.floats(0.05, 0.5),
    eps_high=st.floats(0.05, 0.5),
    dual=st.one_of(st.none(), st.floats(1.5, 4.0)),
)
def test_matches_textbook_min_formula(seed, mode, eps_low, eps_high, dual):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 5, generator=g, dtype=D64) * 2
    old = logp.detach() + torch.randn(3, 5, generator=g, dtype=D64) * 0.8
    adv = torch.randn(3, 5, generator=g, dtype=D64)
    mask = torch.rand(3, 5, generator=g) > 0.3
    z = (logp - old)[mask]
    bounds = [math.log1p(-eps_low), math.log1p(eps_high)] + ([math.log(dual)] if dual else [])
    assume(all((z - b).abs().min() > 1e-6 for b in bounds) if z.numel() else True)
    res, grad = run(logp, old, adv, mask.long(), eps_low=eps_low, eps_high=eps_high, dual_clip=dual, aggregation=mode)
    lp = logp.clone().requires_grad_(True)
    ref = textbook(lp, old, adv, mask, eps_low, eps_high, dual, mode)
    ref.backward()
    assert res.loss.item() == pytest.approx(ref.item(), abs=1e-12)
    assert torch.allclose(grad, lp.grad, atol=1e-12)


# --------------------------------------------------------------------------- metrics
def test_clip_fraction_metrics_by_sign_and_side():
    # 6 valid tokens: ratios / advantages chosen one per region, plus one inside.
    ratios = [1.5, 0.5, 1.5, 0.5, 1.0, 1.0]
    advs = [1.0, 1.0, -1.0, -1.0, 1.0, 0.0]
    old = [[-1.0] * 7]
    cur = [[-1.0 + math.log(r) for r in ratios] + [0.0]]
    with loss_quantiles():
        res, _ = run(cur, old, [advs + [5.0]], [[1] * 6 + [0]], eps_low=0.2)
    assert "log_ratio/q50" not in run(cur, old, [advs + [5.0]], [[1] * 6 + [0]], eps_low=0.2)[0].metrics
    m = res.metrics
    assert m["clip_frac/pos_high"].item() == pytest.approx(1 / 6)
    assert m["clip_frac/pos_low"].item() == pytest.approx(1 / 6)
    assert m["clip_frac/neg_high"].item() == pytest.approx(1 / 6)
    assert m["clip_frac/neg_low"].item() == pytest.approx(1 / 6)
    assert m["clip_frac"].item() == pytest.approx(2 / 6)
    assert m["ratio/out_of_range_frac"].item() == pytest.approx(4 / 6)
    assert m["ratio/max"].item() == pytest.approx(1.5)
    assert m["ratio/min"].item() == pytest.approx(0.5)
    assert m["tokens"].item() == 6
    zs = torch.tensor([math.log(r) for r in ratios], dtype=D64)
    assert m["kl/k1"].item() == pytest.approx((-zs).mean().item())
    assert m["kl/k3"].item() == pytest.approx((zs.exp() - 1 - zs).mean().item())
    assert m["log_ratio/q50"].item() == pytest.approx(torch.quantile(zs, 0.5).item())
    assert all(not v.requires_grad for v in m.values())


def test_overflowing_ratio_gives_finite_zero_gradient_where_constant():
    # float32: exp(200) overflows. A > 0 (saturated) and A = 0 tokens must not produce NaN.
    logp = torch.tensor([[0.0, 0.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-200.0, -200.0, -0.5]])
    adv = torch.tensor([[1.0, 0.0, 1.0]])
    res = ppo_clip_loss(logp, old, adv, torch.ones(1, 3))
    res.loss.backward()
    assert torch.isfinite(res.loss)
    assert res.loss.item() == pytest.approx(-(1.2 + 0.0 + 1.0) / 3, rel=1e-6)
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == 0.0
    assert logp.grad[0, 2].item() == pytest.approx(-1 / 3, rel=1e-6)


# ----------------------------------------------------------- robustness & contracts
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 123.0])
@pytest.mark.parametrize("mode", MODES)
def test_masked_slots_change_nothing(bad, mode):
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(3, 4, generator=g, dtype=D64)
    old = logp + 0.3 * torch.randn(3, 4, generator=g, dtype=D64)
    adv = torch.randn(3, 4, generator=g, dtype=D64)
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]])
    clean, gc = run(logp, old, adv, mask, aggregation=mode, dual_clip=2.0)
    dl, do, da = logp.clone(), old.clone(), adv.clone()
    for x in (dl, do, da):
        x[mask == 0] = bad
    dirty, gd = run(dl, do, da, mask, aggregation=mode, dual_clip=2.0)
    assert torch.isfinite(dirty.loss) and torch.isfinite(gd).all()
    assert dirty.loss.item() == clean.loss.item()
    assert torch.equal(gc, gd)
    for k in clean.metrics:
        assert torch.equal(clean.metrics[k], dirty.metrics[k]), k


@pytest.mark.parametrize("mode", MODES)
def test_microbatches_with_global_denominator_equal_full_batch(mode):
    g = torch.Generator().manual_seed(4)
    logp = -torch.rand(6, 5, generator=g, dtype=D64)
    old = logp + 0.3 * torch.randn(6, 5, generator=g, dtype=D64)
    adv = torch.randn(6, 5, generator=g, dtype=D64)
    mask = (torch.rand(6, 5, generator=g) > 0.4).long()
    mask[1] = 0
    full, gfull = run(logp, old, adv, mask, aggregation=mode)
    d = local_count(mask, mode)
    lp = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        r = ppo_clip_loss(lp[rows], old[rows], adv[rows], mask[rows], aggregation=mode, denominator=d)
        r.loss.backward()
        total += r.loss.item()
    assert total == pytest.approx(full.loss.item(), abs=1e-12)
    assert torch.allclose(lp.grad, gfull, atol=1e-14)


def test_gradcheck():
    g = torch.Generator().manual_seed(5)
    logp = (-torch.rand(3, 4, generator=g, dtype=D64)).requires_grad_(True)
    # ratios either well inside [0.8, 1.2] or far outside (piecewise smooth there)
    shift = t([[0.05, -0.05, 0.6, -0.6], [0.02, 0.6, -0.6, 0.0], [0.1, -0.1, 0.03, 2.0]])
    old = logp.detach() - shift
    adv = t([[1.0, -1.0, 1.0, -1.0], [0.5, -2.0, 2.0, 1.0], [-1.0, 1.0, 0.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    for mode in MODES:
        f = lambda x: ppo_clip_loss(x, old, adv, mask, aggregation=mode, dual_clip=3.0).loss  # noqa: E731
        assert torch.autograd.gradcheck(f, (logp,))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 4), l=st.integers(1, 5), mode=st.sampled_from(MODES),
       per_seq=st.booleans())
def test_ratio_one_gradient_equals_reinforce(seed, b, l, mode, per_seq):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, l, generator=g, dtype=D64)
    adv = torch.randn(b, generator=g, dtype=D64) if per_seq else torch.randn(b, l, generator=g, dtype=D64)
    mask = (torch.rand(b, l, generator=g) > 0.3).long()
    _, gp = run(logp, logp, adv, mask, aggregation=mode, eps_low=0.1, eps_high=0.3, dual_clip=2.0)
    lp = logp.clone().requires_grad_(True)
    reinforce_loss(lp, adv, mask, aggregation=mode).loss.backward()
    assert torch.allclose(gp, lp.grad, atol=1e-14)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(old_logp=t([[-1.0, -1.0, -1.0]])), "old_logp"),
        (dict(old_logp=t([[math.nan, -1.0], [-1.0, -1.0]])), "old_logp"),
        (dict(old_logp=None), "old_logp"),
        (dict(logp=t([[-1.0, math.inf], [-1.0, -1.0]])), "logp"),
        (dict(advantages=t([[1.0, 1.0]])), "advantages"),
        (dict(mask=torch.tensor([[1, -1], [1, 0]])), "mask"),
        (dict(eps_low=0.0), "eps_low"),
        (dict(eps_low=-0.1), "eps_low"),
        (dict(eps_low=1.5), "eps_low"),
        (dict(eps_low=math.nan), "eps_low"),
        (dict(eps_high=0.0), "eps_high"),
        (dict(eps_high=math.inf), "eps_high"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(dual_clip=0.5), "dual_clip"),
        (dict(aggregation="sum"), "aggregation"),
        (dict(denominator=-1.0), "denominator"),
    ],
)
def test_bad_inputs(kwargs, name):
    args = dict(logp=t([[-1.0, -2.0], [-0.5, -0.1]]), old_logp=t([[-1.0, -2.0], [-0.5, -0.1]]),
                advantages=t([1.0, -1.0]), mask=torch.tensor(MASK))
    args.update(kwargs)
    pos = [args.pop(k) for k in ("logp", "old_logp", "advantages", "mask")]
    with pytest.raises(ValueError, match=name):
        ppo_clip_loss(*pos, **args)
