"""Tests for trajgrad.diagnostics (spec §8, §11, §20.3)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad import _policy_stats, diagnostics
from trajgrad.diagnostics import (
    effective_sample_size,
    explained_variance,
    explained_variance_or_none,
    policy_metrics,
    zero_variance_fraction,
)

D64 = torch.float64


def t(x):
    return torch.as_tensor(x, dtype=D64).clone()


# ------------------------------------------------------------------ policy_metrics
def test_policy_metrics_hand_case():
    # valid log ratios z = [log 1.5, log 0.5, log 1.5, log 0.5, 0] with A = [+, +, -, -, +]
    z = t([[math.log(1.5), math.log(0.5), math.log(1.5)], [math.log(0.5), 0.0, math.nan]])
    adv = t([[1.0, 2.0, -1.0], [-3.0, 0.5, math.inf]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    m = policy_metrics(z, adv, mask, eps_low=0.2, eps_high=0.3)
    assert m["tokens"].item() == 5
    assert m["clip_frac/pos_high"].item() == pytest.approx(1 / 5)
    assert m["clip_frac/pos_low"].item() == pytest.approx(1 / 5)
    assert m["clip_frac/neg_high"].item() == pytest.approx(1 / 5)
    assert m["clip_frac/neg_low"].item() == pytest.approx(1 / 5)
    assert m["clip_frac"].item() == pytest.approx(2 / 5)
    assert m["ratio/out_of_range_frac"].item() == pytest.approx(4 / 5)
    assert m["ratio/mean"].item() == pytest.approx((1.5 + 0.5 + 1.5 + 0.5 + 1.0) / 5)
    assert m["ratio/max"].item() == pytest.approx(1.5) and m["ratio/min"].item() == pytest.approx(0.5)
    # sorted z: [l.5, l.5, 0, l1.5, l1.5] -> median 0
    assert m["log_ratio/q50"].item() == pytest.approx(0.0, abs=1e-15)
    # k1 = mean(-z) = -(2 log 1.5 + 2 log 0.5)/5 ; k3 = mean(r - 1 - z)
    assert m["kl/k1"].item() == pytest.approx(-(2 * math.log(1.5) + 2 * math.log(0.5)) / 5)
    k3 = (2 * (0.5 - math.log(1.5)) + 2 * (-0.5 - math.log(0.5))) / 5
    assert m["kl/k3"].item() == pytest.approx(k3)
    assert all(not v.requires_grad for v in m.values())


def test_policy_metrics_without_eps_has_no_clip_keys_and_symmetric_default():
    z, adv, mask = t([[0.1, -0.1]]), t([1.0]), torch.ones(1, 2)
    m = policy_metrics(z, adv, mask)
    assert not any(k.startswith("clip_frac") for k in m)
    sym = policy_metrics(t([[0.25, -0.25]]), t([1.0]), mask, eps_low=0.2)  # eps_high defaults to eps_low
    # exp(0.25) = 1.284 > 1.2 (A>0: clipped); exp(-0.25) = 0.779 < 0.8 (A>0: pos_low)
    assert sym["clip_frac/pos_high"].item() == 0.5 and sym["clip_frac/pos_low"].item() == 0.5


def test_policy_metrics_quantiles_match_torch_and_large_path(monkeypatch):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(7, 13, generator=g, dtype=D64)
    mask = torch.rand(7, 13, generator=g) > 0.3
    m = policy_metrics(z, torch.zeros(7), mask)
    q = torch.quantile(z[mask], t([0.01, 0.5, 0.99]))
    got = t([m["log_ratio/q01"], m["log_ratio/q50"], m["log_ratio/q99"]])
    assert torch.allclose(got, q, atol=1e-14)
    monkeypatch.setattr(_policy_stats, "_QUANTILE_LIMIT", 4)  # force the sort-based path
    m2 = policy_metrics(z, torch.zeros(7), mask)
    got2 = t([m2["log_ratio/q01"], m2["log_ratio/q50"], m2["log_ratio/q99"]])
    assert torch.allclose(got2, q, atol=1e-14)


def test_policy_metrics_quantiles_of_large_tensors_come_from_a_fixed_sample():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(64, 1024, generator=g, dtype=D64)
    mask = torch.rand(64, 1024, generator=g) > 0.4
    m = policy_metrics(z, torch.zeros(64), mask)
    exact = torch.quantile(z[mask], t([0.01, 0.5, 0.99]))
    got = t([m["log_ratio/q01"], m["log_ratio/q50"], m["log_ratio/q99"]])
    # ~2,400 valid entries of a 4,096-position sample: standard error of the median ~0.025
    assert torch.allclose(got, exact, atol=0.15)
    assert not torch.equal(got, exact)  # a sample, as documented
    again = policy_metrics(z, torch.zeros(64), mask)
    assert all(torch.equal(again[k], m[k]) for k in m)  # the same positions every call
    # the other statistics stay exact
    assert m["ratio/max"].item() == pytest.approx(z[mask].exp().max().item())
    assert m["kl/k1"].item() == pytest.approx((-z[mask]).mean().item())
    # a sample that misses every valid entry falls back to all of them
    sparse = torch.zeros(64, 1024, dtype=torch.bool)
    sparse[5, 7] = True
    ms = policy_metrics(z, torch.zeros(64), sparse)
    assert ms["log_ratio/q50"].item() == pytest.approx(z[5, 7].item())


def test_policy_metrics_empty_mask():
    m = policy_metrics(t([[math.nan, 1.0]]), t([1.0]), torch.zeros(1, 2), eps_low=0.2)
    assert m["tokens"].item() == 0
    assert m["ratio/mean"].item() == 1.0 and m["log_ratio/q50"].item() == 0.0
    assert m["kl/k1"].item() == 0.0 and m["clip_frac"].item() == 0.0
    assert all(torch.isfinite(v) for v in m.values())


def test_policy_metrics_bfloat16():
    z = torch.tensor([[0.1, -0.2]], dtype=torch.bfloat16)
    m = policy_metrics(z, torch.ones(1), torch.ones(1, 2), eps_low=0.2)
    assert m["tokens"].item() == 2 and torch.isfinite(m["log_ratio/q99"])


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: policy_metrics(t([0.1]), t([1.0]), torch.ones(1)), "log_ratio"),
        (lambda: policy_metrics(t([[0.1]]), t([[1.0, 1.0]]), torch.ones(1, 1)), "advantages"),
        (lambda: policy_metrics(t([[math.nan]]), t([1.0]), torch.ones(1, 1)), "log_ratio"),
        (lambda: policy_metrics(t([[0.1]]), t([1.0]), torch.tensor([[3]])), "mask"),
        (lambda: policy_metrics(t([[0.1]]), t([1.0]), torch.ones(1, 1), eps_high=0.2), "eps_low"),
        (lambda: policy_metrics(t([[0.1]]), t([1.0]), torch.ones(1, 1), eps_low=0.0), "eps_low"),
        (lambda: policy_metrics(t([[0.1]]), t([1.0]), torch.ones(1, 1), eps_low=0.2, eps_high=-1), "eps_high"),
    ],
)
def test_policy_metrics_bad_inputs(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# -------------------------------------------------------------- explained_variance
def test_explained_variance_hand_values():
    r = t([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(r, r.clone()).item() == pytest.approx(1.0)
    assert explained_variance(r, torch.full_like(r, 2.5)).item() == pytest.approx(0.0, abs=1e-15)
    # V = [1, 2, 3, 5]: Var(R) = 1.25, Var(R - V) = Var([0, 0, 0, -1]) = 0.1875
    assert explained_variance(r, t([1.0, 2.0, 3.0, 5.0])).item() == pytest.approx(1 - 0.1875 / 1.25)
    # worse than a constant: negative
    assert explained_variance(r, t([4.0, 3.0, 2.0, 1.0])).item() == pytest.approx(1 - 5.0 / 1.25)


def test_explained_variance_guard():
    r = t([3.0, 3.0, 3.0])
    v = t([1.0, 2.0, 3.0])
    assert explained_variance(r, v).item() == 0.0
    assert explained_variance_or_none(r, v) is None
    assert explained_variance(t([0.0, 0.0]), t([1.0, -1.0])).item() == 0.0  # all-zero returns
    assert explained_variance(t([1.0]), t([0.0])).item() == 0.0  # one entry
    assert explained_variance_or_none(t([1.0]), t([0.0])) is None
    # constant up to rounding at a large offset is still guarded
    assert explained_variance_or_none(t([1e8, 1e8 + 1e-8]), t([0.0, 1.0])) is None
    ok = explained_variance_or_none(t([1.0, 2.0]), t([1.0, 2.0]))
    assert ok is not None and ok.item() == pytest.approx(1.0)


def test_explained_variance_mask_and_scale_invariance():
    r = t([[1.0, 2.0, math.nan], [3.0, 4.0, 0.0]])
    v = t([[1.0, 2.0, math.inf], [3.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert explained_variance(r, v, mask).item() == pytest.approx(1 - 0.1875 / 1.25)
    # tiny-scale returns are not mistaken for constant ones (the guard is relative)
    assert explained_variance(t([1e-9, 2e-9, 3e-9, 4e-9]), t([1e-9, 2e-9, 3e-9, 5e-9])).item() == pytest.approx(
        1 - 0.1875 / 1.25)
    with pytest.raises(ValueError, match="returns"):
        explained_variance(t([math.nan, 1.0]), t([0.0, 1.0]))
    with pytest.raises(ValueError, match="values"):
        explained_variance(t([1.0, 2.0]), t([0.0]))
    with pytest.raises(ValueError, match="mask"):
        explained_variance(t([1.0, 2.0]), t([0.0, 1.0]), torch.tensor([1, 2]))


# ----------------------------------------------------------- effective_sample_size
def test_ess_hand_values():
    # w = [1, 2, 3]: (6)^2 / 14
    lw = t([0.0, math.log(2.0), math.log(3.0)])
    assert effective_sample_size(lw).item() == pytest.approx(36 / 14)
    assert effective_sample_size(lw, normalized=True).item() == pytest.approx(36 / 14 / 3)
    assert effective_sample_size(torch.zeros(5, dtype=D64)).item() == pytest.approx(5.0)
    # huge log-weights: computed in log space, no overflow
    assert effective_sample_size(t([1000.0, 1000.0])).item() == pytest.approx(2.0)
    assert effective_sample_size(t([1000.0, 0.0])).item() == pytest.approx(1.0)
    # a zero weight (-inf) does not count
    assert effective_sample_size(t([0.0, 0.0, -math.inf])).item() == pytest.approx(2.0)


def test_ess_mask_dim_and_empty():
    lw = t([[0.0, 0.0, math.nan], [0.0, math.log(3.0), 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    per_row = effective_sample_size(lw, mask, dim=-1)
    assert torch.allclose(per_row, t([2.0, 16 / 10]))
    assert effective_sample_size(lw, mask, dim=-1, normalized=True)[0].item() == pytest.approx(1.0)
    assert effective_sample_size(lw, torch.zeros(2, 3)).item() == 0.0
    assert effective_sample_size(t([-math.inf, -math.inf])).item() == 0.0
    assert effective_sample_size(t([-math.inf]), normalized=True).item() == 0.0
    with pytest.raises(ValueError, match="log_weights"):
        effective_sample_size(t([0.0, math.nan]))
    with pytest.raises(ValueError, match="log_weights"):
        effective_sample_size(t([0.0, math.inf]))
    with pytest.raises(ValueError, match="mask"):
        effective_sample_size(t([0.0, 1.0]), torch.ones(3))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 30), scale=st.floats(0.0, 30.0))
def test_ess_bounds(seed, n, scale):
    lw = scale * torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=D64)
    ess = effective_sample_size(lw).item()
    assert 1.0 - 1e-9 <= ess <= n + 1e-9
    w = torch.exp(lw - lw.max())
    assert ess == pytest.approx((w.sum() ** 2 / (w**2).sum()).item(), rel=1e-9)


# ---------------------------------------------------------- zero_variance_fraction
def test_zero_variance_fraction():
    rewards = t([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [2.0, 2.0, 2.0], [0.0, 0.0, 1.0]])
    assert zero_variance_fraction(rewards).item() == 0.5
    assert zero_variance_fraction(t([[0.3]])).item() == 1.0  # a group of one has no spread
    with pytest.raises(ValueError, match="rewards"):
        zero_variance_fraction(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="rewards"):
        zero_variance_fraction(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="rewards"):
        zero_variance_fraction(t([1.0, 2.0]))
    with pytest.raises(ValueError, match="rewards"):
        zero_variance_fraction(t([[1.0, math.nan]]))
