"""trajgrad.advantages.credit: turn rewards at turn ends, action indices, terminal masks, bootstrap values."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.advantages import credit
from trajgrad.advantages.baselines import broadcast_to_tokens

# row 0: prompt, turn 0 (2 tokens), observation, turn 1 (1 token), pad
# row 1: turn 0 (3 tokens), pad
# row 2: no action token
MASK = torch.tensor([[0, 1, 1, 0, 0, 1, 0],
                     [1, 1, 1, 0, 0, 0, 0],
                     [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
TURN_IDS = torch.tensor([[-1, 0, 0, 0, -1, 1, -1],
                         [0, 0, 0, -1, -1, -1, -1],
                         [-1, -1, -1, -1, -1, -1, -1]])
TURN_MASK = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=torch.bool)


def test_action_indices_by_hand():
    assert credit.last_action_index(MASK).tolist() == [5, 2, -1]
    assert credit.first_action_index(MASK).tolist() == [1, 0, -1]
    assert credit.turn_end_positions(MASK, TURN_IDS, 2).tolist() == [[2, 5], [2, -1], [-1, -1]]


def test_place_turn_rewards_by_hand_and_nan_at_invalid_turns():
    r = torch.tensor([[0.5, 2.0], [-1.0, float("nan")], [float("inf"), float("nan")]], dtype=torch.float64)
    out = credit.place_turn_rewards(r, MASK, TURN_IDS, TURN_MASK)
    expect = torch.zeros(3, 7, dtype=torch.float64)
    expect[0, 2], expect[0, 5], expect[1, 2] = 0.5, 2.0, -1.0
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    assert out.dtype == torch.float64 and not out.requires_grad


def test_place_turn_rewards_rejects_nan_at_a_valid_turn():
    r = torch.tensor([[float("nan"), 1.0], [0.0, 0.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="turn_rewards"):
        credit.place_turn_rewards(r, MASK, TURN_IDS, TURN_MASK)


def test_terminal_masks_by_hand():
    term = torch.tensor([True, False, True])
    tok = credit.terminal_token_mask(MASK, term)
    expect = torch.zeros(3, 7, dtype=torch.bool)
    expect[0, 5] = True
    assert torch.equal(tok, expect)
    assert credit.terminal_turn_mask(TURN_MASK, term).tolist() == [[False, True], [False, False], [False, False]]


def test_bootstrap_values_cases_and_gradient():
    mask = torch.tensor([[0, 1, 1, 0],     # row 0: compacted, continues in row 2
                         [1, 1, 0, 0],     # row 1: terminated
                         [0, 0, 1, 1],     # row 2: truncated
                         [0, 0, 0, 0]], dtype=torch.bool)
    values = torch.arange(16, dtype=torch.float64).reshape(4, 4)
    values = torch.where(mask, values, torch.full_like(values, float("nan"))).requires_grad_(True)
    term = torch.tensor([False, True, False, False])
    nxt = torch.tensor([2, -1, -1, -1])
    boot = credit.bootstrap_values(values, mask, term, nxt)
    assert boot.tolist() == [10.0, 0.0, 11.0, 0.0]  # next's first value, 0, own last value, 0 (no action)
    boot.sum().backward()
    g = torch.zeros(4, 4, dtype=torch.float64)
    g[2, 2] = 1.0
    g[2, 3] = 1.0
    torch.testing.assert_close(values.grad, g, rtol=0, atol=0)


def test_bootstrap_a_next_row_without_actions_counts_as_absent():
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    values = torch.tensor([[1.0, 2.0], [float("nan"), float("nan")]])
    boot = credit.bootstrap_values(values, mask, torch.tensor([False, False]), torch.tensor([1, -1]))
    assert boot.tolist() == [2.0, 0.0]


@pytest.mark.parametrize("call, name", [
    (lambda: credit.last_action_index(torch.ones(3, dtype=torch.bool)), "mask"),
    (lambda: credit.first_action_index(torch.tensor([[0.5, 1.0]])), "mask"),
    (lambda: credit.turn_end_positions(MASK, TURN_IDS.float(), 2), "turn_ids"),
    (lambda: credit.turn_end_positions(MASK, TURN_IDS, 1), "turn_ids"),
    (lambda: credit.turn_end_positions(MASK, TURN_IDS[:, :3], 2), "turn_ids"),
    (lambda: credit.turn_end_positions(MASK, TURN_IDS, -1), "num_turns"),
    (lambda: credit.place_turn_rewards(torch.zeros(2, 2), MASK, TURN_IDS), "turn_rewards"),
    (lambda: credit.place_turn_rewards(torch.zeros(3, 2, dtype=torch.long), MASK, TURN_IDS), "turn_rewards"),
    (lambda: credit.place_turn_rewards(torch.zeros(3, 2), MASK, TURN_IDS, torch.ones(3, 3)), "turn_mask"),
    (lambda: credit.terminal_token_mask(MASK, torch.tensor([True, False])), "terminated"),
    (lambda: credit.terminal_turn_mask(TURN_MASK, torch.tensor([2, 0, 0])), "terminated"),
    (lambda: credit.bootstrap_values(torch.zeros(3, 7, dtype=torch.long), MASK, torch.zeros(3, dtype=torch.bool),
                                     torch.full((3,), -1)), "values"),
    (lambda: credit.bootstrap_values(torch.zeros(3, 6), MASK, torch.zeros(3, dtype=torch.bool),
                                     torch.full((3,), -1)), "values"),
    (lambda: credit.bootstrap_values(torch.zeros(3, 7), MASK, torch.zeros(3, dtype=torch.bool),
                                     torch.tensor([3, -1, -1])), "next_rows"),
    (lambda: credit.bootstrap_values(torch.zeros(3, 7), MASK, torch.zeros(3, dtype=torch.bool),
                                     torch.tensor([0, -1, -1])), "next_rows"),
    (lambda: credit.bootstrap_values(torch.zeros(3, 7), MASK, torch.zeros(3, dtype=torch.bool),
                                     torch.tensor([-1.0, -1, -1])), "next_rows"),
])
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        call()


# ------------------------------------------------------------------ properties
@st.composite
def rows(draw):
    """Random episodes laid out like a collated batch: prompt, then (action span, observation
    span) per turn, then padding; some turns have an empty action."""
    B = draw(st.integers(1, 4))
    K = draw(st.integers(1, 4))
    L = draw(st.integers(1, 4)) + K * 5
    mask = torch.zeros(B, L, dtype=torch.bool)
    ids = torch.full((B, L), -1, dtype=torch.long)
    turn_mask = torch.zeros(B, K, dtype=torch.bool)
    for b in range(B):
        pos = draw(st.integers(0, 2))
        n_turns = draw(st.integers(0, K))
        for k in range(n_turns):
            turn_mask[b, k] = True
            a = draw(st.integers(0, 2))
            mask[b, pos:pos + a] = True
            ids[b, pos:pos + a + 1] = k  # an observation token may carry the turn id too
            pos += a + draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**16))
    return mask, ids, turn_mask, seed


@settings(max_examples=60, deadline=None)
@given(rows())
def test_place_turn_rewards_inverts_broadcast_to_tokens(case):
    mask, ids, turn_mask, seed = case
    B, K = turn_mask.shape
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(B, K, generator=gen, dtype=torch.float64)
    ends = credit.turn_end_positions(mask, ids, K)
    valid = (ends >= 0) & turn_mask
    r_nan = torch.where(valid, r, torch.full_like(r, float("nan")))  # never read
    placed = credit.place_turn_rewards(r_nan, mask, ids, turn_mask)
    assert torch.isfinite(placed).all()
    # reading the placed tensor at the turn ends gives the turn rewards back
    rows_ = torch.arange(B)[:, None].expand(B, K)
    torch.testing.assert_close(placed[rows_[valid], ends[valid]], r[valid], rtol=0, atol=0)
    # it equals the broadcast turn values at turn-end tokens, 0 elsewhere
    is_end = torch.zeros_like(mask)
    is_end[rows_[valid], ends[valid]] = True
    broad = broadcast_to_tokens(torch.where(valid, r, 0.0), ids, mask)
    torch.testing.assert_close(placed, torch.where(is_end, broad, torch.zeros_like(broad)), rtol=0, atol=0)
    # summing the tokens of each turn recovers the turn reward (nothing lost, nothing doubled)
    for k in range(K):
        per_turn = torch.where(mask & (ids == k), placed, 0.0).sum(1)
        torch.testing.assert_close(per_turn, torch.where(valid[:, k], r[:, k], 0.0), rtol=0, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(rows(), st.data())
def test_indices_agree_with_a_loop_and_bootstrap_ignores_masked_values(case, data):
    mask, ids, _turn_mask, seed = case
    B, L = mask.shape
    last = credit.last_action_index(mask)
    first = credit.first_action_index(mask)
    for b in range(B):
        js = [j for j in range(L) if mask[b, j]]
        assert int(last[b]) == (js[-1] if js else -1)
        assert int(first[b]) == (js[0] if js else -1)
    term = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B, max_size=B)))
    nxt = torch.tensor([data.draw(st.sampled_from([-1] + [n for n in range(B) if n != b])) for b in range(B)])
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(B, L, generator=gen, dtype=torch.float64)
    junk = torch.where(mask, v, torch.full_like(v, float("nan")))
    junk_inf = torch.where(mask, v, torch.full_like(v, float("inf")))
    boot = credit.bootstrap_values(junk, mask, term, nxt)
    torch.testing.assert_close(boot, credit.bootstrap_values(junk_inf, mask, term, nxt), rtol=0, atol=0)
    torch.testing.assert_close(boot, credit.bootstrap_values(v, mask, term, nxt), rtol=0, atol=0)
    assert torch.isfinite(boot).all()
    tok = credit.terminal_token_mask(mask, term)
    assert not (tok & ~mask).any()
    assert tok.sum(1).tolist() == [int(bool(term[b]) and int(last[b]) >= 0) for b in range(B)]
