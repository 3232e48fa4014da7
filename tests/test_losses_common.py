"""The fast (all-finite, multiply by the mask) and the slow (select) input paths agree exactly."""
import math

import pytest
import torch

from trajgrad import losses, validation

D64 = torch.float64


def batch(seed=0, B=6, L=10):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=D64) * 2
    old = logp + 0.3 * torch.randn(B, L, generator=g, dtype=D64)
    adv = torch.randn(B, generator=g, dtype=D64)
    mask = (torch.rand(B, L, generator=g) > 0.3).to(D64)
    mask[0] = 1
    return logp, old, adv, mask


CASES = [
    ("reinforce", lambda lp, o, a, m, **k: losses.reinforce_loss(lp, a, m, **k)),
    ("ppo", lambda lp, o, a, m, **k: losses.ppo_clip_loss(lp, o, a, m, dual_clip=3.0, **k)),
    ("gspo", lambda lp, o, a, m, **k: losses.gspo_loss(lp, o, a, m, eps_low=0.05, eps_high=0.05, **k)),
    ("gspo_token", lambda lp, o, a, m, **k: losses.gspo_token_loss(lp, o, a, m, eps_low=0.05, eps_high=0.05, **k)),
    ("sapo", lambda lp, o, a, m, **k: losses.sapo_loss(lp, o, a, m, **k)),
    ("sapo_seq", lambda lp, o, a, m, **k: losses.sapo_loss(lp, o, a, m, level="sequence", **k)),
    ("sao", lambda lp, o, a, m, **k: losses.sao_dis_loss(lp, o, a, m, eps_low=0.2, eps_high=0.3, **k)),
    ("cispo", lambda lp, o, a, m, **k: losses.cispo_loss(lp, o, a, m, **k)),
    ("gmpo", lambda lp, o, a, m, **k: losses.gmpo_loss(lp, o, a, m, **k)),
    ("dppo_tv", lambda lp, o, a, m, **k: losses.dppo_tv_loss(lp, o, a, m, **k)),
    ("dppo_kl", lambda lp, o, a, m, **k: losses.dppo_kl_loss(lp, o, a, m, **k)),
    ("clip_cov", lambda lp, o, a, m, **k: losses.clip_cov_loss(lp, o, a, m, clip_ratio=0.1, cov_low=0.0, **k)),
    ("kl_cov", lambda lp, o, a, m, **k: losses.kl_cov_loss(lp, o, a, m, kl_ratio=0.1, **k)),
]


def run(fn, logp, old, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    res = fn(lp, old, adv, mask, **kw)
    res.loss.backward()
    return res, lp.grad


@pytest.mark.parametrize("name,fn", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_constant"])
def test_fast_and_slow_paths_agree(name, fn, mode):
    logp, old, adv, mask = batch()
    fast, g_fast = run(fn, logp, old, adv, mask, aggregation=mode)
    # one NaN at a masked slot sends every input through the selecting path
    lp2, old2 = logp.clone(), old.clone()
    pos = (mask == 0).nonzero()[0]
    lp2[pos[0], pos[1]] = math.nan
    old2[pos[0], pos[1]] = math.inf
    slow, g_slow = run(fn, lp2, old2, adv, mask, aggregation=mode)
    assert slow.loss.item() == pytest.approx(fast.loss.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(g_slow, g_fast, rtol=1e-12, atol=1e-15)
    for k, v in fast.metrics.items():
        assert not v.requires_grad
        assert torch.allclose(v.to(D64), slow.metrics[k].to(D64), rtol=1e-10, atol=1e-12), k
    # bool masks take the same path
    b, g_b = run(fn, logp, old, adv, mask > 0, aggregation=mode)
    assert b.loss.item() == pytest.approx(fast.loss.item(), rel=1e-12, abs=1e-15)
    # and with value validation off the result is unchanged
    with validation(False):
        off, g_off = run(fn, logp, old, adv, mask, aggregation=mode)
    assert off.loss.item() == pytest.approx(fast.loss.item(), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("name,fn", CASES, ids=[c[0] for c in CASES])
def test_nonfinite_at_a_valid_slot_raises_naming_the_argument(name, fn):
    logp, old, adv, mask = batch()
    bad = logp.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="logp"):
        fn(bad, old, adv, mask)
    a = adv.clone()
    a[0] = math.inf
    with pytest.raises(ValueError, match="advantages"):
        fn(logp, old, a, mask)
    m = mask.clone()
    m[0, 0] = 0.5
    with pytest.raises(ValueError, match="mask"):
        fn(logp, old, adv, m)
    with pytest.raises(ValueError, match="denominator"):
        fn(logp, old, adv, mask, denominator=math.inf)
    with pytest.raises(ValueError, match="constant"):
        fn(logp, old, adv, mask, aggregation="seq_sum_constant", constant=math.inf)


@pytest.mark.parametrize("name,fn", CASES, ids=[c[0] for c in CASES])
def test_unit_weights_change_nothing_and_zero_weights_keep_the_denominator(name, fn):
    logp, old, adv, mask = batch(1)
    base, g = run(fn, logp, old, adv, mask)
    ones, g1 = run(fn, logp, old, adv, mask, weights=torch.ones_like(logp))
    assert ones.loss.item() == pytest.approx(base.loss.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(g1, g, rtol=1e-12, atol=1e-15)
    w = torch.ones_like(logp)
    w[0] = 0.0  # drop response 0 from the numerator only
    dropped, gd = run(fn, logp, old, adv, mask, weights=w)
    assert (gd[0] == 0).all()
    assert torch.isfinite(dropped.loss)
    bad = torch.ones_like(logp)
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="weights"):
        fn(logp, old, adv, mask, weights=bad)


@pytest.mark.parametrize("name,fn", CASES, ids=[c[0] for c in CASES])
def test_a_mask_value_near_but_not_0_or_1_raises(name, fn):
    """The 0/1 test of a float mask is a sum of non-negative terms m(1 − m)²...: values within
    rounding of 0 or 1, out of range, NaN or inf all raise; −0.0 is a valid 0."""
    logp, old, adv, mask = batch()
    for bad in (1 - 1e-12, 1e-12, 1 + 1e-9, -1e-9, 2.0, -1.0, math.nan, math.inf, -math.inf, 1e200):
        m = mask.clone()
        m[1, 3] = bad
        with pytest.raises(ValueError, match="^mask"):
            fn(logp, old, adv, m)
    m32 = mask.to(torch.float32)
    m32[2, 2] = 1 - 2 ** -20
    with pytest.raises(ValueError, match="^mask"):
        fn(logp, old, adv, m32)
    m = mask.clone()
    m[m == 0] = -0.0
    a, _ = run(fn, logp, old, adv, m)
    b, _ = run(fn, logp, old, adv, mask)
    assert torch.equal(a.loss, b.loss)

