"""Tests for trajgrad.advantages: REINFORCE++, MaxRL, GDPO (checked against the peers' forms written out)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.advantages import gdpo_advantages, maxrl_advantages, reinforce_pp_advantages, reinforce_pp_token_advantages
from trajgrad.advantages.baselines import group_advantages

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def _verl_whiten(values, mask):
    m = mask.to(values.dtype)
    mean = (values * m).sum() / m.sum()
    var = (((values - mean) ** 2) * m).sum() / (m.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8) * m


def _right_padded_mask(lengths, L):
    return torch.arange(L)[None, :] < torch.as_tensor(lengths)[:, None]


# ----------------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_hand_value():
    # R = [1, 2, 3, 6]: mean 3, Σ(R - 3)^2 = 14, unbiased var 14/3
    res = reinforce_pp_advantages(t([1.0, 2.0, 3.0, 6.0]), eps=0.0)
    s = math.sqrt(14.0 / 3.0)
    assert torch.allclose(res.advantages, t([-2 / s, -1 / s, 0.0, 3 / s]), atol=1e-15)
    # response-level: mean 0, unbiased var 1 (up to eps)
    assert res.advantages.sum().abs().item() < 1e-14


def test_reinforce_pp_baseline_with_lengths_equals_verl_token_whitening():
    """verl reinforce_plus_plus_baseline: score - group mean, tiled to the tokens, masked_whiten over tokens."""
    g = torch.Generator().manual_seed(0)
    N, G, L = 3, 4, 9
    rewards = torch.randint(0, 2, (N, G), generator=g).to(F64) + 0.1 * torch.randn(N, G, generator=g, dtype=F64)
    lengths = torch.randint(1, L + 1, (N * G,), generator=g)
    mask = _right_padded_mask(lengths, L)
    centred = rewards - rewards.mean(1, keepdim=True)
    ref = _verl_whiten(centred.flatten()[:, None].expand(N * G, L), mask)
    ours = reinforce_pp_advantages(rewards, group_baseline=True, lengths=lengths.view(N, G)).advantages
    assert torch.allclose(ours.flatten()[:, None].expand(N * G, L)[mask], ref[mask], atol=1e-12)
    # without lengths every response weighs one (the paper's response-level form)
    plain = reinforce_pp_advantages(rewards, group_baseline=True, eps=0.0).advantages
    assert torch.allclose(plain, centred / centred.std(), atol=1e-13)
    # ragged groups give the same
    ids = torch.arange(N).repeat_interleave(G)
    ragged = reinforce_pp_advantages(rewards.flatten(), group_baseline=True, group_ids=ids, eps=0.0).advantages
    assert torch.allclose(ragged, plain.flatten(), atol=1e-14)


def test_reinforce_pp_token_level_equals_verl_loop():
    """verl reinforce_plus_plus: running return over tokens (γ), reset after the mask, whitened over tokens."""
    g = torch.Generator().manual_seed(1)
    B, L, gamma = 5, 7, 0.9
    lengths = torch.tensor([7, 3, 5, 1, 6])
    mask = _right_padded_mask(lengths, L)
    kl = 0.05 * torch.randn(B, L, generator=g, dtype=F64)  # per-token -β k in the reward
    r = torch.where(mask, -kl, torch.zeros_like(kl))
    r[torch.arange(B), lengths - 1] += torch.randn(B, generator=g, dtype=F64)  # outcome at the last token
    returns = torch.zeros_like(r)
    running = torch.zeros(B, dtype=F64)
    for j in reversed(range(L)):
        running = r[:, j] + gamma * running
        returns[:, j] = running
        running = running * mask[:, j]
    ref = _verl_whiten(returns, mask)
    ours = reinforce_pp_token_advantages(r, mask, gamma=gamma)
    assert torch.allclose(ours[mask], ref[mask], atol=1e-12)
    assert torch.equal(ours[~mask], torch.zeros_like(ours[~mask]))


def test_reinforce_pp_bad_input():
    with pytest.raises(ValueError, match="group_ids"):
        reinforce_pp_advantages(t([1.0, 2.0]), group_baseline=True)
    with pytest.raises(ValueError, match="lengths"):
        reinforce_pp_advantages(t([1.0, 2.0]), lengths=t([1.0]))
    with pytest.raises(ValueError, match="lengths"):
        reinforce_pp_advantages(t([1.0, 2.0]), lengths=t([1.0, -1.0]))
    with pytest.raises(ValueError, match="rewards"):
        reinforce_pp_advantages(t([1.0, math.nan]))
    with pytest.raises(ValueError, match="rewards"):
        reinforce_pp_advantages(t([1.0]))  # one response: no unbiased batch variance
    with pytest.raises(ValueError, match="eps"):
        reinforce_pp_advantages(t([1.0, 2.0]), eps=-1.0)


def test_reinforce_pp_constant_batch_is_zero():
    res = reinforce_pp_advantages(t([[1.0, 1.0], [1.0, 1.0]]), group_baseline=True)
    assert torch.equal(res.advantages, torch.zeros(2, 2, dtype=F64))


# --------------------------------------------------------------------------- MaxRL
def test_maxrl_hand_values_and_mean_zero_rule():
    res = maxrl_advantages(t([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.5, 0.0, 0.0, 0.5]]))
    assert torch.equal(res.advantages[0], t([3.0, -1.0, -1.0, -1.0]))  # mean 1/4: (1 - 1/4) / (1/4) = 3
    assert torch.equal(res.advantages[1], torch.zeros(4, dtype=F64))  # no success: exactly 0
    assert torch.equal(res.advantages[2], torch.zeros(4, dtype=F64))
    assert torch.equal(res.advantages[3], t([1.0, -1.0, -1.0, 1.0]))
    assert res.zero_variance.tolist() == [False, True, True, False]


@settings(max_examples=40, deadline=None)
@given(bits=st.lists(st.booleans(), min_size=2, max_size=9), seed=st.integers(0, 2**31 - 1))
def test_maxrl_is_the_success_average_minus_a_control_variate(bits, seed):
    """(1/G) Σ A_i g_i = (1/K) Σ_{success} g_i - (1/G) Σ_i g_i for any score vectors g_i (K > 0)."""
    r = torch.tensor([float(b) for b in bits], dtype=F64)
    grads = torch.randn(len(bits), 3, generator=torch.Generator().manual_seed(seed), dtype=F64)
    a = maxrl_advantages(r[None, :]).advantages[0]
    lhs = (a[:, None] * grads).mean(0)
    k = int(r.sum())
    if k == 0:
        assert torch.equal(lhs, torch.zeros(3, dtype=F64))
    else:
        rhs = grads[r == 1].sum(0) / k - grads.mean(0)
        assert torch.allclose(lhs, rhs, atol=1e-12)


def test_maxrl_ragged_equals_dense_and_bad_input():
    r = t([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    dense = maxrl_advantages(r).advantages
    ragged = maxrl_advantages(r.flatten(), group_ids=torch.tensor([4, 4, 4, 9, 9, 9])).advantages
    assert torch.equal(dense.flatten(), ragged)
    with pytest.raises(ValueError, match="rewards"):
        maxrl_advantages(t([[1.0, -0.5]]))
    with pytest.raises(ValueError, match="rewards"):
        maxrl_advantages(t([[1.0, math.inf]]))
    with pytest.raises(ValueError, match="group_ids"):
        maxrl_advantages(t([1.0, 0.0]), group_ids=torch.tensor([0]))


# ---------------------------------------------------------------------------- GDPO
def _trl_normalize_then_sum(rewards_per_func, G, weights):
    """TRL 1.16 multi_objective_aggregation="normalize_then_sum", written out (Bessel std, eps 1e-4)."""
    grouped = rewards_per_func.view(-1, G, rewards_per_func.shape[-1])
    mean_k = grouped.mean(1, keepdim=True)
    std_k = grouped.std(1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[-1])
    s = (reward_k * weights).sum(1)
    return (s - s.mean()) / (s.std() + 1e-4)


def test_gdpo_matches_trl_normalize_then_sum():
    g = torch.Generator().manual_seed(3)
    N, G, K = 4, 6, 3
    rewards = torch.randint(0, 2, (N, G, K), generator=g).to(F64)
    rewards[..., 2] = torch.randn(N, G, generator=g, dtype=F64)
    rewards[1, :, 0] = 1.0  # a constant component in one group
    w = t([1.0, 0.5, 2.0])
    ours = gdpo_advantages(rewards, weights=w, unbiased=True, eps=1e-4)
    ref = _trl_normalize_then_sum(rewards.view(N * G, K), G, w).view(N, G)
    assert torch.allclose(ours.advantages, ref, atol=1e-12)
    ids = torch.arange(N).repeat_interleave(G)
    ragged = gdpo_advantages(rewards.view(N * G, K), group_ids=ids, weights=w, unbiased=True, eps=1e-4)
    assert torch.allclose(ragged.advantages, ours.advantages.flatten(), atol=1e-14)


def test_gdpo_keeps_reward_combinations_apart_where_grpo_collapses_them():
    # group 1: components (0,0), (1,0): sums 0, 1;  group 2: (0,0), (1,1): sums 0, 2
    rewards = t([[[0.0, 0.0], [1.0, 0.0]], [[0.0, 0.0], [1.0, 1.0]]])
    grpo = group_advantages(rewards.sum(-1), eps=0.0).advantages
    assert torch.equal(grpo[0], grpo[1])  # both [-1, 1]: the second reward is invisible
    gdpo = gdpo_advantages(rewards, eps=0.0, batch_normalize=False).advantages
    assert torch.equal(gdpo, t([[-1.0, 1.0], [-2.0, 2.0]]))
    full = gdpo_advantages(rewards, eps=0.0).advantages
    assert full[1, 1] > full[0, 1] > 0 > full[0, 0] > full[1, 0]


def test_gdpo_verl_form_is_the_unnormalized_sum_whitened():
    from trajgrad.advantages.baselines import whiten

    g = torch.Generator().manual_seed(4)
    rewards = torch.randint(0, 2, (3, 4, 2), generator=g).to(F64)
    s = gdpo_advantages(rewards, unbiased=True, eps=1e-6, batch_normalize=False).advantages
    per = [group_advantages(rewards[..., k], unbiased=True, eps=1e-6).advantages for k in range(2)]
    assert torch.allclose(s, per[0] + per[1], atol=1e-15)
    w = whiten(s)  # verl then masked_whiten's the broadcast sum over tokens
    assert w.shape == s.shape


def test_gdpo_bad_input():
    with pytest.raises(ValueError, match="rewards"):
        gdpo_advantages(t([[1.0, 0.0]]))  # 2-D without group_ids
    with pytest.raises(ValueError, match="rewards"):
        gdpo_advantages(torch.zeros(2, 3, 0, dtype=F64))
    with pytest.raises(ValueError, match="weights"):
        gdpo_advantages(torch.zeros(2, 3, 2, dtype=F64), weights=t([1.0]))
    with pytest.raises(ValueError, match="weights"):
        gdpo_advantages(torch.zeros(2, 3, 2, dtype=F64), weights=t([1.0, math.nan]))
    with pytest.raises(ValueError, match="group_ids"):
        gdpo_advantages(torch.zeros(4, 2, dtype=F64), group_ids=torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="rewards"):
        gdpo_advantages(t([[[1.0, math.nan]]]))
