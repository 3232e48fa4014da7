r"""Confidence intervals and tests for held-out evaluation, without SciPy.

A success rate measured on ``n`` held-out tasks is a binomial proportion; a claim that
training helped must come with its uncertainty. This module gives

* :func:`wilson_interval`: the Wilson score interval of a proportion (good coverage even
  at 0 or n successes, where the Wald interval collapses to a point);
* :func:`mean_ci`: a Student-t interval for the mean of real values (rewards, lengths);
* :func:`two_proportion_test`: the pooled two-sided z-test of "before == after";
* :func:`mcnemar_exact_test`: McNemar's exact test of paired before/after outcomes on the
  same tasks (a binomial test on the discordant pairs).

Quantiles: the normal one from :class:`statistics.NormalDist`; Student's t by inverting
its CDF, written through the regularized incomplete beta function
(:math:`P(|T| > t) = I_{\nu/(\nu+t^2)}(\nu/2, 1/2)`), evaluated with its continued fraction.
"""
from __future__ import annotations

import math
import numbers
import statistics
from typing import Iterable, Tuple

__all__ = [
    "normal_quantile",
    "t_cdf",
    "t_quantile",
    "wilson_interval",
    "mean_ci",
    "two_proportion_test",
    "mcnemar_exact_test",
    "paired_counts",
]

_NORMAL = statistics.NormalDist()


def _check_probability(name: str, p, *, closed: bool = False) -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise ValueError(f"{name}: expected a number in (0, 1), got {p!r}")
    p = float(p)
    if not (0.0 < p < 1.0):
        raise ValueError(f"{name}: must lie in (0, 1), got {p}")
    return p


def _check_df(df) -> float:
    if isinstance(df, bool) or not isinstance(df, numbers.Real) or not (float(df) > 0) or math.isinf(df):
        raise ValueError(f"df: expected a positive finite number, got {df!r}")
    return float(df)


def _count(name: str, value) -> int:
    """A non-negative integer count; integral floats (e.g. a tensor sum) are accepted."""
    if hasattr(value, "item") and not isinstance(value, numbers.Number):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
    if isinstance(value, numbers.Integral):
        value = int(value)
    elif math.isfinite(value) and float(value).is_integer():
        value = int(value)
    else:
        raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {value}")
    return value


def normal_quantile(p: float) -> float:
    """Standard normal quantile :math:`\\Phi^{-1}(p)` for ``0 < p < 1``."""
    return _NORMAL.inv_cdf(_check_probability("p", p))


def _betainc_cf(a: float, b: float, x: float, y: float) -> float:
    """Continued fraction of I_x(a, b) (modified Lentz), y = 1 - x given separately for
    accuracy; converges fast for x < (a+1)/(a+b+2)."""
    tiny = 1e-300
    f, c, d = tiny, tiny, 0.0
    for j in range(1, 10_000):
        if j == 1:
            num = 1.0
        else:
            k = j - 1  # coefficient d_k
            m = k // 2
            if k % 2:  # odd k = 2m + 1
                num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
            else:  # even k = 2m
                num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + num * d
        d = tiny if abs(d) < tiny else d
        c = 1.0 + num / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = c * d
        f *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    # f = 1 / (1 + d_1 / (1 + d_2 / (1 + ...)))  (b_0 = 0 entered as ``tiny``)
    log_front = a * math.log(x) + b * math.log(y) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    return math.exp(log_front) * f / a


def _betainc(a: float, b: float, x: float, y: float) -> float:
    """Regularized incomplete beta function I_x(a, b), with y = 1 - x computed by the
    caller without cancellation."""
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    if x < (a + 1.0) / (a + b + 2.0):
        return _betainc_cf(a, b, x, y)
    return 1.0 - _betainc_cf(b, a, y, x)


def _t_two_sided_tail(t: float, df: float) -> float:
    """P(|T| > t) for t >= 0."""
    t2 = t * t
    if math.isinf(t2):
        return 0.0
    return _betainc(df / 2.0, 0.5, df / (df + t2), t2 / (df + t2))


