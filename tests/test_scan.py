"""Tests for trajgrad.advantages._scan: the backward affine scan against a plain loop."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.advantages import _scan

F64 = torch.float64


def loop_scan(d, c):
    """A_t = d_t + c_t A_{t+1}, A_T = 0, one step at a time."""
    out = torch.zeros_like(d)
    nxt = torch.zeros(d.shape[:-1], dtype=d.dtype)
    cc = c if isinstance(c, torch.Tensor) else torch.full_like(d, c)
    for t in reversed(range(d.shape[-1])):
        nxt = d[..., t] + cc[..., t] * nxt
        out[..., t] = nxt
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lead=st.sampled_from([(), (1,), (3,), (2, 3)]),
       length=st.integers(0, 300), p_zero=st.sampled_from([0.0, 0.05, 0.5]), p_one=st.sampled_from([0.0, 0.3]),
       number=st.floats(0, 1))
def test_scan_matches_loop(seed, lead, length, p_zero, p_one, number):
    gen = torch.Generator().manual_seed(seed)
    shape = lead + (length,)
    d = torch.randn(shape, generator=gen, dtype=F64)
    c = torch.rand(shape, generator=gen, dtype=F64)
    c = torch.where(torch.rand(shape, generator=gen) < p_zero, 0.0, c)
    c = torch.where(torch.rand(shape, generator=gen) < p_one, 1.0, c)
    d0, c0 = d.clone(), c.clone()
    torch.testing.assert_close(_scan.suffix_affine_scan(d, c), loop_scan(d, c), rtol=0, atol=1e-10)
    torch.testing.assert_close(_scan.suffix_affine_scan(d, number), loop_scan(d, number), rtol=0, atol=1e-10)
    assert torch.equal(d, d0) and torch.equal(c, c0)  # the out-of-place form leaves its inputs alone


def test_in_place_scan_on_strided_views_and_long_rows():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 2 * 5000 + 1, generator=gen, dtype=F64)
    d = base[:, ::2]  # non-contiguous input: the repacked levels must write back into it
    c = torch.rand(d.shape, generator=gen, dtype=F64)
    expected = loop_scan(d.clone(), c.clone())
    out = _scan.suffix_affine_scan_(d, c)
    assert out.data_ptr() == d.data_ptr()
    torch.testing.assert_close(d, expected, rtol=0, atol=1e-10)
    # 131,072 steps with c = 0.95 and c = 1: no under- or overflow
    n = 131_072
    d = torch.randn(1, n, generator=gen, dtype=F64)
    dl = d[0].tolist()
    for rate in (0.95, 1.0):
        expected, nxt = [0.0] * n, 0.0
        for t in range(n - 1, -1, -1):
            nxt = dl[t] + rate * nxt
            expected[t] = nxt
        out = _scan.suffix_affine_scan(d, rate)
        torch.testing.assert_close(out[0], torch.tensor(expected, dtype=F64), rtol=0, atol=1e-9)


def test_number_scan_equals_tensor_scan():
    gen = torch.Generator().manual_seed(1)
    d = torch.randn(4, 1023, generator=gen, dtype=F64)
    a = _scan.suffix_affine_scan(d, 0.97)
    b = _scan.suffix_affine_scan(d, torch.full_like(d, 0.97))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert torch.equal(_scan.suffix_affine_scan(d, 0.0), d)
