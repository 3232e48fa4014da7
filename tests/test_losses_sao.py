"""Tests for trajgrad.losses.sao (spec §20.2)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.autograd.gradcheck import GradcheckError

from trajgrad.aggregate import MODES, local_count
from trajgrad.losses import ppo_clip_loss, reinforce_loss, sao_dis_loss

D64 = torch.float64
GRADS = ["detached", "attached"]


def t(x):
    return torch.as_tensor(x, dtype=D64).clone()


def run(logp, rollout, adv, mask, fn=sao_dis_loss, **kw):
    lp = t(logp).requires_grad_(True)
    res = fn(lp, t(rollout), t(adv), torch.as_tensor(mask), **kw)
    res.loss.backward()
    return res, lp.grad


# §23 tensors: all ratios inside (0.7, 6.0).
OLD = [[-1.00, -0.50], [-0.20, -0.70]]
CUR = [[-0.90, -0.60], [-0.10, -1.00]]
ADV = [[1.0, 1.0], [-0.5, -0.5]]
MASK = [[1, 1], [1, 0]]


def test_hand_value_detached():
    # -mean(r A logp): -(e^.1*1*(-0.9) + e^-.1*1*(-0.6) + e^.1*(-0.5)*(-0.1)) / 3
    res, g = run(CUR, OLD, ADV, MASK)
    e1, em1 = math.exp(0.1), math.exp(-0.1)
    assert res.loss.item() == pytest.approx(-(e1 * -0.9 + em1 * -0.6 + e1 * 0.05) / 3, abs=1e-13)
    assert res.loss.item() == pytest.approx(0.494099, abs=1e-6)
    # detached weight: gradient -A r / D
    assert torch.allclose(g, t([[-e1 / 3, -em1 / 3], [0.5 * e1 / 3, 0.0]]), atol=1e-14)
    assert res.metrics["trust/accepted"].item() == 1.0


def test_attached_gradient_has_the_one_plus_logp_factor():
    res, g = run(CUR, OLD, ADV, MASK, ratio_gradient="attached")
    r = torch.exp(t(CUR) - t(OLD))
    a, lp = t(ADV), t(CUR)
    expected = torch.where(torch.tensor(MASK).bool(), -a * r * (1 + lp) / 3, 0.0)
    assert torch.allclose(g, expected, atol=1e-14)
    # same value as the detached reading: only the gradient differs
    res_d, g_d = run(CUR, OLD, ADV, MASK)
    assert res.loss.item() == res_d.loss.item()
    assert not torch.allclose(g, g_d)


def exact_rollout(z):
    """A negative rollout log-prob ``a`` with ``(a + z) - a == z`` exactly in float64."""
    for k in range(1, 4096):
        a = -k / 64.0
        if (a + z) - a == z and a + z < 0:
            return a
    raise AssertionError("no exact representation found")


@pytest.mark.parametrize("ratio_gradient", GRADS)
@pytest.mark.parametrize("eps_low,eps_high", [(0.3, 5.0), (0.8, 3.0), (0.2, 0.28)])
def test_exact_boundaries_are_rejected_and_just_inside_is_accepted(ratio_gradient, eps_low, eps_high):
    for side in ("low", "high"):
        z = math.log1p(-eps_low) if side == "low" else math.log1p(eps_high)
        rollout = exact_rollout(z)
        logp = rollout + z
        assert logp - rollout == z  # the log ratio is exactly on the boundary
        res, g = run([[logp]], [[rollout]], [[1.0]], [[1]], ratio_gradient=ratio_gradient, eps_low=eps_low,
                     eps_high=eps_high)
        assert res.metrics["trust/accepted"].item() == 0.0  # trusted is False
        assert res.metrics[f"trust/rejected_{side}"].item() == 1.0
        assert g.item() == 0.0 and res.loss.item() == 0.0
        inside = logp + (1e-9 if side == "low" else -1e-9)
        res, g = run([[inside]], [[rollout]], [[1.0]], [[1]], ratio_gradient=ratio_gradient, eps_low=eps_low,
                     eps_high=eps_high)
        assert res.metrics["trust/accepted"].item() == 1.0
        r = math.exp(inside - rollout)
        factor = 1.0 if ratio_gradient == "detached" else 1.0 + inside
        assert g.item() == pytest.approx(-r * factor, rel=1e-9)
        assert g.item() != 0.0


@pytest.mark.parametrize(
    "ratio,adv,ppo_active",
    [
        (0.5, 1.0, True),  # below: PPO A>0 active, SAO zero
        (0.5, -1.0, False),  # below: PPO A<0 saturated, SAO zero
        (1.05, 1.0, True),  # inside: both active
        (1.05, -1.0, True),
        (1.5, 1.0, False),  # above: PPO A>0 saturated, SAO zero
        (1.5, -1.0, True),  # above: PPO A<0 active, SAO zero
    ],
)
def test_section_20_2_table_against_ppo(ratio, adv, ppo_active):
    eps = dict(eps_low=0.2, eps_high=0.2)
    old = -1.0
    cur = old + math.log(ratio)
    _, g_ppo = run([[cur]], [[old]], [[adv]], [[1]], fn=ppo_clip_loss, **eps)
    _, g_sao = run([[cur]], [[old]], [[adv]], [[1]], **eps)
    assert (g_ppo.item() != 0.0) == ppo_active
    inside = 0.8 < ratio < 1.2
    assert (g_sao.item() != 0.0) == inside
    if inside:  # both equal A r d logp (times -1/D)
        assert g_sao.item() == pytest.approx(g_ppo.item(), rel=1e-12)


def test_rejection_metrics_by_side():
    ratios = [0.5, 0.9, 1.0, 7.0, 0.69]
    cur = [[-1.0 + math.log(r) for r in ratios] + [0.0]]
    res, _ = run(cur, [[-1.0] * 6], [[1.0] * 6], [[1] * 5 + [0]])
    m = res.metrics
    assert m["trust/rejected_low"].item() == pytest.approx(2 / 5)
    assert m["trust/rejected_high"].item() == pytest.approx(1 / 5)
    assert m["trust/accepted"].item() == pytest.approx(2 / 5)
    assert m["tokens"].item() == 5


def test_overflowing_ratio_is_rejected_without_nan():
    logp = torch.tensor([[-0.1, -0.5]], requires_grad=True)
    rollout = torch.tensor([[-200.0, -0.5]])
    for mode in GRADS:
        res = sao_dis_loss(logp, rollout, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), ratio_gradient=mode)
        (g,) = torch.autograd.grad(res.loss, logp)
        assert torch.isfinite(res.loss) and torch.isfinite(g).all()
        assert g[0, 0].item() == 0.0


@pytest.mark.parametrize("ratio_gradient", GRADS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -3.0])
@pytest.mark.parametrize("mode", MODES)
def test_masked_slots_change_nothing(ratio_gradient, bad, mode):
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(3, 4, generator=g, dtype=D64)
    old = logp + 0.3 * torch.randn(3, 4, generator=g, dtype=D64)
    adv = torch.randn(3, 4, generator=g, dtype=D64)
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]])
    kw = dict(aggregation=mode, ratio_gradient=ratio_gradient)
    clean, gc = run(logp, old, adv, mask, **kw)
    dl, do, da = logp.clone(), old.clone(), adv.clone()
    for x in (dl, do, da):
        x[mask == 0] = bad
    dirty, gd = run(dl, do, da, mask, **kw)
    assert torch.isfinite(dirty.loss) and torch.isfinite(gd).all()
    assert dirty.loss.item() == clean.loss.item()
    assert torch.equal(gc, gd)


@pytest.mark.parametrize("ratio_gradient", GRADS)
@pytest.mark.parametrize("mode", MODES)
def test_microbatches_with_global_denominator_equal_full_batch(ratio_gradient, mode):
    g = torch.Generator().manual_seed(4)
    logp = -torch.rand(6, 5, generator=g, dtype=D64)
    old = logp + 0.5 * torch.randn(6, 5, generator=g, dtype=D64)
    adv = torch.randn(6, 5, generator=g, dtype=D64)
    mask = (torch.rand(6, 5, generator=g) > 0.4).long()
    mask[0] = 0
    kw = dict(aggregation=mode, ratio_gradient=ratio_gradient)
    full, gfull = run(logp, old, adv, mask, **kw)
    d = local_count(mask, mode)
    lp = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        r = sao_dis_loss(lp[rows], old[rows], adv[rows], mask[rows], denominator=d, **kw)
        r.loss.backward()
        total += r.loss.item()
    assert total == pytest.approx(full.loss.item(), abs=1e-12)
    assert torch.allclose(lp.grad, gfull, atol=1e-14)


def test_gradcheck_attached():
    # Only the attached reading is the derivative of its own forward value; the detached
    # reading is a surrogate whose gradient is checked analytically above (and below).
    ratio_gradient = "attached"
    logp = t([[-0.5, -1.0, -0.2, -2.0], [-0.3, -0.9, -1.5, -0.1]]).requires_grad_(True)
    # log ratios inside (log 0.7, log 6) or far outside
    shift = t([[0.1, -0.1, 2.5, -1.0], [0.0, 0.3, -0.2, 0.05]])
    old = logp.detach() - shift
    adv = t([[1.0, -1.0, 2.0, 1.0], [-0.5, 0.5, 1.5, -2.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1]])
    for mode in MODES:
        f = lambda x: sao_dis_loss(x, old, adv, mask, aggregation=mode, ratio_gradient=ratio_gradient).loss  # noqa
        assert torch.autograd.gradcheck(f, (logp,))


def test_detached_gradient_is_not_the_derivative_of_the_value():
    logp = t([[-0.5, -1.0]]).requires_grad_(True)
    old = logp.detach() - t([[0.1, -0.1]])
    res = sao_dis_loss(logp, old, t([1.0]), torch.ones(1, 2))
    (g,) = torch.autograd.grad(res.loss, logp)
    r = torch.exp(t([[0.1, -0.1]]))
    assert torch.allclose(g, -r / 2, atol=1e-14)  # A r d logp, A = 1, D = 2
    with pytest.raises(GradcheckError):
        torch.autograd.gradcheck(lambda x: sao_dis_loss(x, old, t([1.0]), torch.ones(1, 2)).loss, (logp,))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(MODES), per_seq=st.booleans())
def test_ratio_one_gradient_equals_reinforce(seed, mode, per_seq):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 4, generator=g, dtype=D64)
    adv = torch.randn(3, generator=g, dtype=D64) if per_seq else torch.randn(3, 4, generator=g, dtype=D64)
    mask = (torch.rand(3, 4, generator=g) > 0.3).long()
    res, gs = run(logp, logp, adv, mask, aggregation=mode)
    lp = logp.clone().requires_grad_(True)
    ref = reinforce_loss(lp, adv, mask, aggregation=mode)
    ref.loss.backward()
    assert res.loss.item() == pytest.approx(ref.loss.item(), abs=1e-14)
    assert torch.allclose(gs, lp.grad, atol=1e-14)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(rollout_logp=t([[-1.0, -1.0]])), "rollout_logp"),
        (dict(rollout_logp=t([[math.nan, -1.0], [-1.0, -1.0]])), "rollout_logp"),
        (dict(rollout_logp=None), "rollout_logp"),
        (dict(logp=t([[-1.0, -1.0], [math.inf, -1.0]])), "logp"),
        (dict(advantages=t([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])), "advantages"),
        (dict(mask=torch.tensor([[1, 1], [1, 1], [1, 1]])), "mask"),
        (dict(mask=torch.tensor([[1, 0.2], [1, 0]])), "mask"),
        (dict(eps_low=0.0), "eps_low"),
        (dict(eps_low=1.2), "eps_low"),
        (dict(eps_high=0.0), "eps_high"),
        (dict(ratio_gradient="stop"), "ratio_gradient"),
        (dict(aggregation="mean"), "aggregation"),
    ],
)
def test_bad_inputs(kwargs, name):
    args = dict(logp=t([[-1.0, -2.0], [-0.5, -0.1]]), rollout_logp=t([[-1.0, -2.0], [-0.5, -0.1]]),
                advantages=t([1.0, -1.0]), mask=torch.tensor([[1, 1], [1, 0]]))
    args.update(kwargs)
    pos = [args.pop(k) for k in ("logp", "rollout_logp", "advantages", "mask")]
    with pytest.raises(ValueError, match=name):
        sao_dis_loss(*pos, **args)
