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
from trajgrad.fused.chunking import BUFFERS, DEFAULT_BUDGET, auto_chunk_size, auto_tiles, resolve_chunk_size, resolve_tiles
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


# ---------------------------------------------------------------------------------------
# a trainable head: tiles of positions x VOCAB_BLOCK columns (vocab_chunk_size="auto")
# ---------------------------------------------------------------------------------------


def test_tiles_by_hand_at_the_benchmark_vocabulary():
    V = 151_936
    assert (chunking.VOCAB_BLOCK, chunking.TILE_BUDGET, chunking.TILE_BUFFERS) == (2048, 4 * MiB, 2)
    # floor(4 MiB / (2 * 2048 * 4 bytes)) = 256 positions of 2,048 columns
    assert auto_tiles(V, trainable_head=True) == (256, 2048)
    assert auto_tiles(V, trainable_head=True, dtype=torch.float64) == (128, 2048)
    assert auto_tiles(V, trainable_head=True, dtype=torch.bfloat16) == (256, 2048)   # statistics in float32
    assert auto_tiles(V, trainable_head=True, kind="entropy") == (256, 2048)
    # a frozen head, or a vocabulary of one block: the whole-vocabulary rule
    assert auto_tiles(V, trainable_head=False) == (320, V)
    assert auto_tiles(2048, trainable_head=True) == (auto_chunk_size(2048), 2048)
    assert auto_tiles(2049, trainable_head=True) == (256, 2048)
    # a lower budget shrinks the tiles; a higher one leaves them at TILE_BUDGET
    with chunk_budget(1 * MiB):
        assert auto_tiles(V, trainable_head=True) == (64, 2048)
    with chunk_budget(1024 * MiB):
        assert auto_tiles(V, trainable_head=True) == (256, 2048)
        assert auto_tiles(V, trainable_head=False) == (auto_chunk_size(V), V)
    with pytest.raises(ValueError, match="trainable_head"):
        auto_tiles(V, trainable_head=1)
    with pytest.raises(ValueError, match="kind"):
        auto_tiles(V, trainable_head=True, kind="mystery")


@settings(max_examples=50, deadline=None)
@given(V=st.integers(chunking.VOCAB_BLOCK + 1, 10 ** 7), mib=st.integers(1, 4096),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_tile_temporaries_fit_the_smaller_budget_unless_at_the_minimum(V, mib, dtype):
    c, block = auto_tiles(V, trainable_head=True, dtype=dtype, budget=mib * MiB)
    limit, elem = min(mib * MiB, chunking.TILE_BUDGET), (8 if dtype == torch.float64 else 4)
    assert block == chunking.VOCAB_BLOCK and chunking.MIN_CHUNK <= c <= chunking.MAX_CHUNK and c % chunking.ALIGN == 0
    if c > chunking.MIN_CHUNK:
        assert chunking.TILE_BUFFERS * c * block * elem <= limit
    assert chunking.TILE_BUFFERS * (c + chunking.ALIGN) * block * elem > limit


def test_resolve_tiles_values_and_errors():
    V = 5000
    assert resolve_tiles("auto", "auto", V, "logprob", torch.float32, True) == (256, 2048)
    assert resolve_tiles("auto", "auto", V, "logprob", torch.float32, False) == (auto_chunk_size(V), V)
    assert resolve_tiles(40, "auto", V, "logprob", torch.float32, True) == (40, 2048)
    assert resolve_tiles("auto", None, V, "logprob", torch.float32, True) == (auto_chunk_size(V), V)
    assert resolve_tiles("auto", 100, V, "logprob", torch.float32, True) == (auto_chunk_size(100), 100)
    assert resolve_tiles(7, 10 ** 6, V, "entropy", torch.float32, False) == (7, V)
    for bad in ("big", 0, -2, 1.5, True):
        with pytest.raises(ValueError, match="vocab_chunk_size"):
            resolve_tiles("auto", bad, V, "logprob", torch.float32, True)
    h, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        fused_token_logprobs(h, w, torch.zeros(2, 3, dtype=torch.long), vocab_chunk_size="whole")
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        fused_entropy(h, w, vocab_chunk_size=0)


def test_a_trainable_head_is_tiled_a_frozen_one_is_not():
    """The largest floating temporary: a [256, 2048] tile for a trainable head (beside its
    [V, H] gradient), one [rows, V] chunk for a frozen head and without a gradient."""
    torch.manual_seed(0)
    N, H, V = 600, 4, 5000
    hs = torch.randn(N, H, requires_grad=True)
    y = torch.randint(0, V, (N,))
    w_train = torch.randn(V, H, requires_grad=True)
    with _LargestFloat() as mode:
        fused_token_logprobs(hs, w_train, y).sum().backward()
    assert mode.largest == max(256 * 2048, V * H)
    with _LargestFloat() as mode:
        fused_entropy(hs, w_train).sum().backward()
    assert mode.largest == max(256 * 2048, V * H)
    with _LargestFloat() as mode:                            # frozen head: one chunk of all 600 rows
        fused_token_logprobs(hs, w_train.detach(), y).sum().backward()
    assert mode.largest == N * V
    with torch.no_grad(), _LargestFloat() as mode:
        fused_token_logprobs(hs, w_train, y)
    assert mode.largest == N * V
    with _LargestFloat() as mode:                            # None: the whole vocabulary, as asked
        fused_token_logprobs(hs, w_train, y, vocab_chunk_size=None).sum().backward()
    assert mode.largest == N * V


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), N=st.integers(1, 70), H=st.integers(1, 5),
       V=st.integers(chunking.VOCAB_BLOCK + 1, 2 * chunking.VOCAB_BLOCK + 50), with_bias=st.booleans(),
       temperature=st.sampled_from([0.7, 1.0]), rows_per_tile=st.sampled_from([16, 32, 128]))
