"""Tests for trajgrad.advantages.baselines (spec §4, §5, §11, §12, §24)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.advantages.baselines import broadcast_to_tokens, group_advantages, leave_one_out

F64 = torch.float64
SETTINGS = settings(max_examples=40, deadline=None)


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ---------------------------------------------------------------- worked numbers


def test_leave_one_out_spec_example():
    # §5: 0 - (1+2)/2 = -1.5; 1 - (0+2)/2 = 0; 2 - (0+1)/2 = +1.5
    out = leave_one_out(t([[0.0, 1.0, 2.0]]))
    assert torch.equal(out, t([[-1.5, 0.0, 1.5]]))


def test_group_std_spec_section_12_prompts():
    # §12: prompt A deviations [-0.5, +0.5] (std 0.5) and prompt B [-0.1, +0.1] (std 0.1)
    # both standardize to [-1, +1]; without the std the raw evidence of B is 5x smaller.
    rewards = t([[0.0, 1.0], [0.4, 0.6]])
    std = group_advantages(rewards, scale="std", eps=0.0)
    torch.testing.assert_close(std.advantages, t([[-1.0, 1.0], [-1.0, 1.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(std.std, t([0.5, 0.1]), rtol=0, atol=1e-12)
    raw = group_advantages(rewards, scale="none")
    torch.testing.assert_close(raw.advantages, t([[-0.5, 0.5], [-0.1, 0.1]]), rtol=0, atol=1e-12)
    ratio = raw.advantages[0, 1] / raw.advantages[1, 1]
    assert abs(ratio.item() - 5.0) < 1e-9


def test_grpo_hand_values():
    # mean 1, population std sqrt(((-1)^2 + 0 + 1^2) / 3) = sqrt(2/3); A = +-1/sqrt(2/3) = +-sqrt(1.5)
    out = group_advantages(t([[0.0, 1.0, 2.0]]), eps=0.0)
    s = math.sqrt(1.5)
    torch.testing.assert_close(out.advantages, t([[-s, 0.0, s]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.mean, t([1.0]))
    torch.testing.assert_close(out.std, t([math.sqrt(2 / 3)]))
    # default eps = 1e-6 enters the denominator
    out = group_advantages(t([[0.0, 1.0, 2.0]]))
    torch.testing.assert_close(out.advantages[0, 2], t(1.0 / (math.sqrt(2 / 3) + 1e-6)))


def test_leave_one_out_with_std_scale():
    # LOO [-1.5, 0, 1.5] divided by the group population std sqrt(2/3)
    out = group_advantages(t([[0.0, 1.0, 2.0]]), eps=0.0, leave_one_out=True)
    k = 1.5 / math.sqrt(2 / 3)
    torch.testing.assert_close(out.advantages, t([[-k, 0.0, k]]), rtol=0, atol=1e-12)


def test_batch_std_hand_values():
    # batch [0, 2, 10, 10]: mean 5.5, squared deviations 30.25 + 12.25 + 20.25 + 20.25 = 83,
    # population std sqrt(83 / 4); group 0 centred [-1, +1]; group 1 has zero variance.
    out = group_advantages(t([[0.0, 2.0], [10.0, 10.0]]), scale="batch_std", eps=0.0)
    s = math.sqrt(83 / 4)
    torch.testing.assert_close(out.advantages, t([[-1 / s, 1 / s], [0.0, 0.0]]), rtol=0, atol=1e-12)
    assert out.zero_variance.tolist() == [False, True]


# ---------------------------------------------------------------- zero variance (§11, §24)


@pytest.mark.parametrize("scale", ["std", "none", "batch_std"])
@pytest.mark.parametrize("loo", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_uniform_group_gives_exactly_zero(scale, loo, eps):
    # 0.1 repeated: the floating mean is not exactly 0.1, yet the advantages must be exactly 0
    rewards = t([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    out = group_advantages(rewards, scale=scale, eps=eps, leave_one_out=loo)
    assert torch.equal(out.advantages[:2], torch.zeros(2, 3, dtype=F64))
    assert out.zero_variance.tolist() == [True, True, False]
    assert torch.equal(out.std[:2], torch.zeros(2, dtype=F64))
    assert torch.isfinite(out.advantages).all()
    assert int(out.zero_variance.sum()) == 2


def test_all_groups_constant_batch_std_eps0_is_zero_not_nan():
    out = group_advantages(t([[3.0, 3.0], [3.0, 3.0]]), scale="batch_std", eps=0.0)
    assert torch.equal(out.advantages, torch.zeros(2, 2, dtype=F64))


# ---------------------------------------------------------------- hypothesis properties (§24)

rewards_2d = st.integers(1, 5).flatmap(
    lambda n: st.integers(2, 6).flatmap(
        lambda g: st.lists(
            # rewards below 1e-100 in magnitude are 0: their squares underflow to subnormals,
            # where a variance keeps only a few bits (an artefact of float64, not of the estimator)
            st.lists(st.floats(-10, 10, allow_nan=False, width=64).map(lambda x: 0.0 if abs(x) < 1e-100 else x),
                     min_size=g, max_size=g),
            min_size=n,
            max_size=n,
        )
    )
)


@SETTINGS
@given(rows=rewards_2d, shift=st.floats(-100, 100), scale=st.sampled_from(["std", "none", "batch_std"]),
       loo=st.booleans())
def test_adding_constant_leaves_centred_advantages_unchanged(rows, shift, scale, loo):
    r = t(rows)
    a = group_advantages(r, scale=scale, eps=0.0, leave_one_out=loo)
    b = group_advantages(r + shift, scale=scale, eps=0.0, leave_one_out=loo)
    # groups whose spread is lost to rounding after the shift are the only legitimate change: the
    # shifted spread carries a relative error of ~ulp(shift)/spread, so compare groups whose spread
    # is resolved to 1e-8 of the shifted magnitude
    spread = r.max(-1).values - r.min(-1).values
    resolved = spread > 1e-8 * (abs(shift) + r.abs().max(-1).values)
    same_flat = (a.zero_variance == b.zero_variance) & (resolved | a.zero_variance)
    torch.testing.assert_close(b.advantages[same_flat], a.advantages[same_flat], rtol=1e-6, atol=1e-6)


@SETTINGS
@given(rows=rewards_2d, k=st.floats(0.01, 100), loo=st.booleans())
def test_multiplying_rewards_changes_none_but_not_std(rows, k, loo):
    r = t(rows)
    std_a = group_advantages(r, scale="std", eps=0.0, leave_one_out=loo).advantages
    std_b = group_advantages(r * k, scale="std", eps=0.0, leave_one_out=loo).advantages
    torch.testing.assert_close(std_b, std_a, rtol=1e-9, atol=1e-9)
    bstd_b = group_advantages(r * k, scale="batch_std", eps=0.0, leave_one_out=loo).advantages
    bstd_a = group_advantages(r, scale="batch_std", eps=0.0, leave_one_out=loo).advantages
    torch.testing.assert_close(bstd_b, bstd_a, rtol=1e-9, atol=1e-9)
    none_a = group_advantages(r, scale="none", leave_one_out=loo).advantages
    none_b = group_advantages(r * k, scale="none", leave_one_out=loo).advantages
    torch.testing.assert_close(none_b, k * none_a, rtol=1e-9, atol=1e-9)


@SETTINGS
@given(rows=rewards_2d)
def test_centred_advantages_sum_to_zero_and_loo_relation(rows):
    r = t(rows)
    g = r.shape[1]
    none = group_advantages(r, scale="none").advantages
    torch.testing.assert_close(none.sum(-1), torch.zeros(r.shape[0], dtype=F64), rtol=0, atol=1e-9)
    # R_i - b_i = G / (G - 1) * (R_i - mean)
    torch.testing.assert_close(leave_one_out(r), none * g / (g - 1), rtol=1e-9, atol=1e-9)


@SETTINGS
@given(sizes=st.lists(st.integers(2, 5), min_size=1, max_size=5), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from(["std", "none"]), loo=st.booleans())
def test_ragged_groups_match_per_group_dense(sizes, seed, scale, loo):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randperm(1000, generator=gen)[: len(sizes)]
    pieces = [torch.randint(0, 3, (s,), generator=gen).to(F64) for s in sizes]
    rewards = torch.cat(pieces)
    ids = torch.cat([torch.full((s,), int(lab)) for s, lab in zip(sizes, labels)])
    perm = torch.randperm(len(rewards), generator=gen)
    out = group_advantages(rewards[perm], group_ids=ids[perm], scale=scale, eps=0.0, leave_one_out=loo)
    back = torch.empty_like(rewards)
    back[perm] = out.advantages
    order = torch.argsort(labels)  # stats are reported in increasing group id
    start = 0
    for j, piece in enumerate(pieces):
        dense = group_advantages(piece[None], scale=scale, eps=0.0, leave_one_out=loo)
        torch.testing.assert_close(back[start:start + len(piece)], dense.advantages[0], rtol=1e-12, atol=1e-12)
        k = int((order == j).nonzero())
        torch.testing.assert_close(out.mean[k], dense.mean[0])
        torch.testing.assert_close(out.std[k], dense.std[0])
        assert bool(out.zero_variance[k]) == bool(dense.zero_variance[0])
        start += len(piece)


def test_ragged_batch_std_uses_all_rewards():
    rewards = t([0.0, 2.0, 10.0, 10.0])
    out = group_advantages(rewards, group_ids=torch.tensor([5, 5, 1, 1]), scale="batch_std", eps=0.0)
    s = math.sqrt(83 / 4)
    torch.testing.assert_close(out.advantages, t([-1 / s, 1 / s, 0.0, 0.0]), rtol=0, atol=1e-12)
    assert out.zero_variance.tolist() == [True, False]  # group id 1 first, then 5


# ---------------------------------------------------------------- the baseline is unbiased (§5)


def test_expected_gradient_by_exact_enumeration():
    """E[sum_i A_i grad log pi(a_i)] over all G-tuples of actions, against the analytic dJ.

    J = sum_a pi_a r_a with pi = softmax(theta), so dJ/dtheta_a = pi_a (r_a - J). Rollouts are
    independent, hence LOO (baseline independent of a_i) gives exactly G dJ, and the mean
    baseline (which contains R_i / G) gives (G - 1) dJ: biased by the factor (G-1)/G.
    """
    theta = torch.tensor([0.3, -0.2, 0.5], dtype=F64, requires_grad=True)
    r = t([1.0, 0.0, 2.5])
    g = 3
    pi = torch.softmax(theta, 0).detach()
    j = (pi * r).sum()
    analytic = pi * (r - j)
    for mode, factor in (("loo", g), ("mean", g - 1)):
        expected = torch.zeros(3, dtype=F64)
        for actions in itertools.product(range(3), repeat=g):
            a = torch.tensor(actions)
            rewards = r[a][None]
            if mode == "loo":
                adv = leave_one_out(rewards)[0]
            else:
                adv = group_advantages(rewards, scale="none").advantages[0]
            prob = pi[a].prod()
            logp = torch.log_softmax(theta, 0)[a]
            (grad,) = torch.autograd.grad((adv * logp).sum(), theta)
            expected += prob * grad
        torch.testing.assert_close(expected, factor * analytic, rtol=1e-12, atol=1e-12)


def test_outputs_are_detached():
    r = t([[0.0, 1.0, 3.0]]).requires_grad_()
    out = group_advantages(r)
    assert not out.advantages.requires_grad and not out.mean.requires_grad
    assert not leave_one_out(r).requires_grad
    adv = t([[1.0, 2.0]]).requires_grad_()
    assert not broadcast_to_tokens(adv, torch.tensor([[0, 1]])).requires_grad


def test_integer_rewards_are_accepted():
    out = group_advantages(torch.tensor([[0, 1], [1, 1]]), scale="none")
    assert out.advantages.is_floating_point()
    assert out.advantages.tolist() == [[-0.5, 0.5], [0.0, 0.0]]


# ---------------------------------------------------------------- broadcast_to_tokens (§4)


def test_broadcast_to_tokens_gathers_turns():
    turn_adv = t([[1.0, -2.0, 3.0], [0.5, 0.25, float("nan")]])
    ids = torch.tensor([[0, 0, 1, 1, 2], [-1, 0, 1, 1, 7]])
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]])
    out = broadcast_to_tokens(turn_adv, ids, mask)
    # masked slots are 0 even with id -1, id 7 or a NaN turn that no valid token uses
    assert torch.equal(out, t([[1.0, 1.0, 0.0, -2.0, 3.0], [0.0, 0.5, 0.25, 0.25, 0.0]]))


def test_broadcast_to_tokens_without_mask():
    out = broadcast_to_tokens(t([[1.0, 2.0]]), torch.tensor([[1, 0, 1]]))
    assert torch.equal(out, t([[2.0, 1.0, 2.0]]))


# ---------------------------------------------------------------- bad input


def test_bad_inputs_raise_naming_the_argument():
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.zeros(3, 0))  # empty group
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.zeros(0), group_ids=torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="rewards"):
        leave_one_out(t([[1.0], [2.0]]))  # G = 1
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(t([[1.0], [2.0]]), leave_one_out=True)
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(t([1.0, 2.0, 3.0]), group_ids=torch.tensor([0, 0, 1]), leave_one_out=True)
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(t([1.0, 2.0]), group_ids=t([0.0, 1.0]))
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(t([1.0, 2.0]), group_ids=torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(t([1.0, 2.0]))  # 1-D without group_ids
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(t([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(t([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="scale"):
        group_advantages(t([[1.0, 2.0]]), scale="max")
    with pytest.raises(ValueError, match="eps"):
        group_advantages(t([[1.0, 2.0]]), eps=-1e-3)


def test_broadcast_bad_inputs():
    adv = t([[1.0, 2.0]])
    with pytest.raises(ValueError, match="turn_ids"):
        broadcast_to_tokens(adv, torch.tensor([[0, 2]]))  # out of range at a valid position
    with pytest.raises(ValueError, match="turn_ids"):
        broadcast_to_tokens(adv, torch.tensor([[0, -1]]))
    with pytest.raises(ValueError, match="turn_ids"):
        broadcast_to_tokens(adv, t([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="turn_ids"):
        broadcast_to_tokens(adv, torch.tensor([[0, 1], [0, 1]]))  # row count
    with pytest.raises(ValueError, match="mask"):
        broadcast_to_tokens(adv, torch.tensor([[0, 1]]), torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="mask"):
        broadcast_to_tokens(adv, torch.tensor([[0, 1]]), torch.tensor([[1, 1, 1]]))
    with pytest.raises(ValueError, match="turn_advantages"):
        broadcast_to_tokens(t([[1.0, float("nan")]]), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="turn_advantages"):
        broadcast_to_tokens(t([1.0, 2.0]), torch.tensor([[0, 1]]))


# ------------------------------------------------------------- unbiased (Bessel) std
def _verl_grpo(scores, index, eps=1e-6):
    """verl 0.9.1 compute_grpo_outcome_advantage, written out: torch.std per group (Bessel)."""
    out = scores.clone()
    for g in set(index.tolist()):
        sel = index == g
        out[sel] = (scores[sel] - scores[sel].mean()) / (torch.std(scores[sel]) + eps)
    return out


def test_unbiased_std_hand_value():
    # [0, 1, 1, 0]: mean 0.5, Σ(R - mean)^2 = 1, unbiased var = 1/3 -> A = ±0.5 / sqrt(1/3)
    res = group_advantages(t([[0.0, 1.0, 1.0, 0.0]]), unbiased=True, eps=0.0)
    a = 0.5 / math.sqrt(1.0 / 3.0)
    assert torch.allclose(res.advantages, t([[-a, a, a, -a]]), atol=1e-15)
    assert res.std.item() == pytest.approx(math.sqrt(1.0 / 3.0), abs=1e-15)
    pop = group_advantages(t([[0.0, 1.0, 1.0, 0.0]]), eps=0.0)
    assert torch.allclose(pop.advantages, t([[-1.0, 1.0, 1.0, -1.0]]), atol=1e-15)


def test_unbiased_std_matches_verl_grpo_and_the_g8_ratio():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 8, generator=g, dtype=F64)
    ours = group_advantages(rewards, unbiased=True, eps=1e-6).advantages
    ref = _verl_grpo(rewards.flatten(), torch.arange(5).repeat_interleave(8)).view(5, 8)
    assert torch.allclose(ours, ref, atol=1e-14, rtol=0)
    # the documented size of the difference: sqrt(G / (G - 1)) = 1.069 at G = 8
    pop = group_advantages(rewards, eps=0.0).advantages
    unb = group_advantages(rewards, eps=0.0, unbiased=True).advantages
    assert torch.allclose(pop / unb, torch.full_like(pop, math.sqrt(8 / 7)), atol=1e-13)
    assert math.sqrt(8 / 7) == pytest.approx(1.069, abs=5e-4)


def test_unbiased_ragged_equals_dense_and_batch_std_matches_trl():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(3, 4, generator=g, dtype=F64)
    ids = torch.arange(3).repeat_interleave(4)
    dense = group_advantages(rewards, unbiased=True)
    ragged = group_advantages(rewards.flatten(), unbiased=True, group_ids=ids)
    assert torch.allclose(dense.advantages.flatten(), ragged.advantages, atol=1e-15)
    # TRL 1.16 scale_rewards="batch": (R - group mean) / (nanstd(all rewards) + 1e-4), nanstd Bessel
    res = group_advantages(rewards, scale="batch_std", unbiased=True, eps=1e-4)
    ref = (rewards - rewards.mean(1, keepdim=True)) / (torch.std(rewards) + 1e-4)
    assert torch.allclose(res.advantages, ref, atol=1e-14)


def test_unbiased_single_rollout_group_and_zero_variance_are_zero():
    res = group_advantages(t([1.0, 2.0, 2.0, 5.0]), unbiased=True, group_ids=torch.tensor([0, 1, 1, 2]))
    assert torch.equal(res.advantages, torch.zeros(4, dtype=F64))
    assert torch.equal(res.std, torch.zeros(3, dtype=F64))


# ------------------------------------------------------------------------- whiten
def _verl_masked_whiten(values, mask, shift_mean=True):
    """verl 0.9.1 masked_whiten written out (masked mean, Bessel variance, rsqrt(var + 1e-8))."""
    m = mask.to(values.dtype)
    v = torch.where(mask.bool(), values, torch.zeros_like(values))
    mean = (v * m).sum() / m.sum()
    var = (((v - mean) ** 2) * m).sum() / m.sum() * m.sum() / (m.sum() - 1)
    out = (v - mean) * torch.rsqrt(var + 1e-8)
    return out + mean if not shift_mean else out


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_verl_form(shift_mean):
    from trajgrad.advantages.baselines import whiten

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, generator=g, dtype=F64) * 3 + 1
    mask = torch.rand(4, 6, generator=g) > 0.3
    ours = whiten(x, mask, shift_mean=shift_mean)
    ref = _verl_masked_whiten(x, mask, shift_mean)
    assert torch.allclose(ours[mask], ref[mask], atol=1e-13)
    assert torch.equal(ours[~mask], torch.zeros_like(ours[~mask]))
    if shift_mean:
        valid = ours[mask]
        assert valid.mean().abs().item() < 1e-13
        assert valid.var(correction=1).item() == pytest.approx(1.0, abs=1e-6)
    # population variance option
    pop = whiten(x, mask, unbiased=False, eps=0.0)
    assert pop[mask].var(correction=0).item() == pytest.approx(1.0, abs=1e-12)


def test_whiten_ignores_poison_detaches_and_handles_a_constant_batch():
    from trajgrad.advantages.baselines import whiten

    x = t([[1.0, math.nan, 3.0], [math.inf, 2.0, -math.inf]]).requires_grad_(True)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    out = whiten(x, mask)
    assert not out.requires_grad and torch.isfinite(out).all()
    clean = whiten(t([[1.0, 0.0, 3.0], [0.0, 2.0, 0.0]]), mask)
    assert torch.equal(out, clean)
    assert torch.equal(whiten(t([[2.0, 2.0, 2.0]])), torch.zeros(1, 3, dtype=F64))
    assert torch.equal(whiten(t([[2.0, 2.0, 2.0]]), shift_mean=False), torch.full((1, 3), 2.0, dtype=F64))


@pytest.mark.parametrize(
    "args,kw,name",
    [
        ((t([[1.0, 2.0]]), torch.tensor([[0, 0]])), {}, "mask"),
        ((t([[1.0, 2.0]]), torch.tensor([[1, 0]])), {}, "mask"),  # one entry: no unbiased variance
        ((t([[1.0, math.nan]]),), {}, "values"),
        ((t([[1.0, 2.0]]), torch.tensor([[1, 2]])), {}, "mask"),
        ((t([[1.0, 2.0]]), torch.tensor([[1, 1, 1]])), {}, "mask"),
        ((t([[1.0, 2.0]]),), {"eps": -1.0}, "eps"),
        ((torch.tensor([[1, 2]]),), {}, "values"),
    ],
)
def test_whiten_bad_input(args, kw, name):
    from trajgrad.advantages.baselines import whiten

    with pytest.raises(ValueError, match=name):
        whiten(*args, **kw)
