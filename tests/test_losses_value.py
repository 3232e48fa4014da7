"""Tests for trajgrad.losses.value (spec §20.3)."""
import math

import pytest
import torch

from trajgrad.aggregate import MODES, local_count
from trajgrad.losses import value_loss

D64 = torch.float64


def t(x):
    return torch.as_tensor(x, dtype=D64).clone()


def run(values, returns, mask, **kw):
    v = t(values).requires_grad_(True)
    res = value_loss(v, t(returns), torch.as_tensor(mask), **kw)
    res.loss.backward()
    return res, v.grad


def test_hand_value_unclipped():
    # errors (V - R) = [1.0 - 1.5, 2.5 - 1.0] = [-0.5, 1.5]; 0.5 * (0.25 + 2.25) / 2 = 0.625
    res, g = run([[1.0, 2.5, 9.0]], [[1.5, 1.0, 0.0]], [[1, 1, 0]])
    assert res.loss.item() == pytest.approx(0.625, abs=1e-15)
    assert torch.allclose(g, t([[-0.25, 0.75, 0.0]]), atol=1e-15)  # (V - R) / D
    assert res.metrics["value/mse"].item() == pytest.approx(1.25)
    assert res.metrics["value/clip_frac"].item() == 0.0
    assert res.metrics["tokens"].item() == 2


def test_hand_value_clipped():
    # old = [0.5, 2.0], c = 0.2 -> V_clip = [0.7, 2.2]
    # squared errors: unclipped [0.25, 2.25], clipped [0.64, 1.44] -> max [0.64, 2.25]
    # loss = 0.5 * (0.64 + 2.25) / 2 = 0.7225
    res, g = run([[1.0, 2.5]], [[1.5, 1.0]], [[1, 1]], old_values=t([[0.5, 2.0]]), clip_range=0.2)
    assert res.loss.item() == pytest.approx(0.7225, abs=1e-14)
    # token 0: the clipped branch wins and V_clip is constant in V -> 0; token 1: (V - R) / D = 0.75
    assert torch.allclose(g, t([[0.0, 0.75]]), atol=1e-15)
    assert res.metrics["value/clip_frac"].item() == pytest.approx(0.5)


def test_clipping_inside_range_is_plain_regression():
    kw = dict(old_values=t([[0.9, 2.4]]), clip_range=0.2)
    a, ga = run([[1.0, 2.5]], [[1.5, 1.0]], [[1, 1]], **kw)
    b, gb = run([[1.0, 2.5]], [[1.5, 1.0]], [[1, 1]])
    assert a.loss.item() == pytest.approx(b.loss.item(), abs=1e-15)
    assert torch.allclose(ga, gb, atol=1e-15)


def test_explained_variance_metric():
    # R = [1, 2, 3, 4], V = [1, 2, 3, 5]: Var(R) = 1.25, Var(R - V) = Var([0,0,0,-1]) = 0.1875
    res, _ = run([[1.0, 2.0], [3.0, 5.0]], [[1.0, 2.0], [3.0, 4.0]], [[1, 1], [1, 1]])
    assert res.metrics["value/explained_variance"].item() == pytest.approx(1 - 0.1875 / 1.25, abs=1e-14)
    # constant returns: guarded to 0.0
    res, _ = run([[1.0, 2.0]], [[3.0, 3.0]], [[1, 1]])
    assert res.metrics["value/explained_variance"].item() == 0.0


def test_targets_are_detached():
    v = t([[1.0, 2.0]]).requires_grad_(True)
    r = t([[0.0, 1.0]]).requires_grad_(True)
    o = t([[0.5, 1.0]]).requires_grad_(True)
    value_loss(v, r, torch.ones(1, 2), old_values=o, clip_range=0.1).loss.backward()
    assert r.grad is None and o.grad is None and v.grad is not None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e6])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", [None, 0.3])
def test_masked_slots_change_nothing(bad, mode, clip):
    g = torch.Generator().manual_seed(0)
    v, r, o = (torch.randn(3, 4, generator=g, dtype=D64) for _ in range(3))
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]])
    kw = dict(aggregation=mode, clip_range=clip, old_values=o)
    clean, gc = run(v, r, mask, **kw)
    dv, dr, do = v.clone(), r.clone(), o.clone()
    for x in (dv, dr, do):
        x[mask == 0] = bad
    dirty, gd = run(dv, dr, mask, **{**kw, "old_values": do})
    assert torch.isfinite(dirty.loss) and torch.isfinite(gd).all()
    assert dirty.loss.item() == clean.loss.item()
    assert torch.equal(gc, gd)
    for k in clean.metrics:
        assert torch.equal(clean.metrics[k], dirty.metrics[k]), k


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", [None, 0.3])
def test_microbatches_with_global_denominator_equal_full_batch(mode, clip):
    g = torch.Generator().manual_seed(1)
    v, r, o = (torch.randn(5, 4, generator=g, dtype=D64) for _ in range(3))
    mask = (torch.rand(5, 4, generator=g) > 0.3).long()
    mask[4] = 0
    full, gfull = run(v, r, mask, aggregation=mode, clip_range=clip, old_values=o)
    d = local_count(mask, mode)
    vv = v.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 5)):
        res = value_loss(vv[rows], r[rows], mask[rows], old_values=o[rows], clip_range=clip, aggregation=mode,
                         denominator=d)
        res.loss.backward()
        total += res.loss.item()
    assert total == pytest.approx(full.loss.item(), abs=1e-12)
    assert torch.allclose(vv.grad, gfull, atol=1e-14)


