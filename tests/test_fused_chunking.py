"""chunk_size="auto": the chunk rule of trajgrad.fused.chunking, its overrides, and that every
chunked function gives the same values and gradients whatever the chunk."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from trajgrad.fused import (
    Head,
    chunk_budget,
    fused_entropy,
    fused_token_logprobs,
    get_chunk_budget,
    set_chunk_budget,
    weighted_divergence,
)
from trajgrad.fused import chunking
from trajgrad.fused.chunking import BUFFERS, DEFAULT_BUDGET, auto_chunk_size, resolve_chunk_size
from trajgrad.losses import (
    forward_kl_distill_loss,
    jsd_distill_loss,
    multi_teacher_distill_loss,
    reverse_kl_distill_loss,
)

MiB = 2 ** 20


def test_rule_by_hand_at_the_benchmark_vocabulary():
    V = 151_936
    # floor(192 MiB / (k * V * 4 bytes)), rounded down to a multiple of 16
    assert DEFAULT_BUDGET == 192 * MiB
    assert auto_chunk_size(V, kind="reverse_kl") == (192 * MiB // (2 * V * 4)) // 16 * 16 == 160
    assert auto_chunk_size(V, kind="logprob") == 320
    assert auto_chunk_size(V, kind="entropy") == 160
    assert auto_chunk_size(V, kind="forward_kl") == 160
    assert auto_chunk_size(V, kind="jsd") == 32
    assert auto_chunk_size(V, kind="reverse_kl", dtype=torch.float64) == 80
    assert auto_chunk_size(V, kind="reverse_kl", dtype=torch.bfloat16) == 160   # statistics in float32
    assert auto_chunk_size(7, kind="reverse_kl") == chunking.MAX_CHUNK
    assert auto_chunk_size(10 ** 9, kind="jsd") == chunking.MIN_CHUNK


@settings(max_examples=50, deadline=None)
@given(V=st.integers(1, 10 ** 7), kind=st.sampled_from(sorted(BUFFERS)), mib=st.integers(1, 4096))
def test_temporaries_fit_the_budget_unless_at_the_minimum(V, kind, mib):
    c = auto_chunk_size(V, kind=kind, budget=mib * MiB)
    assert chunking.MIN_CHUNK <= c <= chunking.MAX_CHUNK and c % chunking.ALIGN == 0
    if c > chunking.MIN_CHUNK:
        assert BUFFERS[kind] * c * V * 4 <= mib * MiB
    if c < chunking.MAX_CHUNK:                      # and the next aligned size would not fit
        assert BUFFERS[kind] * (c + chunking.ALIGN) * V * 4 > mib * MiB


def test_budget_overrides(monkeypatch):
    V = 151_936
    assert get_chunk_budget() == DEFAULT_BUDGET
    with chunk_budget(512 * MiB):
        assert auto_chunk_size(V, kind="reverse_kl") == 432
    assert get_chunk_budget() == DEFAULT_BUDGET
    monkeypatch.setenv(chunking.ENV_VAR, "128")
    assert get_chunk_budget() == 128 * MiB and auto_chunk_size(V, kind="reverse_kl") == 96
    set_chunk_budget(1024 * MiB)                     # code wins over the environment
    try:
        assert auto_chunk_size(V, kind="reverse_kl") == 880
    finally:
        set_chunk_budget(None)
    monkeypatch.setenv(chunking.ENV_VAR, "lots")
    with pytest.raises(ValueError, match=chunking.ENV_VAR):
        get_chunk_budget()


def test_bad_budgets_and_chunk_sizes():
    for bad in (0, -1, float("nan"), float("inf"), "1GB", True):
        with pytest.raises(ValueError, match="budget"):
            set_chunk_budget(bad)
    with pytest.raises(ValueError, match="kind"):
        auto_chunk_size(10, kind="mystery")
    for bad in ("big", 0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            resolve_chunk_size(bad, 10, "logprob", torch.float32)
    h, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_token_logprobs(h, w, torch.zeros(2, 3, dtype=torch.long), chunk_size="big")
    with pytest.raises(ValueError, match="chunk_size"):
        reverse_kl_distill_loss(student_hidden=h, student_weight=w, teacher_logits=torch.randn(2, 3, 5),
                                mask=torch.ones(2, 3), chunk_size=0)


class _LargestFloat(TorchDispatchMode):
    """Records the largest floating tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False):            # views allocate nothing
            return out
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


def test_auto_chunks_follow_the_budget_in_the_kernels():
    """With a budget of 16 rows for the reverse KL, no temporary exceeds 16 rows of the vocabulary
    (the KLs' two [chunk, V] buffers and their two small sweep blocks included)."""
    torch.manual_seed(0)
    N, H, V = 64, 8, 1024
    hs = torch.randn(N, H, requires_grad=True)
    ws = torch.randn(V, H, requires_grad=True)
    zt = torch.randn(N, V)
    y = torch.randint(0, V, (N,))
    rows, omega = torch.arange(N), torch.full((N,), 1.0 / N)
    with chunk_budget(2 * 16 * V * 4):                       # 16 rows for the reverse KL, 32 for log-probs
        assert auto_chunk_size(V, kind="reverse_kl") == 16
        with _LargestFloat() as mode:
            loss = weighted_divergence(Head(hs, ws), [(Head(zt), rows, omega)])[0]
            loss.backward()
        assert mode.largest <= max(16 * V, V * H)           # the [V, H] head gradient aside
        with _LargestFloat() as mode:
            fused_token_logprobs(hs, ws, y).sum().backward()
        assert 16 * V < mode.largest <= max(32 * V, V * H)
    with _LargestFloat() as mode:                            # the default budget: one chunk of all 64 rows
        weighted_divergence(Head(hs, ws), [(Head(zt), rows, omega)])[0].backward()
    assert mode.largest == N * V


@pytest.mark.parametrize("kind", ["logprob", "entropy", "reverse_kl", "forward_kl", "jsd", "multi"])
def test_auto_equals_explicit_chunks(kind):
    g = torch.Generator().manual_seed(1)
    B, L, H, V = 2, 37, 6, 50
    hs = torch.randn(B, L, H, generator=g, dtype=torch.float64)
    ws = torch.randn(V, H, generator=g, dtype=torch.float64)
    zt = torch.randn(B, L, V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) < 0.8

    def run(chunk):
        h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        if kind == "logprob":
            out = fused_token_logprobs(h, w, y, mask=mask, chunk_size=chunk).sum()
        elif kind == "entropy":
            out = fused_entropy(h, w, mask=mask, chunk_size=chunk).sum()
        elif kind == "multi":
            out = multi_teacher_distill_loss(student_hidden=h, student_weight=w, teachers=[zt, zt.flip(-1)],
                                             mask=mask, weights="entropy", chunk_size=chunk).loss
        else:
            fn = {"reverse_kl": reverse_kl_distill_loss, "forward_kl": forward_kl_distill_loss,
                  "jsd": jsd_distill_loss}[kind]
            out = fn(student_hidden=h, student_weight=w, teacher_logits=zt, mask=mask, chunk_size=chunk).loss
        return (out,) + torch.autograd.grad(out, [h, w])

    with chunk_budget(16 * V * 8 * 8):                     # small: several chunks per call
        auto = run("auto")
    for chunk in (1, 7, 1000):
        for a, b in zip(auto, run(chunk)):
            assert torch.allclose(a, b, atol=1e-12, rtol=1e-10)
    assert math.isfinite(float(auto[0].detach()))
