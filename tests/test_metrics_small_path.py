"""The interpreter path of the loss metrics (small inputs) against the tensor path, key by key."""
import math

import pytest
import torch

from trajgrad import _policy_stats
from trajgrad._policy_stats import _fast_policy_metrics


def _both(z, adv, maskf, lo_b=None, hi_b=None):
    n = maskf.sum()
    small = _fast_policy_metrics(z, adv, None, maskf, n, lo_b=lo_b, hi_b=hi_b)
    old = _policy_stats._SMALL
    _policy_stats._SMALL = -1  # force the tensor path
    try:
        big = _fast_policy_metrics(z, adv, None, maskf, n, lo_b=lo_b, hi_b=hi_b)
    finally:
        _policy_stats._SMALL = old
    return small, big


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bounds", [(None, None), (math.log(0.8), math.log(1.2))])
def test_small_path_equals_the_tensor_path(seed, bounds):
    g = torch.Generator().manual_seed(seed)
    B, L = 7, 9
    maskf = (torch.rand(B, L, generator=g) > 0.4).double()
    if seed == 0:
        maskf[2] = 0.0  # an empty row
    if seed == 1:
        maskf.zero_()  # nothing valid
    z = torch.randn(B, L, generator=g, dtype=torch.float64) * 0.4 * maskf
    adv = torch.randn(B, L, generator=g, dtype=torch.float64).sign() * maskf
    small, big = _both(z, adv, maskf, *bounds)
    assert set(small) == set(big)
    for k in big:
        assert small[k].dtype == big[k].dtype and small[k].ndim == 0, k
        assert torch.allclose(small[k], big[k], rtol=1e-12, atol=1e-15), (k, small[k], big[k])


def test_small_path_overflow_and_float32():
    maskf = torch.tensor([[1.0, 1.0, 0.0]])
    z = torch.tensor([[800.0, -3.0, 0.0]], dtype=torch.float64)
    small, big = _both(z, torch.zeros_like(z), maskf)
    assert small["ratio/max"] == math.inf == big["ratio/max"] and small["ratio/mean"] == math.inf
    z32 = torch.tensor([[0.1, -0.2, 0.0]])
    small, big = _both(z32, torch.tensor([[1.0, -1.0, 0.0]]), maskf, math.log(0.85), math.log(1.05))
    for k in big:
        assert small[k].dtype == torch.float32
        assert torch.allclose(small[k], big[k], rtol=1e-6, atol=1e-7), k
    assert small["clip_frac/pos_high"] == 0.5 and small["clip_frac/neg_low"] == 0.5
