"""Tests for trajgrad.logprobs.ratios (spec §7, §16, §17, §23, §24)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.logprobs.ratios import (
    gspo_log_sequence_ratio,
    gspo_sequence_ratio,
    gspo_token_ratio,
    segment_log_ratios,
    sequence_log_ratio,
    token_log_ratio,
)

F64 = torch.float64
NAN, INF = math.nan, math.inf

# §23
OLD = torch.tensor([[-1.00, -0.50], [-0.20, -0.70]], dtype=F64)
CUR = torch.tensor([[-0.90, -0.60], [-0.10, -1.00]], dtype=F64)
MASK23 = torch.tensor([[1, 1], [1, 0]])

ALL_FNS = [token_log_ratio, sequence_log_ratio, gspo_log_sequence_ratio, gspo_sequence_ratio, gspo_token_ratio]


def random_case(seed: int, B=4, L=6, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=dtype) * 3
    old = logp + 0.3 * torch.randn(B, L, generator=g, dtype=dtype)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(dtype)
    mask[0, 0] = 0  # a masked hole (e.g. a tool observation) inside a response
    if B > 2:
        mask[2] = 0  # an all-padding row
    return logp, old, mask


# --------------------------------------------------------------------------- §23, §24


def test_spec23_ratios():
    ratio = token_log_ratio(CUR, OLD, MASK23).exp()
    valid = MASK23.bool()
    assert ratio[valid].tolist() == pytest.approx([1.10517, 0.90484, 1.10517], abs=5e-6)
    assert ratio[valid].tolist() == pytest.approx([math.exp(0.1), math.exp(-0.1), math.exp(0.1)], abs=1e-12)
    assert ratio[1, 1].item() == 1.0  # masked: log-ratio exactly 0


@pytest.mark.parametrize("fn", ALL_FNS)
def test_identity_gives_ratio_exactly_one(fn):
    logp, _, mask = random_case(0)
    out = fn(logp, logp.clone(), mask)
    one = 0.0 if fn in (token_log_ratio, sequence_log_ratio, gspo_log_sequence_ratio) else 1.0
    assert torch.equal(out, torch.full_like(out, one))


# --------------------------------------------------------------------------- sequence ratios


def test_sequence_log_ratio_is_log_of_product_of_token_ratios():
    logp, old, mask = random_case(1)
    got = sequence_log_ratio(logp, old, mask)
    for i in range(logp.shape[0]):
        prod = 1.0
        for j in range(logp.shape[1]):
            if mask[i, j]:
                prod *= math.exp(logp[i, j].item() - old[i, j].item())
        assert got[i].item() == pytest.approx(math.log(prod), abs=1e-12)


def test_gspo_sequence_ratio_is_geometric_mean_hand_example():
    # token ratios [2, 8] -> geometric mean sqrt(16) = 4; the exact sequence ratio is 16.
    logp = torch.tensor([[math.log(2.0), math.log(8.0), NAN], [math.log(3.0), NAN, NAN]], dtype=F64)
    old = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    s = gspo_sequence_ratio(logp, old, mask)
    exact = sequence_log_ratio(logp, old, mask).exp()
    assert s.tolist() == pytest.approx([4.0, 3.0], abs=1e-12)
    assert exact.tolist() == pytest.approx([16.0, 3.0], abs=1e-12)
    assert s[0] != exact[0]  # L > 1: not the density ratio
    assert s[1] == pytest.approx(exact[1].item(), abs=1e-15)  # L = 1: they coincide
    assert gspo_log_sequence_ratio(logp, old, mask).tolist() == pytest.approx([math.log(4.0), math.log(3.0)], abs=1e-12)


def test_empty_row_gives_zero_log_ratio():
    logp, old, mask = random_case(2)
    assert gspo_log_sequence_ratio(logp, old, mask)[2].item() == 0.0
    assert sequence_log_ratio(logp, old, mask)[2].item() == 0.0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_gspo_ratio_properties(seed):
    logp, old, mask = random_case(seed)
    lr = token_log_ratio(logp, old, mask)
    lengths = mask.sum(-1)
    log_s = gspo_log_sequence_ratio(logp, old, mask)
    # L_i log s_i = exact sequence log ratio
    torch.testing.assert_close(log_s * lengths, sequence_log_ratio(logp, old, mask), rtol=0, atol=1e-12)
    # a mean of the valid token log-ratios lies between their min and max
    valid = mask.bool()
    for i in range(logp.shape[0]):
        if valid[i].any():
            vals = lr[i][valid[i]]
            assert vals.min() - 1e-12 <= log_s[i] <= vals.max() + 1e-12
    # gspo_token_ratio equals s_i at every valid token, 1 elsewhere
    s = gspo_sequence_ratio(logp, old, mask)
    tok = gspo_token_ratio(logp, old, mask)
    expected = torch.where(valid, s[:, None].expand_as(tok), torch.ones_like(tok))
    torch.testing.assert_close(tok, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------- §17 gradients


def test_gspo_sequence_ratio_gradient_is_s_over_L():
    logp, old, mask = random_case(3)
    x = logp.clone().requires_grad_(True)
    s = gspo_sequence_ratio(x, old, mask)
    jac = torch.autograd.functional.jacobian(lambda z: gspo_sequence_ratio(z, old, mask), logp)  # [B, B, L]
    lengths = mask.sum(-1)
    B, L = logp.shape
    expected = torch.zeros(B, B, L, dtype=F64)
    for i in range(B):
        for t in range(L):
            if mask[i, t]:
                expected[i, i, t] = s[i].item() / lengths[i].item()  # d s_i / d logp_{i,t} = s_i / L_i
    torch.testing.assert_close(jac, expected, rtol=0, atol=1e-14)


def test_gspo_token_ratio_jacobian_is_diagonal_s_i():
    logp, old, mask = random_case(4)
    s = gspo_sequence_ratio(logp, old, mask)
    jac = torch.autograd.functional.jacobian(lambda z: gspo_token_ratio(z, old, mask), logp)  # [B, L, B, L]
    B, L = logp.shape
    expected = torch.zeros(B, L, B, L, dtype=F64)
    for i in range(B):
        for t in range(L):
            if mask[i, t]:
                expected[i, t, i, t] = s[i].item()  # d s_{i,t} / d logp_{i,t'} = s_i 1[t = t']
    torch.testing.assert_close(jac, expected, rtol=0, atol=1e-14)
    # contrast: the same values from the non-detached sequence ratio have a dense Jacobian
    dense = torch.autograd.functional.jacobian(
        lambda z: gspo_sequence_ratio(z, old, mask)[:, None].expand(B, L), logp
    )
    assert not torch.allclose(dense, expected)


def test_gspo_token_equals_gspo_for_uniform_advantages():
    # §17: averaging s_{i,t} A_i over a response's tokens reproduces s_i A_i in value AND gradient
    logp, old, mask = random_case(5)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.7], dtype=F64)
    valid = mask.bool()
    lengths = mask.sum(-1).clamp_min(1)
    nonempty = valid.any(-1)  # an all-padding row has s_i = 1 but no response to weigh

    def seq_obj(z):
        return torch.where(nonempty, gspo_sequence_ratio(z, old, mask) * adv, torch.zeros_like(adv)).sum()

    def tok_obj(z):
        per_tok = torch.where(valid, gspo_token_ratio(z, old, mask) * adv[:, None], torch.zeros_like(z))
        return (per_tok.sum(-1) / lengths).sum()

    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    ja, jb = seq_obj(a), tok_obj(b)
    ja.backward()
    jb.backward()
    torch.testing.assert_close(ja, jb, rtol=0, atol=1e-14)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-14)


def test_gradcheck():
    logp, old, mask = random_case(6)
    x = logp.clone().requires_grad_(True)
    # gspo_token_ratio is excluded: by design (stop-gradient) its gradient is not the
    # derivative of its value; its Jacobian is checked against §17 above.
    for fn in (token_log_ratio, sequence_log_ratio, gspo_log_sequence_ratio, gspo_sequence_ratio):
        assert torch.autograd.gradcheck(lambda z, fn=fn: fn(z, old, mask), (x,))
    ids = torch.randint(0, 3, logp.shape, generator=torch.Generator().manual_seed(0))
    assert torch.autograd.gradcheck(lambda z: segment_log_ratios(z, old, mask, ids, 3), (x,))


def test_token_log_ratio_gradient_is_mask():
    logp, old, mask = random_case(7)
    x = logp.clone().requires_grad_(True)
    token_log_ratio(x, old, mask).sum().backward()
    assert torch.equal(x.grad, mask)


# --------------------------------------------------------------------------- §16 segments


def test_segment_log_ratios_two_behaviour_policies():
    # One trajectory: turn 0 (2 tokens) sampled by mu_0, a tool observation (masked), then
    # turn 1 (2 tokens) sampled by mu_1. Each token carries its own segment's old log-prob.
    logp = torch.tensor([[-1.0, -2.0, NAN, -0.5, -0.25]], dtype=F64)
    old = torch.tensor([[-1.5, -1.0, INF, -0.75, -1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    seg = torch.tensor([[0, 0, -7, 1, 1]])  # any id at a masked slot
    per_segment, per_token = segment_log_ratios(logp, old, mask, seg)
    # seg 0: (-1 + 1.5) + (-2 + 1) = -0.5 ; seg 1: (-0.5 + 0.75) + (-0.25 + 1) = 1.0
    assert per_segment.tolist() == [[-0.5, 1.0]]
    assert per_token.tolist() == [[-0.5, -0.5, 0.0, 1.0, 1.0]]
    # the single-checkpoint ratio would mix the two behaviours: its log is the total 0.5
    assert sequence_log_ratio(logp, old, mask).item() == pytest.approx(0.5, abs=1e-15)
    # explicit num_segments pads with empty segments
    per_segment3, _ = segment_log_ratios(logp, old, mask, seg, num_segments=3)
    assert per_segment3.tolist() == [[-0.5, 1.0, 0.0]]


def test_segment_log_ratios_random_against_loops():
    logp, old, mask = random_case(8)
    ids = torch.randint(0, 3, logp.shape, generator=torch.Generator().manual_seed(1))
    per_segment, per_token = segment_log_ratios(logp, old, mask, ids, 3)
    B, L = logp.shape
    for i in range(B):
        sums = [0.0, 0.0, 0.0]
        for t in range(L):
            if mask[i, t]:
                sums[int(ids[i, t])] += logp[i, t].item() - old[i, t].item()
        assert per_segment[i].tolist() == pytest.approx(sums, abs=1e-12)
        for t in range(L):
            want = sums[int(ids[i, t])] if mask[i, t] else 0.0
            assert per_token[i, t].item() == pytest.approx(want, abs=1e-12)


def test_segment_ids_bad_input():
    logp, old, mask = random_case(9)
    ids = torch.zeros(logp.shape, dtype=torch.long)
    bad = ids.clone()
    bad[1, 0] = -1  # valid position (row 1 starts valid)
    assert mask[1, 0] == 1
    with pytest.raises(ValueError, match="segment_ids"):
        segment_log_ratios(logp, old, mask, bad)
    with pytest.raises(ValueError, match="segment_ids"):
        segment_log_ratios(logp, old, mask, ids.float())
    with pytest.raises(ValueError, match="segment_ids"):
        segment_log_ratios(logp, old, mask, ids.bool())
    with pytest.raises(ValueError, match="segment_ids"):
        segment_log_ratios(logp, old, mask, ids[:, :-1])
    too_big = ids.clone()
    too_big[1, 0] = 2
    with pytest.raises(ValueError, match="segment_ids"):
        segment_log_ratios(logp, old, mask, too_big, num_segments=2)


# --------------------------------------------------------------------------- masked slots, detach, shapes


def _poison(x, mask, value):
    return torch.where(mask.bool(), x, torch.full_like(x, value))


@pytest.mark.parametrize("poison", [NAN, INF, -INF])
@pytest.mark.parametrize("fn", ALL_FNS + ["segments"])
def test_poison_in_masked_slots_changes_nothing(fn, poison):
    logp, old, mask = random_case(10)
    ids = torch.randint(0, 2, logp.shape, generator=torch.Generator().manual_seed(2))

    def run(lp, ol):
        x = lp.clone().requires_grad_(True)
        if fn == "segments":
            out = segment_log_ratios(x, ol, mask, ids)[1]
        else:
            out = fn(x, ol, mask)
        w = torch.linspace(0.5, 1.5, out.numel(), dtype=F64).reshape(out.shape)
        (out * w).sum().backward()
        return out.detach(), x.grad

    ref = run(logp, old)
    got = run(_poison(logp, mask, poison), _poison(old, mask, -poison if poison == poison else poison))
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert bool(torch.isfinite(got[0]).all()) and bool(torch.isfinite(got[1]).all())
    assert bool((got[1][~mask.bool()] == 0).all())  # masked positions give no gradient


@pytest.mark.parametrize("fn", ALL_FNS + ["segments"])
def test_old_logp_is_detached(fn):
    logp, old, mask = random_case(11)
    x = logp.clone().requires_grad_(True)
    o = old.clone().requires_grad_(True)
    if fn == "segments":
        out = segment_log_ratios(x, o, mask, torch.zeros(logp.shape, dtype=torch.long))[0]
    else:
        out = fn(x, o, mask)
    out.sum().backward()
    assert o.grad is None
    assert x.grad is not None


@pytest.mark.parametrize("fn", ALL_FNS)
def test_bad_input_raises_naming_the_argument(fn):
    logp, old, mask = random_case(12)
    with pytest.raises(ValueError, match="old_logp"):
        fn(logp, old[:, :-1], mask)
    with pytest.raises(ValueError, match="mask"):
        fn(logp, old, mask[:, :-1])
    with pytest.raises(ValueError, match="logp"):
        fn(logp[0], old[0], mask[0])
    with pytest.raises(ValueError, match="logp"):
        fn(logp.long(), old, mask)
    with pytest.raises(ValueError, match="mask"):
        fn(logp, old, mask * 0.5)
    bad = logp.clone()
    bad[1, 0] = NAN
    with pytest.raises(ValueError, match="logp"):
        fn(bad, old, mask)
    bad_old = old.clone()
    bad_old[1, 0] = INF
    with pytest.raises(ValueError, match="old_logp"):
        fn(logp, bad_old, mask)


def test_segment_log_ratios_empty_sequence_dimension():
    z = torch.zeros(2, 0, dtype=F64)
    per_segment, per_token = segment_log_ratios(z, z, torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.long))
    assert per_segment.shape == (2, 1) and per_token.shape == (2, 0)