def t_cdf(x: float, df: float) -> float:
    """CDF of Student's t distribution with ``df`` degrees of freedom."""
    df = _check_df(df)
    x = float(x)
    if math.isnan(x):
        raise ValueError("x: is NaN")
    if math.isinf(x):
        return 1.0 if x > 0 else 0.0
    tail = 0.5 * _t_two_sided_tail(abs(x), df)
    return 1.0 - tail if x > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Quantile of Student's t distribution: the x with ``t_cdf(x, df) == p``.

    Solved by bisection on the upper tail to about 1e-12 relative accuracy.
    """
    p = _check_probability("p", p)
    df = _check_df(df)
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    target = 2.0 * (1.0 - p)  # two-sided tail probability P(|T| > x)
    lo, hi = 0.0, 1.0
    while _t_two_sided_tail(hi, df) > target:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_two_sided_tail(mid, df) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return 0.5 * (lo + hi)


def _check_confidence(confidence) -> float:
    return _check_probability("confidence", confidence)


def wilson_interval(successes, n, confidence: float = 0.95) -> Tuple[float, float]:
    r"""Wilson score interval for a binomial proportion.

    .. math::
        \hat p = s / n,\quad z = \Phi^{-1}\!\big(1 - \tfrac{1 - c}{2}\big),\\
        \text{center} = \frac{\hat p + z^2/(2n)}{1 + z^2/n},\quad
        \text{half} = \frac{z}{1 + z^2/n}\sqrt{\frac{\hat p(1-\hat p)}{n} + \frac{z^2}{4n^2}}

    Args:
      successes: number of successes ``s`` (0 <= s <= n).
      n: number of trials (> 0).
      confidence: coverage ``c`` in (0, 1).

    Returns:
      ``(low, high)`` = ``(center - half, center + half)``, within [0, 1]; ``low`` is
      exactly 0 when ``s == 0`` and ``high`` exactly 1 when ``s == n``.
    """
    s = _count("successes", successes)
    n = _count("n", n)
    if n == 0:
        raise ValueError("n: must be positive (an empty evaluation has no interval)")
    if s > n:
        raise ValueError(f"successes: {s} exceeds n = {n}")
    z = normal_quantile(1.0 - (1.0 - _check_confidence(confidence)) / 2.0)
    p = s / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z2 / (4.0 * n * n))
    low = 0.0 if s == 0 else max(0.0, center - half)
    high = 1.0 if s == n else min(1.0, center + half)
    return low, high


def mean_ci(values: Iterable[float], confidence: float = 0.95) -> Tuple[float, float, float]:
    r"""Mean and Student-t confidence interval of the mean.

    .. math::
        \bar x \pm t_{(1+c)/2,\,n-1}\,\frac{s}{\sqrt n},\qquad
        s^2 = \frac{1}{n-1}\sum_i (x_i - \bar x)^2

    The t quantile (not the normal one) keeps the coverage right for the small ``n`` of a
    held-out evaluation; for large ``n`` it tends to the normal interval.

    Args:
      values: at least two finite numbers (a list, NumPy array or tensor; flattened).
      confidence: coverage ``c`` in (0, 1).

    Returns:
      ``(mean, low, high)``.
    """
    confidence = _check_confidence(confidence)
    if hasattr(values, "detach"):
        values = values.detach().cpu().reshape(-1).tolist()
    elif hasattr(values, "reshape") and hasattr(values, "tolist"):
        values = values.reshape(-1).tolist()
    try:
        xs = [float(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"values: expected numbers ({exc})") from None
    if len(xs) < 2:
        raise ValueError(f"values: need at least 2 values for an interval, got {len(xs)}")
    if not all(math.isfinite(v) for v in xs):
        raise ValueError("values: contains NaN or inf")
    n = len(xs)
    mean = math.fsum(xs) / n
    var = math.fsum((v - mean) ** 2 for v in xs) / (n - 1)
    half = t_quantile(1.0 - (1.0 - confidence) / 2.0, n - 1) * math.sqrt(var / n)
    return mean, mean - half, mean + half


def two_proportion_test(s1, n1, s2, n2) -> float:
    r"""Two-sided p-value of the pooled two-proportion z-test of :math:`p_1 = p_2`.

    .. math::
        \hat p = \frac{s_1 + s_2}{n_1 + n_2},\quad
        z = \frac{s_1/n_1 - s_2/n_2}{\sqrt{\hat p(1-\hat p)(1/n_1 + 1/n_2)}},\quad
        p\text{-value} = 2\,(1 - \Phi(|z|)) = \operatorname{erfc}(|z|/\sqrt 2)

    Use it for before/after held-out success rates on *independent* task samples (for the
    same tasks evaluated twice, a paired test is the right one). When every trial in both
    samples succeeded, or every one failed, the proportions are equal and the p-value is 1.
    """
    s1, n1 = _count("s1", s1), _count("n1", n1)
    s2, n2 = _count("s2", s2), _count("n2", n2)
    if n1 == 0:
        raise ValueError("n1: must be positive")
    if n2 == 0:
        raise ValueError("n2: must be positive")
    if s1 > n1:
        raise ValueError(f"s1: {s1} exceeds n1 = {n1}")
    if s2 > n2:
        raise ValueError(f"s2: {s2} exceeds n2 = {n2}")
    pooled = (s1 + s2) / (n1 + n2)
    var = pooled * (1.0 - pooled) * (1.0 / n1 + 1.0 / n2)
    if var == 0.0:
        return 1.0
    z = (s1 / n1 - s2 / n2) / math.sqrt(var)
    return math.erfc(abs(z) / math.sqrt(2.0))


def paired_counts(before, after) -> Tuple[int, int]:
    """The discordant pairs of paired 0/1 outcomes (task ``i`` before and after):
    ``(b, c)`` = (failed before and solved after, solved before and failed after).

    Raises ValueError when the sequences differ in length or hold anything but 0/1 (bools).
    """
    before, after = list(before), list(after)
    if len(before) != len(after):
        raise ValueError(f"after: {len(after)} outcomes, but before has {len(before)} (the same tasks are needed)")
    for name, xs in (("before", before), ("after", after)):
        bad = [x for x in xs if x not in (0, 1)]
        if bad:
            raise ValueError(f"{name}: outcomes must be 0/1 (or bools), got {bad[0]!r}")
    b = sum(1 for x, y in zip(before, after) if not x and y)
    c = sum(1 for x, y in zip(before, after) if x and not y)
    return b, c


def mcnemar_exact_test(b, c) -> float:
    r"""Two-sided p-value of McNemar's exact test from the discordant pair counts.

    ``b`` tasks failed before and succeeded after, ``c`` succeeded before and failed after
    (:func:`paired_counts`). Under "training changed nothing" each discordant pair goes
    either way with probability 1/2, so :math:`B \sim \mathrm{Bin}(b + c, 1/2)` and

    .. math::
        p = \min\Big(1,\ 2 \sum_{k=0}^{\min(b, c)} \binom{b+c}{k} 2^{-(b+c)}\Big),

    computed with exact integers (one rounding, at the final division). ``p = 1`` when
    there are no discordant pairs. Concordant pairs carry no information on the change.
    """
    b, c = _count("b", b), _count("c", c)
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)