def test_tiled_defaults_equal_the_naive_path(seed, N, H, V, with_bias, temperature, rows_per_tile):
    """The trainable-head default (tiles) against full float64 logits: log-probs, the
    entropies returned beside them, differentiable entropies, and the gradients w.r.t. the
    hidden states, the head weight and its bias; NaN in masked hidden rows stays out."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64) if with_bias else None
    y = torch.randint(0, V, (N,), generator=g)
    mask = torch.rand(N, generator=g) < 0.75
    h_in = torch.where(mask[:, None], h, torch.full_like(h, float("nan")))
    cot = torch.randn(N, generator=g, dtype=torch.float64)
    # a budget for `rows_per_tile` positions of 2,048 float64 columns (two buffers)
    budget = chunking.TILE_BUFFERS * rows_per_tile * chunking.VOCAB_BLOCK * 8

    def leaves(x):
        return [t.clone().requires_grad_(True) for t in ([x, w] + ([b] if b is not None else []))]

    ref_p = leaves(h)
    z = (ref_p[0] @ ref_p[1].T + (ref_p[2] if b is not None else 0.0)) / temperature
    lsm = z.log_softmax(-1)
    zero = torch.zeros((), dtype=torch.float64)
    ref_lp = torch.where(mask, lsm.gather(-1, y[:, None]).squeeze(-1), zero)
    ref_ent = torch.where(mask, -(lsm.exp() * lsm).sum(-1), zero)
    want_lp = torch.autograd.grad((ref_lp * cot).sum(), ref_p, retain_graph=True)
    want_ent = torch.autograd.grad((ref_ent * cot).sum(), ref_p)
    with chunk_budget(budget):
        assert auto_tiles(V, trainable_head=True, dtype=torch.float64) == (rows_per_tile, chunking.VOCAB_BLOCK)
        p = leaves(h_in)
        lp, ent = fused_token_logprobs(p[0], p[1], y, bias=p[2] if b is not None else None, temperature=temperature,
                                       mask=mask, with_entropy=True)
        got_lp = torch.autograd.grad((lp * cot).sum(), p)
        q = leaves(h_in)
        ent2 = fused_entropy(q[0], q[1], bias=q[2] if b is not None else None, temperature=temperature, mask=mask)
        got_ent = torch.autograd.grad((ent2 * cot).sum(), q)
    assert torch.allclose(lp, ref_lp, atol=1e-12, rtol=1e-11)
    assert torch.allclose(ent, ref_ent, atol=1e-12, rtol=1e-11) and not ent.requires_grad
    assert torch.allclose(ent2, ref_ent, atol=1e-12, rtol=1e-11)
    for got, want in ((got_lp, want_lp), (got_ent, want_ent)):
        for a, c in zip(got, want):
            assert torch.isfinite(a).all()
            assert torch.allclose(a, c, atol=1e-11, rtol=1e-10)
        assert (got[0][~mask] == 0).all()


def test_tiles_only_for_a_head_that_gets_a_gradient_on_the_cpu():
    from trajgrad.fused.positionwise import _tiled_head

    w = torch.randn(5, 4, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    assert _tiled_head(w, None) and _tiled_head(w.detach(), b) and not _tiled_head(w.detach(), b.detach())
    with torch.no_grad():
        assert not _tiled_head(w, b)
    assert not _tiled_head(torch.empty(5, 4, device="meta", requires_grad=True), None)   # not the CPU
