"""Tests for trajgrad.aggregate (spec §13, §23, §24)."""
from __future__ import annotations

import math
import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.aggregate import MODES, Normalizer, aggregate, local_count, masked_mean

F64 = torch.float64
NAN, INF = math.nan, math.inf


def ragged_case(seed: int, B=5, L=7):
    """Random per-token terms with a ragged 0/1 mask: holes, an empty row, NaN/inf in padding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, generator=g, dtype=F64)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(F64)
    mask = mask * (torch.rand(B, L, generator=g) > 0.2).to(F64)  # holes (tool observations)
    mask[0, 0] = 1.0
    if B > 3:
        mask[3] = 0.0  # an all-padding row
    poison = torch.tensor([NAN, INF, -INF], dtype=F64)
    idx = torch.randint(0, 3, (B, L), generator=g)
    x = torch.where(mask.bool(), x, poison[idx])
    return x, mask


def hand_formula(x, mask, mode, constant=None):
    """The five modes written out with Python loops over sequences and tokens."""
    B, L = mask.shape
    rows = [[x[i, j].item() for j in range(L) if mask[i, j]] for i in range(B)]
    nonempty = [r for r in rows if r]
    n_tokens = sum(len(r) for r in rows)
    if mode == "token_mean":
        return sum(sum(r) for r in rows) / max(n_tokens, 1)
    if mode == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in nonempty) / max(len(nonempty), 1)
    if mode == "seq_mean_token_sum":
        return sum(sum(r) for r in nonempty) / max(len(nonempty), 1)
    if mode == "seq_sum_constant":
        c = L if constant is None else constant
        return sum(sum(r) for r in nonempty) / (c * max(len(nonempty), 1))
    if mode == "token_sum":
        return sum(sum(r) for r in rows)
    raise AssertionError(mode)


def kw_for(mode):
    # an explicit constant keeps seq_sum_constant invariant to the padded width
    return {"constant": 6.0} if mode == "seq_sum_constant" else {}


# --------------------------------------------------------------------------- formulas


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_modes_equal_hand_formula(mode, seed):
    x, mask = ragged_case(seed)
    got = aggregate(x, mask, mode)
    assert got.item() == pytest.approx(hand_formula(x, mask, mode), abs=1e-13)
    got_c = aggregate(x, mask.bool(), mode, **kw_for(mode))
    assert got_c.item() == pytest.approx(hand_formula(x, mask, mode, kw_for(mode).get("constant")), abs=1e-13)


def test_spec23_token_mean():
    surrogates = torch.tensor([[1.10517, 0.90484], [-0.55259, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    assert aggregate(surrogates, mask, "token_mean").item() == pytest.approx(0.48581, abs=5e-6)
    # the masked 4th token is in neither numerator nor denominator
    assert aggregate(surrogates, mask, "token_mean").item() == pytest.approx((1.10517 + 0.90484 - 0.55259) / 3, abs=1e-15)
    assert local_count(mask, "token_mean").item() == 3.0
    for v in (0.0, 1e6, -INF):
        s2 = surrogates.clone()
        s2[1, 1] = v
        assert aggregate(s2, mask, "token_mean").item() == aggregate(surrogates, mask, "token_mean").item()


def test_empty_mask_gives_zero_and_zero_gradient():
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    for mode in MODES:
        out = aggregate(x, torch.zeros(3, 4), mode)
        out.backward()
        assert out.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x))
        x.grad = None


def test_masked_mean():
    x, mask = ragged_case(3)
    assert masked_mean(x, mask).item() == pytest.approx(hand_formula(x, mask, "token_mean"), abs=1e-13)


# --------------------------------------------------------------------------- §13 weights


def test_spec13_token_vs_sequence_weights():
    L = 100
    mask = torch.zeros(2, L)
    mask[0, :10] = 1
    mask[1, :100] = 1
    x = torch.full((2, L), 0.7, dtype=F64, requires_grad=True)

    def grads(mode, **kw):
        x.grad = None
        aggregate(x, mask, mode, **kw).backward()
        return x.grad.clone()

    g = grads("token_mean")  # every token 1/110
    assert torch.allclose(g[mask.bool()], torch.full((110,), 1 / 110, dtype=F64), rtol=0, atol=1e-15)
    short, long = g[0].sum().item(), g[1].sum().item()
    assert long / short == pytest.approx(10.0, abs=1e-12)  # the long sequence weighs 10x

    g = grads("seq_mean_token_mean")  # token weight 1 / (B L_i): 1/20 and 1/200
    assert torch.allclose(g[0, :10], torch.full((10,), 1 / 20, dtype=F64), rtol=0, atol=1e-15)
    assert torch.allclose(g[1], torch.full((100,), 1 / 200, dtype=F64), rtol=0, atol=1e-15)
    assert g[0].sum().item() == pytest.approx(0.5, abs=1e-14)
    assert g[1].sum().item() == pytest.approx(0.5, abs=1e-14)  # each sequence weighs the same

    g = grads("seq_mean_token_sum")  # every token 1/B
    assert torch.allclose(g[mask.bool()], torch.full((110,), 0.5, dtype=F64), rtol=0, atol=1e-15)

    g = grads("seq_sum_constant", constant=200.0)  # every token 1/(C B)
    assert torch.allclose(g[mask.bool()], torch.full((110,), 1 / 400, dtype=F64), rtol=0, atol=1e-15)
    assert torch.equal(g[~mask.bool()], torch.zeros(90, dtype=F64))


# --------------------------------------------------------------------------- §24 repacking


def repack(x, mask, *, extra_rows, extra_cols, seed):
    """Append all-padding rows and padding columns, shift each row right, permute rows."""
    g = torch.Generator().manual_seed(seed)
    B, L = mask.shape
    X = torch.full((B + extra_rows, L + extra_cols), NAN, dtype=x.dtype)
    M = torch.zeros(B + extra_rows, L + extra_cols, dtype=mask.dtype)
    shifts = torch.randint(0, extra_cols + 1, (B,), generator=g)
    for i in range(B):
        s = int(shifts[i])
        X[i, s : s + L] = x[i]
        M[i, s : s + L] = mask[i]
    perm = torch.randperm(B + extra_rows, generator=g)
    return X[perm], M[perm]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_padding_and_repacking_leave_every_mode_unchanged(mode, seed):
    x, mask = ragged_case(seed)
    ref = aggregate(x, mask, mode, **kw_for(mode))
    X, M = repack(x, mask, extra_rows=3, extra_cols=4, seed=seed)
    got = aggregate(X, M, mode, **kw_for(mode))
    assert got.item() == pytest.approx(ref.item(), abs=1e-14)


def test_seq_sum_constant_default_constant_is_the_padded_width():
    # Documented: C defaults to the padded length L. Extra padding columns therefore change
    # the default-constant loss by L / (L + extra); pass constant= for invariance.
    x, mask = ragged_case(1)
    X, M = repack(x, mask, extra_rows=0, extra_cols=5, seed=0)
    L = mask.shape[1]
    a = aggregate(x, mask, "seq_sum_constant").item()
    b = aggregate(X, M, "seq_sum_constant").item()
    assert b == pytest.approx(a * L / (L + 5), abs=1e-14)


# --------------------------------------------------------------------------- §13/§24 micro-batches


def _split_rows(B, cuts):
    bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [B]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    cuts=st.lists(st.booleans(), min_size=7, max_size=7),
    mode=st.sampled_from(MODES),
)
def test_micro_batches_with_normalizer_equal_full_batch(seed, cuts, mode):
    B = 8
    x, mask = ragged_case(seed, B=B)
    kw = kw_for(mode)
    full_x = x.clone().requires_grad_(True)
    full = aggregate(full_x, mask, mode, **kw)
    full.backward()

    parts = _split_rows(B, cuts)
    norm = Normalizer.from_masks([mask[a:b] for a, b in parts], mode, **kw)
    assert norm.global_count().item() == local_count(mask, mode).item()
    mb_x = x.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for a, b in parts:  # one backward per micro-batch: gradients accumulate
        loss = aggregate(mb_x[a:b], mask[a:b], mode, denominator=norm.denominator(), **kw)
        loss.backward()
        total = total + loss.detach()
    assert total.item() == pytest.approx(full.item(), abs=1e-13)
    torch.testing.assert_close(mb_x.grad, full_x.grad, rtol=0, atol=1e-14)
    # Normalizer.aggregate is the same thing
    again = sum(norm.aggregate(x[a:b], mask[a:b]) for a, b in parts)
    assert again.item() == pytest.approx(full.item(), abs=1e-13)


def test_averaging_local_losses_differs_when_counts_differ():
    # micro-batch 1: one token of value 1; micro-batch 2: three tokens of value 0.
    # global token mean = 1/4; the mean of local means = (1 + 0) / 2 = 1/2.
    x1, m1 = torch.tensor([[1.0, NAN, NAN]], dtype=F64), torch.tensor([[1, 0, 0]])
    x2, m2 = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64), torch.tensor([[1, 1, 1]])
    local = (aggregate(x1, m1) + aggregate(x2, m2)) / 2
    norm = Normalizer.from_masks([m1, m2])
    glob = aggregate(x1, m1, denominator=norm.denominator()) + aggregate(x2, m2, denominator=norm.denominator())
    assert local.item() == 0.5
    assert glob.item() == 0.25
    full = aggregate(torch.cat([x1, x2]), torch.cat([m1, m2]))
    assert glob.item() == full.item()


def test_local_averaging_gives_wrong_gradient_on_random_ragged_batches():
    x, mask = ragged_case(4, B=6)
    a = x.clone().requires_grad_(True)
    aggregate(a, mask, "token_mean").backward()
    b = x.clone().requires_grad_(True)
    ((aggregate(b[:2], mask[:2]) + aggregate(b[2:], mask[2:])) / 2).backward()
    assert mask[:2].sum() != mask[2:].sum()
    assert not torch.allclose(a.grad, b.grad)


# --------------------------------------------------------------------------- masked slots


@pytest.mark.parametrize("mode", MODES)
def test_poison_in_masked_slots_changes_nothing(mode):
    x, mask = ragged_case(5)
    clean = torch.where(mask.bool(), x, torch.zeros_like(x)).requires_grad_(True)
    dirty = x.clone().requires_grad_(True)
    assert not bool(torch.isfinite(dirty[~mask.bool()]).all())
    w = torch.linspace(-1, 1, x.numel(), dtype=F64).reshape(x.shape)
    lc = aggregate(clean * w, mask, mode)
    ld = aggregate(dirty * w, mask, mode)  # NaN*w stays NaN at masked slots
    lc.backward()
    ld.backward()
    assert torch.isfinite(ld) and ld.item() == lc.item()
    assert torch.equal(dirty.grad, clean.grad) and bool(torch.isfinite(dirty.grad).all())
    assert bool((dirty.grad[~mask.bool()] == 0).all())


# --------------------------------------------------------------------------- bad input


def test_bad_input_raises_naming_the_argument():
    x, mask = ragged_case(0)
    with pytest.raises(ValueError, match="mode"):
        aggregate(x, mask, "mean")
    with pytest.raises(ValueError, match="constant"):
        aggregate(x, mask, "token_mean", constant=5.0)
    with pytest.raises(ValueError, match="constant"):
        aggregate(x, mask, "seq_sum_constant", constant=0.0)
    with pytest.raises(ValueError, match="mask"):
        aggregate(x, mask * 0.5)
    with pytest.raises(ValueError, match="mask"):
        aggregate(x, mask * 2)
    with pytest.raises(ValueError, match="mask"):
        aggregate(x, mask[:, :-1])
    with pytest.raises(ValueError, match="per_token"):
        aggregate(x[None], mask[None])
    with pytest.raises(ValueError, match="per_token"):
        aggregate(x[0], mask[0])
    with pytest.raises(ValueError, match="per_token"):
        aggregate(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3))
    bad = x.clone()
    bad[0, 0] = NAN  # mask[0, 0] == 1
    with pytest.raises(ValueError, match="per_token"):
        aggregate(bad, mask)
    for d in (0, -1.0, NAN):
        with pytest.raises(ValueError, match="denominator"):
            aggregate(x, mask, denominator=d)
    with pytest.raises(ValueError, match="denominator"):
        aggregate(x, mask, denominator=torch.ones(2))
    with pytest.raises(ValueError, match="mode"):
        Normalizer("mean")
    with pytest.raises(ValueError, match="constant"):
        Normalizer("seq_mean_token_sum", constant=3.0)
    norm = Normalizer()
    norm.add(mask)
    norm.denominator()
    with pytest.raises(ValueError, match="mask"):
        norm.add(mask)
    norm.reset()
    norm.add(mask)
    assert norm.local_count == mask.sum().item()


# --------------------------------------------------------------------------- torch.distributed


def _ddp_data():
    g = torch.Generator().manual_seed(1234)
    B, L, F = 7, 6, 3
    feats = torch.randn(B, L, F, generator=g, dtype=F64)
    lengths = torch.tensor([6, 1, 4, 0, 3, 5, 2])
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(F64)
    mask[2, 1] = 0.0
    return feats, mask


# rank -> its micro-batches (row ranges); rank 0 holds 7 tokens, rank 1 holds 12
_RANK_MICRO_BATCHES = {0: [(0, 1), (1, 2)], 1: [(2, 4), (4, 7)]}


def _ddp_worker(rank: int, world: int, init_file: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        feats, mask = _ddp_data()
        mbs = _RANK_MICRO_BATCHES[rank]
        for mode in MODES:
            kw = kw_for(mode)
            torch.manual_seed(0)
            ref_model = torch.nn.Linear(feats.shape[-1], 1, bias=False, dtype=F64)
            model = torch.nn.Linear(feats.shape[-1], 1, bias=False, dtype=F64)
            model.load_state_dict(ref_model.state_dict())
            ddp = DDP(model)

            norm = Normalizer(mode, **kw)
            for a, b in mbs:
                norm.add(mask[a:b])
            assert norm.global_count().item() == local_count(mask, mode).item(), mode
            d = norm.denominator()  # D_global / world: DDP averages gradients
            assert d.item() == pytest.approx(local_count(mask, mode).clamp_min(1).item() / world)

            loss = sum(aggregate(ddp(feats[a:b]).squeeze(-1), mask[a:b], mode, denominator=d, **kw) for a, b in mbs)
            loss.backward()  # DDP all-reduces and averages the gradient over the 2 ranks

            full = aggregate(ref_model(feats).squeeze(-1), mask, mode, **kw)
            full.backward()
            torch.testing.assert_close(model.weight.grad, ref_model.weight.grad, rtol=0, atol=1e-13)
            summed = loss.detach().clone()
            dist.all_reduce(summed)
            assert summed.item() / world == pytest.approx(full.item(), abs=1e-13), mode

            if mode == "token_mean":  # locally normalized losses, DDP-averaged: a different gradient
                model.weight.grad = None
                local = sum(aggregate(ddp(feats[a:b]).squeeze(-1), mask[a:b], mode) for a, b in mbs) / len(mbs)
                local.backward()
                assert not torch.allclose(model.weight.grad, ref_model.weight.grad)
            del ddp
        # both ranks done before either tears its process group down: a rank whose peer has
        # already closed the gloo connections can abort in the teardown (seen once under load)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # end without the interpreter's teardown, where gloo's worker threads can abort the process
    # (trajgrad.train.run.end_distributed_worker); only reached when every check passed
    os._exit(0)


def test_normalizer_under_torch_distributed_gloo(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    init_file = str(tmp_path / "rendezvous")
    ctx = mp.spawn(_ddp_worker, args=(2, init_file), nprocs=2, join=False)
    deadline = time.monotonic() + 90.0
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail("the 2-process gloo run did not finish in 90 s")


# --------------------------------------------------------------------------- token_sum
def test_token_sum_value_and_gradient_by_hand():
    # valid entries 1.5, -2.0 (row 0) and 4.0 (row 1): Σ m x = 3.5, ∂/∂x = m
    x = torch.tensor([[1.5, -2.0, NAN], [INF, 4.0, -INF]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    out = aggregate(x, mask, "token_sum")
    assert out.item() == 3.5
    out.backward()
    assert torch.equal(x.grad, mask.to(F64))


def test_token_sum_denominator_expresses_fixed_normalizers():
    x, mask = ragged_case(11, B=6, L=5)
    valid = torch.where(mask.bool(), x, torch.zeros_like(x))
    # verl seq-mean-token-sum-norm: Σ m x / C, not divided by the number of responses
    assert aggregate(x, mask, "token_sum", denominator=5.0).item() == pytest.approx(valid.sum().item() / 5.0, abs=1e-14)
    # TRL dr_grpo: Σ m x / (B · max_completion_length), every row counted
    d = 6 * 16
    assert aggregate(x, mask, "token_sum", denominator=d).item() == pytest.approx(valid.sum().item() / d, abs=1e-14)
    # and seq_sum_constant is token_sum divided by (C · non-empty rows)
    n = local_count(mask, "seq_sum_constant").item()
    assert aggregate(x, mask, "seq_sum_constant", constant=5.0).item() == pytest.approx(
        aggregate(x, mask, "token_sum", denominator=5.0 * n).item(), abs=1e-14)


def test_token_sum_normalizer_is_one():
    masks = [torch.ones(2, 3), torch.zeros(1, 3), torch.tensor([[1.0, 0.0, 1.0]])]
    norm = Normalizer.from_masks(masks, "token_sum", grad_average_over_ranks=False)
    assert norm.denominator().item() == 1.0
    assert local_count(masks[0], "token_sum").item() == 1.0


# ------------------------------------------------------------------ infinite normalizers
@pytest.mark.parametrize("bad", [INF, -INF, NAN])
@pytest.mark.parametrize("mode", MODES)
def test_infinite_or_nan_denominator_raises(bad, mode):
    x, mask = ragged_case(2)
    with pytest.raises(ValueError, match="denominator"):
        aggregate(x, mask, mode, denominator=bad, **kw_for(mode))


@pytest.mark.parametrize("bad", [INF, NAN, 0.0, -1.0])
def test_infinite_constant_raises(bad):
    x, mask = ragged_case(2)
    with pytest.raises(ValueError, match="constant"):
        aggregate(x, mask, "seq_sum_constant", constant=bad)
    with pytest.raises(ValueError, match="constant"):
        Normalizer("seq_sum_constant", constant=bad)


def test_ppo_clip_loss_rejects_infinite_denominator_and_constant():
    from trajgrad.losses import ppo_clip_loss

    logp = -torch.rand(2, 3, dtype=F64)
    mask = torch.ones(2, 3)
    adv = torch.ones(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="denominator"):
        ppo_clip_loss(logp, logp, adv, mask, denominator=INF)
    with pytest.raises(ValueError, match="constant"):
        ppo_clip_loss(logp, logp, adv, mask, aggregation="seq_sum_constant", constant=INF)