def test_gradcheck():
    v = t([[0.1, 0.9, -0.4], [1.5, 0.0, 0.3]]).requires_grad_(True)
    r = t([[0.0, 1.0, 1.0], [-1.0, 0.5, 0.2]])
    o = t([[0.5, 0.8, 0.0], [0.0, 0.1, 0.3]])  # |V - V_old| away from the clip boundary 0.3
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    for mode in MODES:
        for clip in (None, 0.3):
            f = lambda x: value_loss(x, r, mask, old_values=o, clip_range=clip, aggregation=mode).loss  # noqa
            assert torch.autograd.gradcheck(f, (v,))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(values=t([1.0, 2.0])), "values"),
        (dict(values=t([[1.0, math.nan]])), "values"),
        (dict(returns=t([[1.0, 2.0, 3.0]])), "returns"),
        (dict(returns=t([[1.0, math.inf]])), "returns"),
        (dict(mask=torch.tensor([[1, 5]])), "mask"),
        (dict(clip_range=0.2), "old_values"),
        (dict(clip_range=0.0, old_values=t([[0.0, 0.0]])), "clip_range"),
        (dict(clip_range=-1.0, old_values=t([[0.0, 0.0]])), "clip_range"),
        (dict(clip_range=0.2, old_values=t([[0.0]])), "old_values"),
        (dict(clip_range=0.2, old_values=t([[0.0, math.nan]])), "old_values"),
        (dict(aggregation="token_total"), "aggregation"),
        (dict(denominator=math.inf), "denominator"),
        (dict(denominator=0.0), "denominator"),
    ],
)
def test_bad_inputs(kwargs, name):
    args = dict(values=t([[1.0, 2.0]]), returns=t([[0.5, 2.5]]), mask=torch.tensor([[1, 1]]))
    args.update(kwargs)
    pos = [args.pop(k) for k in ("values", "returns", "mask")]
    with pytest.raises(ValueError, match=name):
        value_loss(*pos, **args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clip_frac_is_exactly_zero_inside_the_clip_range(dtype):
    """Random inputs with |V - V_old| < c: nothing is clipped, so the fraction is exactly 0.

    V and V_old are drawn independently in (-0.09, 0.09) with c = 0.2 (every token inside
    the range) and the returns lie within rounding of V. The former construction
    V_old + clamp(V - V_old, -c, c) differs from V in the last bit on about a third of these
    tokens, and the clipped error then looked "strictly larger" on many of them.
    """
    g = torch.Generator().manual_seed(0)
    c = 0.2
    shape = (64, 128)
    old = ((torch.rand(shape, generator=g, dtype=D64) * 2 - 1) * 0.09).to(dtype)
    v0 = ((torch.rand(shape, generator=g, dtype=D64) * 2 - 1) * 0.09).to(dtype)
    returns = (v0.double() + 1e-9 * torch.randn(shape, generator=g, dtype=D64)).to(dtype)
    mask = torch.ones(shape)
    assert bool(((v0 - old).abs() < c).all())
    values = v0.clone().requires_grad_(True)
    res = value_loss(values, returns, mask, old_values=old, clip_range=c)
    assert res.metrics["value/clip_frac"].item() == 0.0
    # the old form counts a large share of these in-range tokens as clipped (fails this test)
    v_old_form = old + torch.clamp(v0 - old, -c, c)
    old_frac = ((v_old_form - returns).square() > (v0 - returns).square()).double().mean().item()
    assert old_frac > 0.05
    # loss and gradient are those of plain regression, bit for bit
    plain = value_loss(values, returns, mask)
    assert res.loss.item() == plain.loss.item()
    (ga,) = torch.autograd.grad(res.loss, values)
    (gb,) = torch.autograd.grad(plain.loss, values)
    assert torch.equal(ga, gb)


def test_clipped_value_is_the_bound_outside_the_range():
    # V - V_old = +0.5 and -0.5 with c = 0.2: V_clip = V_old ± 0.2; R chosen so the clipped error wins
    v = t([[1.5, -0.5]]).requires_grad_(True)
    old = t([[1.0, 0.0]])
    r = t([[2.0, -1.0]])
    res = value_loss(v, r, torch.ones(1, 2), old_values=old, clip_range=0.2)
    # clipped errors: (1.2 - 2)^2 = 0.64 > 0.25 and (-0.2 + 1)^2 = 0.64 > 0.25
    assert res.loss.item() == pytest.approx(0.5 * 0.64, abs=1e-14)
    res.loss.backward()
    assert torch.equal(v.grad, torch.zeros_like(v.grad))
    assert res.metrics["value/clip_frac"].item() == 1.0
