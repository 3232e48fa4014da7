"""stats: quantiles against closed forms, intervals and tests against hand computations."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.stats import (
    mcnemar_exact_test,
    mean_ci,
    normal_quantile,
    t_cdf,
    t_quantile,
    paired_counts,
    two_proportion_test,
    wilson_interval,
)

Z975 = 1.959963984540054  # Phi^{-1}(0.975), the familiar 1.96


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


# ------------------------------------------------------------------------ quantiles


def test_normal_quantile():
    assert normal_quantile(0.975) == pytest.approx(Z975, abs=1e-12)
    assert normal_quantile(0.5) == 0.0
    for p in (0.001, 0.1, 0.3, 0.8, 0.999):
        assert _phi(normal_quantile(p)) == pytest.approx(p, abs=1e-12)


def _t4_quantile(p: float) -> float:
    # Closed form for 4 degrees of freedom: with a = 4p(1-p),
    # q = cos(arccos(sqrt a) / 3) / sqrt a and t = sign(p - 1/2) * 2 sqrt(q - 1).
    a = 4.0 * p * (1.0 - p)
    q = math.cos(math.acos(math.sqrt(a)) / 3.0) / math.sqrt(a)
    return math.copysign(2.0 * math.sqrt(q - 1.0), p - 0.5)


@settings(max_examples=40, deadline=None)
@given(st.floats(min_value=1e-4, max_value=1 - 1e-4))
def test_t_quantile_closed_forms(p):
    # df = 1 is the Cauchy distribution: F(x) = 1/2 + atan(x)/pi, so x = tan(pi (p - 1/2)).
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9, abs=1e-12)
    # df = 2: F(x) = 1/2 + x / (2 sqrt(2 + x^2)), so x = (2p - 1) / sqrt(2 p (1 - p)).
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9, abs=1e-12)
    assert t_quantile(p, 4) == pytest.approx(_t4_quantile(p), rel=1e-9, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.floats(min_value=-50, max_value=50), st.sampled_from([1, 2, 3, 7.5, 30, 200]))
def test_t_cdf_and_quantile_are_inverse(x, df):
    assert t_cdf(x, 1) == pytest.approx(0.5 + math.atan(x) / math.pi, abs=1e-12)
    assert t_cdf(x, 2) == pytest.approx(0.5 + x / (2 * math.sqrt(2 + x * x)), abs=1e-12)
    assert t_cdf(-x, df) == pytest.approx(1.0 - t_cdf(x, df), abs=1e-12)
    p = t_cdf(x, df)
    if 1e-9 < p < 1 - 1e-9:
        assert t_quantile(p, df) == pytest.approx(x, rel=1e-7, abs=1e-7)


def test_t_quantile_table_and_normal_limit():
    # Two-sided 95% critical values from a printed t table.
    table = {3: 3.182446, 10: 2.228139, 30: 2.042272, 100: 1.983972}
    for df, value in table.items():
        assert t_quantile(0.975, df) == pytest.approx(value, abs=5e-7)
    assert t_quantile(0.975, 1e7) == pytest.approx(Z975, abs=1e-6)
    values = [t_quantile(0.975, df) for df in (1, 2, 5, 20, 1000)]
    assert values == sorted(values, reverse=True) and values[-1] > Z975


# ------------------------------------------------------------------------ Wilson


def test_wilson_hand_computed():
    # s = 8, n = 10, z = 1.959964:  z^2 = 3.841459, 1 + z^2/n = 1.384146
    # center = (0.8 + 3.841459/20) / 1.384146 = 0.992073 / 1.384146 = 0.716740
    # half   = 1.959964 / 1.384146 * sqrt(0.8*0.2/10 + 3.841459/400)
    #        = 1.416009 * sqrt(0.0256036) = 1.416009 * 0.160011 = 0.226577
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.716740 - 0.226577, abs=2e-6)
    assert high == pytest.approx(0.716740 + 0.226577, abs=2e-6)


@pytest.mark.parametrize("n", [1, 10, 57])
def test_wilson_edges(n):
    # s = 0: center = half = z^2 / (2 (n + z^2)), so the interval is [0, z^2 / (n + z^2)].
    z2 = Z975**2
    assert wilson_interval(0, n) == (0.0, pytest.approx(z2 / (n + z2), rel=1e-12))
    # s = n mirrors it: [n / (n + z^2), 1].
    assert wilson_interval(n, n) == (pytest.approx(n / (n + z2), rel=1e-12), 1.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 500).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))), st.sampled_from([0.8, 0.9, 0.95, 0.99]))
def test_wilson_properties(sn, confidence):
    s, n = sn
    low, high = wilson_interval(s, n, confidence)
    assert 0.0 <= low <= s / n <= high <= 1.0
    mlow, mhigh = wilson_interval(n - s, n, confidence)
    assert low == pytest.approx(1.0 - mhigh, abs=1e-12)  # symmetric under s -> n - s
    assert high == pytest.approx(1.0 - mlow, abs=1e-12)
    wider = wilson_interval(s, n, 0.999)
    assert wider[0] <= low + 1e-15 and wider[1] >= high - 1e-15


def test_wilson_accepts_integral_floats_and_tensors():
    assert wilson_interval(torch.tensor(8.0), 10) == wilson_interval(8, 10)
    assert wilson_interval(np.int64(8), 10.0) == wilson_interval(8, 10)


# ------------------------------------------------------------------------ mean CI


def test_mean_ci_hand_computed():
    # 1..5: mean 3, s^2 = (4+1+0+1+4)/4 = 2.5, s/sqrt(n) = sqrt(0.5) = 0.7071068,
    # t_{0.975, 4} = 2.7764451 (closed form above); half = 1.9632432.
    mean, low, high = mean_ci([1, 2, 3, 4, 5])
    assert mean == 3.0
    assert low == pytest.approx(3.0 - 1.9632432, abs=1e-7)
    assert high == pytest.approx(3.0 + 1.9632432, abs=1e-7)
    # Two values 0 and 2 at 90%: s = sqrt(2), se = 1, t_{0.95,1} = tan(0.45 pi) = 6.3137515.
    assert mean_ci(torch.tensor([0.0, 2.0]), 0.9) == pytest.approx((1.0, 1 - 6.3137515, 1 + 6.3137515), abs=1e-7)
    assert mean_ci(np.full((2, 3), 4.0)) == (4.0, 4.0, 4.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=30))
def test_mean_ci_properties(values):
    mean, low, high = mean_ci(values)
    assert mean == pytest.approx(float(np.mean(values)), abs=1e-9)
    assert low <= mean + 1e-9 and mean <= high + 1e-9
    assert (mean - low) == pytest.approx(high - mean, abs=1e-9)
    shifted = mean_ci([v + 10.0 for v in values])
    assert shifted[2] - shifted[1] == pytest.approx(high - low, abs=1e-6)


# ------------------------------------------------------------------------ two proportions


def test_two_proportion_hand_computed():
    # 45/100 vs 60/100: pooled 105/200 = 0.525, var = 0.525 * 0.475 * (1/100 + 1/100) = 0.0049875,
    # z = -0.15 / 0.0706222 = -2.123977, p = 2 (1 - Phi(2.123977)) = 0.033672.
    p = two_proportion_test(45, 100, 60, 100)
    assert p == pytest.approx(0.033672, abs=2e-6)
    assert p == pytest.approx(2 * (1 - _phi(0.15 / math.sqrt(0.0049875))), abs=1e-12)
    # 30/50 vs 30/50: identical proportions give z = 0 and p = 1.
    assert two_proportion_test(30, 50, 30, 50) == pytest.approx(1.0)
    # All successes (or all failures) in both samples: no variance, equal proportions.
    assert two_proportion_test(10, 10, 20, 20) == 1.0
    assert two_proportion_test(0, 10, 0, 20) == 1.0


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(1, 300), st.data())
def test_two_proportion_properties(n1, n2, data):
    s1 = data.draw(st.integers(0, n1))
    s2 = data.draw(st.integers(0, n2))
    p = two_proportion_test(s1, n1, s2, n2)
    assert 0.0 <= p <= 1.0
    assert p == pytest.approx(two_proportion_test(s2, n2, s1, n1), abs=1e-15)
    assert p == pytest.approx(two_proportion_test(n1 - s1, n1, n2 - s2, n2), abs=1e-12)


def test_two_proportion_more_difference_less_p():
    ps = [two_proportion_test(50, 100, s2, 100) for s2 in (50, 55, 60, 70, 90)]
    assert ps == sorted(ps, reverse=True) and ps[-1] < 1e-6


# ------------------------------------------------------------------------ bad input


def test_bad_input():
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(2.5, 10)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(-1, 10)
    with pytest.raises(ValueError, match="n"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(1, 2, confidence=1.0)
    with pytest.raises(ValueError, match="confidence"):
        mean_ci([1.0, 2.0], confidence=0)
    with pytest.raises(ValueError, match="values"):
        mean_ci([1.0])
    with pytest.raises(ValueError, match="values"):
        mean_ci([1.0, float("nan")])
    with pytest.raises(ValueError, match="values"):
        mean_ci(["a", "b"])
    with pytest.raises(ValueError, match="s1"):
        two_proportion_test(-1, 10, 1, 10)
    with pytest.raises(ValueError, match="n2"):
        two_proportion_test(1, 10, 0, 0)
    with pytest.raises(ValueError, match="s2"):
        two_proportion_test(1, 10, 11, 10)
    with pytest.raises(ValueError, match="df"):
        t_quantile(0.9, 0)
    with pytest.raises(ValueError, match="p"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="p"):
        normal_quantile(0.0)
    with pytest.raises(ValueError, match="x"):
        t_cdf(float("nan"), 3)


# ------------------------------------------------------------------------ McNemar's exact test


def test_mcnemar_hand_computed():
    # b + c = 5, all one way: 2 * (1/2)^5
    assert mcnemar_exact_test(0, 5) == 2 / 32
    # b + c = 10, min 1: 2 * (C(10,0) + C(10,1)) / 2^10 = 22 / 1024
    assert mcnemar_exact_test(1, 9) == pytest.approx(22 / 1024, rel=1e-15)
    assert mcnemar_exact_test(9, 1) == mcnemar_exact_test(1, 9)
    # 0/64 -> 62/64: 62 discordant pairs, all improvements
    assert mcnemar_exact_test(62, 0) == pytest.approx(2.0 ** -61, rel=1e-15)
    assert mcnemar_exact_test(3, 3) == 1.0  # the doubled tail exceeds 1: capped
    assert mcnemar_exact_test(0, 0) == 1.0  # no discordant pair: no evidence either way
    # b + c = 20, min 5: 2 * sum_{k<=5} C(20,k) / 2^20 = 2 * 21700 / 1048576
    assert mcnemar_exact_test(15, 5) == pytest.approx(2 * 21700 / 2**20, rel=1e-15)


def test_mcnemar_against_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for b, c in [(0, 5), (1, 9), (15, 5), (30, 12), (7, 7), (40, 1)]:
        assert mcnemar_exact_test(b, c) == pytest.approx(scipy_stats.binomtest(b, b + c, 0.5).pvalue, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 60), st.integers(0, 60))
def test_mcnemar_properties(b, c):
    p = mcnemar_exact_test(b, c)
    assert 0.0 < p <= 1.0
    assert p == mcnemar_exact_test(c, b)
    if b != c and b + c > 0:  # one more pair in the majority direction: stronger evidence
        hi, lo = max(b, c), min(b, c)
        assert mcnemar_exact_test(hi + 1, lo) <= p
    # the enumeration of the binomial's two tails at least as extreme as (b, c)
    n, k = b + c, min(b, c)
    extreme = sum(math.comb(n, j) for j in range(n + 1) if min(j, n - j) <= k)
    assert p == pytest.approx(min(1.0, extreme / 2**n), rel=1e-12)


def test_paired_counts():
    before = [0, 0, 1, 1, 0, True]
    after = [1, 0, 0, 1, 1, False]
    assert paired_counts(before, after) == (2, 2)
    assert paired_counts([0] * 64, [1] * 62 + [0] * 2) == (62, 0)
    with pytest.raises(ValueError, match="after"):
        paired_counts([0, 1], [1])
    with pytest.raises(ValueError, match="before"):
        paired_counts([0, 0.5], [1, 1])
    with pytest.raises(ValueError, match="b"):
        mcnemar_exact_test(-1, 3)
    with pytest.raises(ValueError, match="c"):
        mcnemar_exact_test(1, 2.5)
