"""Pass@k, GPG and OPO advantages against hand-written loops; bad input names the argument."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.advantages.group_baselines import gpg_advantages, opo_advantages, passk_advantages
from trajgrad.objective import get_recipe

F64 = torch.float64


def _groups(seed, N=6, G=5):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 3, (N, G), generator=g).to(F64) + 0.5 * torch.randn(N, G, generator=g, dtype=F64)
    r[0] = 1.0          # a zero-variance group
    r[1] = 0.0
    r[1, 1] = r[1, 2] = 1.0   # a tie at the top
    return r


def _passk_loop(r, eps, unbiased=True):
    out = torch.zeros_like(r)
    for n in range(r.shape[0]):
        vals = sorted(r[n].tolist(), reverse=True)
        std = float(r[n].std(unbiased=unbiased))
        i = max(range(r.shape[1]), key=lambda j: (float(r[n, j]), -j))
        out[n, i] = (vals[0] - vals[1]) / (std + eps)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_passk_equals_the_loop_dense_and_ragged(seed):
    r = _groups(seed)
    want = _passk_loop(r, 1e-6)
    got = passk_advantages(r, eps=1e-6).advantages
    assert torch.allclose(got, want, atol=1e-12)
    assert (got[0] == 0).all() and (got[1] == 0).all()  # zero variance; tied top
    assert ((got != 0).sum(-1) <= 1).all() and (got >= 0).all()
    gids = torch.arange(r.shape[0]).repeat_interleave(r.shape[1])
    perm = torch.randperm(r.numel(), generator=torch.Generator().manual_seed(seed))
    ragged = passk_advantages(r.reshape(-1)[perm], group_ids=gids[perm], eps=1e-6).advantages
    assert torch.allclose(ragged, want.reshape(-1)[perm], atol=1e-12)
    unscaled = passk_advantages(r, scale=False).advantages
    margin = torch.topk(r, 2, dim=-1).values
    assert torch.allclose(unscaled.sum(-1), margin[:, 0] - margin[:, 1], atol=1e-12)
    assert torch.equal(unscaled != 0, got != 0)


def test_passk_refuses_groups_of_one_and_bad_eps():
    with pytest.raises(ValueError, match="rewards"):
        passk_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="eps"):
        passk_advantages(torch.ones(2, 3), eps=-1.0)
    with pytest.raises(ValueError, match="rewards"):
        passk_advantages(torch.tensor([[1.0, float("nan")]]))


@pytest.mark.parametrize("count", ["valid", "nonzero"])
def test_gpg_equals_the_loop(count):
    r = _groups(4)
    r[2] = 0.0  # an all-zero group: zero variance, zero rewards
    B = r.numel()
    if count == "valid":
        n_valid = sum(r.shape[1] for n in range(r.shape[0]) if float(r[n].max() - r[n].min()) > 0)
    else:
        n_valid = int((r != 0).sum())
    want = (B / n_valid) * (r - r.mean(-1, keepdim=True))
    assert torch.allclose(gpg_advantages(r, count=count).advantages, want, atol=1e-12)
    with pytest.raises(ValueError, match="count"):
        gpg_advantages(r, count="all")


def test_gpg_all_flat_batch_gives_zero():
    assert (gpg_advantages(torch.ones(3, 4)).advantages == 0).all()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000))
def test_opo_equals_the_loop_and_reduces_to_centering_at_equal_lengths(seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(4, 6, generator=g, dtype=F64)
    lengths = torch.randint(1, 50, (4, 6), generator=g)
    b = (lengths * r).sum(-1, keepdim=True) / lengths.sum(-1, keepdim=True)
    assert torch.allclose(opo_advantages(r, lengths).advantages, r - b, atol=1e-12)
    eq = opo_advantages(r, torch.full((4, 6), 7)).advantages
    assert torch.allclose(eq, r - r.mean(-1, keepdim=True), atol=1e-12)
    gids = torch.arange(4).repeat_interleave(6)
    assert torch.allclose(opo_advantages(r.reshape(-1), lengths.reshape(-1), group_ids=gids).advantages,
                          (r - b).reshape(-1), atol=1e-12)


def test_opo_bad_lengths_name_the_argument():
    r = torch.randn(2, 3)
    for bad in (torch.ones(2, 2), -torch.ones(2, 3), torch.zeros(2, 3), torch.full((2, 3), float("inf"))):
        with pytest.raises(ValueError, match="lengths"):
            opo_advantages(r, bad)


def test_registry_entries_call_the_core_functions():
    r = _groups(7, G=8)
    o = get_recipe("passk")
    assert torch.allclose(o.sequence_advantages(r).advantages, _passk_loop(r, o.std_eps), atol=1e-12)
    g = get_recipe("gpg")
    assert torch.equal(g.sequence_advantages(r).advantages, gpg_advantages(r).advantages)


def test_remax_subtracts_the_greedy_reward_and_checks_its_input():
    from trajgrad.advantages.group_baselines import remax_advantages

    r = torch.tensor([1.0, 0.0, 2.0], dtype=F64)
    b = torch.tensor([0.5, 0.5, 1.0], dtype=F64)
    assert torch.equal(remax_advantages(r, b), torch.tensor([0.5, -0.5, 1.0], dtype=F64))
    with pytest.raises(ValueError, match="baseline_rewards"):
        remax_advantages(r, b[:2])
    with pytest.raises(ValueError, match="baseline_rewards"):
        remax_advantages(r, torch.tensor([0.0, float("nan"), 0.0]))


def _otb_inputs(seed, B=7, L=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    mask = torch.arange(L)[None, :] < lengths[:, None]
    r = torch.where(mask, torch.randn(B, L, generator=g, dtype=F64) * (torch.rand(B, L, generator=g) > 0.6), 0.0)
    probs = torch.softmax(torch.randn(B, L, 5, generator=g, dtype=F64), -1)
    lp = torch.log(probs[..., 0])
    s2 = probs.square().sum(-1)
    gids = torch.tensor([0, 0, 0, 1, 1, 2, 2])[:B]
    return r, mask, gids, lp, s2


def _otb_loop(r, mask, gids, lp, s2, eps=1e-8, zero_lone=True):
    B, L = r.shape
    G = torch.zeros(B, L, dtype=F64)
    W = torch.zeros(B, L, dtype=F64)
    for i in range(B):
        acc = 0.0
        for t in range(L):
            if mask[i, t]:
                acc += 1 - 2 * math.exp(float(lp[i, t])) + float(s2[i, t])
                W[i, t] = acc
                G[i, t] = sum(float(r[i, u]) for u in range(t, L) if mask[i, u])
    adv = torch.zeros(B, L, dtype=F64)
    for i in range(B):
        members = [j for j in range(B) if gids[j] == gids[i]]
        for t in range(L):
            if not mask[i, t]:
                continue
            alive = [j for j in members if mask[j, t]]
            b = sum(float(G[j, t] * W[j, t]) for j in alive) / (sum(float(W[j, t]) for j in alive) + eps)
            if zero_lone and len(alive) == 1:
                b = 0.0
            adv[i, t] = G[i, t] - b
    return adv, G


@pytest.mark.parametrize("zero_lone", [True, False])
def test_optimal_token_baseline_equals_the_loop(zero_lone):
    from trajgrad.advantages.group_baselines import optimal_token_baseline

    for seed in range(3):
        r, mask, gids, lp, s2 = _otb_inputs(seed)
        got = optimal_token_baseline(r, mask, gids, lp, s2, zero_lone=zero_lone)
        want_a, want_g = _otb_loop(r, mask, gids, lp, s2, zero_lone=zero_lone)
        assert torch.allclose(got.advantages, want_a, atol=1e-12) and torch.allclose(got.returns, want_g, atol=1e-12)
        assert (got.advantages[~mask] == 0).all()


def test_optimal_token_baseline_with_equal_energy_is_the_mean_of_the_live_returns():
    """w_t = 1 everywhere (Σπ² = 2π): W_t = t + 1 for every right-padded response, so b_t is the plain mean of
    the returns of the responses still running at t."""
    from trajgrad.advantages.group_baselines import optimal_token_baseline

    r, mask, gids, lp, _ = _otb_inputs(5)
    s2 = 2 * lp.exp()
    got = optimal_token_baseline(r, mask, gids, lp, s2, eps=0.0, zero_lone=False)
    for i in range(r.shape[0]):
        for t in range(r.shape[1]):
            if mask[i, t]:
                alive = [j for j in range(r.shape[0]) if gids[j] == gids[i] and mask[j, t]]
                mean = sum(float(got.returns[j, t]) for j in alive) / len(alive)
                assert math.isclose(float(got.advantages[i, t]), float(got.returns[i, t]) - mean, abs_tol=1e-12)


def test_optimal_token_baseline_ignores_masked_nan_and_names_bad_inputs():
    from trajgrad.advantages.group_baselines import optimal_token_baseline

    r, mask, gids, lp, s2 = _otb_inputs(6)
    ref = optimal_token_baseline(r, mask, gids, lp, s2).advantages
    nan = torch.tensor(float("nan"), dtype=F64)
    poisoned = [torch.where(mask, x, nan) for x in (r, lp, s2)]
    assert torch.equal(optimal_token_baseline(poisoned[0], mask, gids, poisoned[1], poisoned[2]).advantages, ref)
    with pytest.raises(ValueError, match="sum_pi_squared"):
        optimal_token_baseline(r, mask, gids, lp, s2[:, :-1])
    with pytest.raises(ValueError, match="behaviour_logp"):
        optimal_token_baseline(r, mask, gids, torch.where(mask, nan, lp), s2)
    with pytest.raises(ValueError, match="group_ids"):
        optimal_token_baseline(r, mask, gids.to(F64), lp, s2)
    with pytest.raises(ValueError, match="eps"):
        optimal_token_baseline(r, mask, gids, lp, s2, eps=-1.0)


def test_optimal_token_baseline_aligned_by_action_index_equals_the_loop():
    """align="action": the k-th action token of each response shares the baseline, whatever observation
    tokens came before it (multi-turn responses)."""
    from trajgrad.advantages.group_baselines import optimal_token_baseline

    r, mask, gids, lp, s2 = _otb_inputs(8)
    mask = mask.clone()
    mask[0, 1:3] = False   # tool observations inside two responses
    mask[3, 2] = False
    mask[:, 0] = True
    r = torch.where(mask, r, 0.0)
    got = optimal_token_baseline(r, mask, gids, lp, s2, align="action")
    _, G = _otb_loop(r, mask, gids, lp, s2)
    B, L = r.shape
    W = torch.zeros(B, L, dtype=F64)
    for i in range(B):
        acc = 0.0
        for t in range(L):
            if mask[i, t]:
                acc += 1 - 2 * math.exp(float(lp[i, t])) + float(s2[i, t])
                W[i, t] = acc
    cols = [[t for t in range(L) if mask[i, t]] for i in range(B)]
    for i in range(B):
        members = [j for j in range(B) if gids[j] == gids[i]]
        for k, t in enumerate(cols[i]):
            alive = [(j, cols[j][k]) for j in members if len(cols[j]) > k]
            b = sum(float(G[j, u] * W[j, u]) for j, u in alive) / (sum(float(W[j, u]) for j, u in alive) + 1e-8)
            b = 0.0 if len(alive) == 1 else b
            assert math.isclose(float(got.advantages[i, t]), float(G[i, t]) - b, abs_tol=1e-12)
    position = optimal_token_baseline(r, mask, gids, lp, s2).advantages
    assert not torch.allclose(position, got.advantages)
    with pytest.raises(ValueError, match="align"):
        optimal_token_baseline(r, mask, gids, lp, s2, align="turn")
