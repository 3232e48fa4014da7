"""Tests for trajgrad.advantages.returns (spec §2, §3, §6, §20.4, §21, §24)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.advantages.returns import (
    GAEOutput,
    discounted_return,
    gae,
    n_step_advantage,
    reward_to_go,
    shape_rewards,
    skip_observation_gae,
    token_skip_observation_gae,
)

F64 = torch.float64
SETTINGS = settings(max_examples=40, deadline=None)
NAN, INF = float("nan"), float("inf")


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ---------------------------------------------------------------- references (plain loops)


def ref_gae(rewards, values, gamma, lam, mask=None, terminated=None, truncated=None, bootstrap=None, trunc_value=None):
    """Backward loop over the valid steps of each row, with the documented rules."""
    b_, t_ = rewards.shape
    adv = torch.zeros(b_, t_, dtype=F64)
    for b in range(b_):
        steps = [s for s in range(t_) if mask is None or bool(mask[b, s])]
        next_adv = 0.0
        for k in reversed(range(len(steps))):
            s = steps[k]
            if terminated is not None and bool(terminated[b, s]):
                next_value, carry = 0.0, 0.0
            elif truncated is not None and bool(truncated[b, s]):
                next_value, carry = float(trunc_value[b, s]), 0.0
            elif k == len(steps) - 1:
                next_value, carry = (0.0 if bootstrap is None else float(bootstrap[b])), 0.0
            else:
                next_value, carry = float(values[b, steps[k + 1]]), 1.0
            delta = float(rewards[b, s]) + gamma * next_value - float(values[b, s])
            next_adv = delta + gamma * lam * carry * next_adv
            adv[b, s] = next_adv
    return adv


def ref_skip_observation_gae(action_end_values, next_action_values, rewards, terminals, gamma, lam):
    """The §20.4 listing, one entry per semantic action."""
    next_advantage = 0.0
    advantages = [0.0] * len(rewards)
    for i in reversed(range(len(rewards))):
        continuation = 1.0 - float(terminals[i])
        delta = rewards[i] + gamma * continuation * next_action_values[i] - action_end_values[i]
        next_advantage = delta + gamma * lam * continuation * next_advantage
        advantages[i] = next_advantage
    return advantages


def random_case(seed, b_, t_, p_pad=0.3, p_term=0.15, p_trunc=0.15):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b_, t_, generator=gen, dtype=F64)
    values = torch.randn(b_, t_, generator=gen, dtype=F64)
    mask = torch.rand(b_, t_, generator=gen) > p_pad
    mask[:, -2:] = False if t_ > 4 else mask[:, -2:]  # trailing padding
    terminated = torch.rand(b_, t_, generator=gen) < p_term
    truncated = torch.rand(b_, t_, generator=gen) < p_trunc
    trunc_value = torch.randn(b_, t_, generator=gen, dtype=F64)
    bootstrap = torch.randn(b_, generator=gen, dtype=F64)
    return rewards, values, mask, terminated, truncated, trunc_value, bootstrap


# ---------------------------------------------------------------- GAE: worked numbers (§6)


def test_gae_hand_example():
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72), terminal at the last step:
    # delta_2 = 1 - 0.7 = 0.3; delta_1 = 0.9*0.7 - 0.6 = 0.03; delta_0 = 0.9*0.6 - 0.5 = 0.04
    # A_2 = 0.3; A_1 = 0.03 + 0.72*0.3 = 0.246; A_0 = 0.04 + 0.72*0.246 = 0.21712
    rewards, values = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]])
    out = gae(rewards, values, gamma=0.9, lam=0.8, terminated=t([[0, 0, 1]]))
    assert isinstance(out, GAEOutput)
    torch.testing.assert_close(out.advantages, t([[0.21712, 0.246, 0.3]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.returns, t([[0.71712, 0.846, 1.0]]), rtol=0, atol=1e-12)
    # the same transitions with padding in the middle and at the end: skipped, not discounted
    r = t([[0.0, NAN, 0.0, 1.0, INF]])
    v = t([[0.5, -INF, 0.6, 0.7, NAN]])
    m = torch.tensor([[1, 0, 1, 1, 0]])
    out = gae(r, v, gamma=0.9, lam=0.8, mask=m, terminated=t([[0, 1, 0, 1, 1]]))
    torch.testing.assert_close(out.advantages, t([[0.21712, 0.0, 0.246, 0.3, 0.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.returns, t([[0.71712, 0.0, 0.846, 1.0, 0.0]]), rtol=0, atol=1e-12)


def test_gae_bootstrap_and_truncation_hand_example():
    # gamma 0.5, lam 1. Step 0 is truncated (next value 4 from truncation_value), step 1 starts a
    # new episode and is the last step of the row, bootstrapped with 2.
    # delta_1 = 1 + 0.5*2 - 1 = 1 -> A_1 = 1 ; delta_0 = 0 + 0.5*4 - 3 = -1, no carry -> A_0 = -1
    out = gae(t([[0.0, 1.0]]), t([[3.0, 1.0]]), gamma=0.5, lam=1.0, truncated=t([[1, 0]]),
              truncation_value=t([[4.0, NAN]]), bootstrap_value=t([2.0]))
    torch.testing.assert_close(out.advantages, t([[-1.0, 1.0]]), rtol=0, atol=1e-12)
    # without the truncation the carry connects: A_0 = 0 + 0.5*1 - 3 + 0.5*1*1 = -2
    out = gae(t([[0.0, 1.0]]), t([[3.0, 1.0]]), gamma=0.5, lam=1.0, bootstrap_value=2.0)
    torch.testing.assert_close(out.advantages, t([[-2.0, 1.0]]), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- GAE: against the loop


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.0, 0.7), (0.9, 0.0), (1.0, 0.5)])
def test_gae_matches_reference_loop_fixed(gamma, lam):
    for seed, (b_, t_) in enumerate([(4, 37), (3, 64), (2, 1), (2, 2), (5, 129)]):
        r, v, m, term, trunc, tv, boot = random_case(seed, b_, t_)
        out = gae(r, v, gamma=gamma, lam=lam, mask=m, terminated=term, truncated=trunc,
                  truncation_value=tv, bootstrap_value=boot)
        expected = ref_gae(r, v, gamma, lam, m, term, trunc, boot, tv)
        torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-10)
        torch.testing.assert_close(out.returns, torch.where(m, expected + v, torch.zeros_like(v)), rtol=0, atol=1e-10)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), b_=st.integers(1, 4), t_=st.integers(1, 40),
       gamma=st.floats(0, 1), lam=st.floats(0, 1), p_pad=st.floats(0, 0.9),
       flags=st.sampled_from(["none", "term", "trunc", "both"]), boot=st.booleans())
def test_gae_matches_reference_loop_property(seed, b_, t_, gamma, lam, p_pad, flags, boot):
    r, v, m, term, trunc, tv, bv = random_case(seed, b_, t_, p_pad=p_pad)
    kwargs = {}
    use_term = flags in ("term", "both")
    use_trunc = flags in ("trunc", "both")
    if use_term:
        kwargs["terminated"] = term
    if use_trunc:
        kwargs.update(truncated=trunc, truncation_value=tv)
    if boot:
        kwargs["bootstrap_value"] = bv
    out = gae(r, v, gamma=gamma, lam=lam, mask=m, **kwargs)
    expected = ref_gae(r, v, gamma, lam, m, term if use_term else None, trunc if use_trunc else None,
                       bv if boot else None, tv)
    torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-10)


def test_gae_long_sequence_is_stable():
    """L = 131,072: no under/overflow (a c^t closed form would divide by 0.95^131072 = 0)."""
    gen = torch.Generator().manual_seed(0)
    n = 131_072
    r = torch.randn(1, n, generator=gen, dtype=F64)
    v = torch.randn(1, n, generator=gen, dtype=F64)
    gamma, lam = 0.999, 0.95
    out = gae(r, v, gamma=gamma, lam=lam)
    rl, vl = r[0].tolist(), v[0].tolist()
    adv = [0.0] * n
    nxt_a, nxt_v = 0.0, 0.0
    for i in range(n - 1, -1, -1):
        nxt_a = rl[i] + gamma * nxt_v - vl[i] + gamma * lam * nxt_a
        nxt_v = vl[i]
        adv[i] = nxt_a
    torch.testing.assert_close(out.advantages[0], t(adv), rtol=0, atol=1e-9)
    assert torch.isfinite(out.advantages).all()


# ---------------------------------------------------------------- GAE: §24 identities


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), b_=st.integers(1, 3), t_=st.integers(1, 30), gamma=st.floats(0, 1))
def test_lambda_one_is_monte_carlo_minus_value_at_true_terminals(seed, b_, t_, gamma):
    r, v, m, term, _, _, _ = random_case(seed, b_, t_)
    # every row ends with a true terminal at its last valid step
    last = m & (torch.cumsum(m, -1) == m.sum(-1, keepdim=True))
    term = term | last
    out = gae(r, v, gamma=gamma, lam=1.0, mask=m, terminated=term)
    mc = reward_to_go(r, gamma=gamma, terminated=term, mask=m)
    torch.testing.assert_close(out.advantages, torch.where(m, mc - v, torch.zeros_like(v)), rtol=0, atol=1e-10)
    torch.testing.assert_close(out.returns, mc, rtol=0, atol=1e-10)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), t_=st.integers(2, 30), gamma=st.floats(0, 1))
def test_lambda_zero_is_td_residual(seed, t_, gamma):
    r, v, _, term, _, _, boot = random_case(seed, 2, t_)
    out = gae(r, v, gamma=gamma, lam=0.0, terminated=term, bootstrap_value=boot)
    next_v = torch.cat([v[:, 1:], boot[:, None]], -1)
    next_v = torch.where(term, torch.zeros_like(next_v), next_v)
    torch.testing.assert_close(out.advantages, r + gamma * next_v - v, rtol=0, atol=1e-12)


def test_gae_is_sum_of_discounted_td_residuals():
    # §6: A_t = sum_l (gamma*lam)^l delta_{t+l} within one episode
    r, v, *_ = random_case(7, 2, 25)
    gamma, lam = 0.97, 0.9
    out = gae(r, v, gamma=gamma, lam=lam)
    delta = r + gamma * torch.cat([v[:, 1:], torch.zeros(2, 1, dtype=F64)], -1) - v
    expected = torch.zeros_like(r)
    for s in range(25):
        w = (gamma * lam) ** torch.arange(25 - s, dtype=F64)
        expected[:, s] = (w * delta[:, s:]).sum(-1)
    torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- masked slots never leak


def test_nan_inf_in_padding_leave_outputs_unchanged():
    r, v, m, term, trunc, tv, boot = random_case(3, 4, 50)
    clean = gae(r, v, gamma=0.98, lam=0.9, mask=m, terminated=term, truncated=trunc,
                truncation_value=tv, bootstrap_value=boot)
    r2, v2 = r.clone(), v.clone()
    pad = ~m
    r2[pad] = NAN
    v2[pad] = torch.where(torch.arange(int(pad.sum())) % 2 == 0, INF, -INF).to(F64)
    tv2 = torch.where(trunc & m, tv, torch.full_like(tv, NAN))
    dirty = gae(r2, v2, gamma=0.98, lam=0.9, mask=m, terminated=term, truncated=trunc,
                truncation_value=tv2, bootstrap_value=boot)
    assert torch.equal(clean.advantages, dirty.advantages)
    assert torch.equal(clean.returns, dirty.returns)
    assert torch.equal(dirty.advantages[pad], torch.zeros(int(pad.sum()), dtype=F64))
    # the bootstrap is not read for a row that ends with a terminal
    term2 = term.clone()
    last = m & (torch.cumsum(m, -1) == m.sum(-1, keepdim=True))
    term2[0] |= last[0]
    boot2 = boot.clone()
    boot2[0] = NAN
    a = gae(r, v, gamma=0.98, lam=0.9, mask=m, terminated=term2, bootstrap_value=boot)
    b = gae(r2, v2, gamma=0.98, lam=0.9, mask=m, terminated=term2, bootstrap_value=boot2)
    assert torch.equal(a.advantages, b.advantages)
    # other functions: padding garbage changes nothing
    assert torch.equal(reward_to_go(r, gamma=0.9, mask=m, terminated=term),
                       reward_to_go(r2, gamma=0.9, mask=m, terminated=term))
    assert torch.equal(discounted_return(r, m, gamma=0.9), discounted_return(r2, m, gamma=0.9))
    assert torch.equal(n_step_advantage(r, v, 3, gamma=0.9, mask=m, terminated=term),
                       n_step_advantage(r2, v2, 3, gamma=0.9, mask=m, terminated=term))
    assert torch.equal(token_skip_observation_gae(v, r, m, gamma=0.9, lam=0.8).advantages,
                       token_skip_observation_gae(v2, r2, m, gamma=0.9, lam=0.8).advantages)


def test_evidence_is_detached():
    r = t([[1.0, 0.0, 2.0]]).requires_grad_()
    v = t([[0.5, 0.1, 0.2]]).requires_grad_()
    out = gae(r, v, gamma=0.9, lam=0.9)
    assert not out.advantages.requires_grad and not out.returns.requires_grad
    assert not reward_to_go(r).requires_grad
    assert not n_step_advantage(r, v, 2, gamma=0.9).requires_grad
    assert not skip_observation_gae(v[0], v[0], r[0], torch.zeros(3), 0.9, 0.9).requires_grad
    assert not shape_rewards(r, t([[0.0, 1, 2, 3]]), gamma=0.9).requires_grad
    assert r.grad is None and v.grad is None


def test_dtype_follows_inputs():
    r = torch.randn(2, 9)
    out = gae(r, torch.randn(2, 9), gamma=0.9, lam=0.9)
    assert out.advantages.dtype == torch.float32
    out64 = gae(r.double(), torch.randn(2, 9, dtype=F64), gamma=0.9, lam=0.9)
    assert out64.advantages.dtype == F64
    assert reward_to_go(torch.tensor([[1, 2]])).dtype.is_floating_point


# ---------------------------------------------------------------- returns (§2, §3)


def test_discounted_return_and_reward_to_go_hand_values():
    # gamma 0.5: R = 1 + 0.5*2 + 0.25*3 = 2.75 ; padding between steps is not discounted
    assert torch.allclose(discounted_return(t([[1.0, 2.0, 3.0]]), gamma=0.5), t([2.75]))
    m = torch.tensor([[1, 0, 1, 0, 1]])
    assert torch.allclose(discounted_return(t([[1.0, NAN, 2.0, 9.0, 3.0]]), m, gamma=0.5), t([2.75]))
    # reset after the terminal at index 1: G = [1 + 0.5*2, 2, 3 + 0.5*4, 4]
    g = reward_to_go(t([[1.0, 2.0, 3.0, 4.0]]), gamma=0.5, terminated=t([[0, 1, 0, 0]]))
    assert torch.equal(g, t([[2.0, 2.0, 5.0, 4.0]]))
    assert torch.equal(reward_to_go(t([[1.0, 2.0, 3.0]])), t([[6.0, 5.0, 3.0]]))
    assert torch.equal(discounted_return(torch.zeros(2, 3), torch.zeros(2, 3)), torch.zeros(2))


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), b_=st.integers(1, 4), t_=st.integers(1, 30), gamma=st.floats(0, 1))
def test_discounted_return_is_reward_to_go_at_first_valid_step(seed, b_, t_, gamma):
    r, _, m, *_ = random_case(seed, b_, t_)
    g = reward_to_go(r, gamma=gamma, mask=m)
    first = torch.argmax(m.to(torch.int8), -1)
    expected = torch.where(m.any(-1), g.gather(1, first[:, None])[:, 0], torch.zeros(b_, dtype=F64))
    torch.testing.assert_close(discounted_return(r, m, gamma=gamma), expected, rtol=1e-12, atol=1e-12)
    # and reward-to-go is the GAE advantage with zero values and lam = 1
    torch.testing.assert_close(g, gae(r, torch.zeros_like(r), gamma=gamma, lam=1.0, mask=m).advantages,
                               rtol=0, atol=1e-12)


# ---------------------------------------------------------------- n-step (§6)


def ref_n_step(r, v, n, gamma, mask, term, boot):
    """Direct definition: sum_{l<n} gamma^l r_{t+l} + gamma^n V_{t+n} - V_t, over valid steps."""
    out = torch.zeros_like(r)
    for b in range(r.shape[0]):
        steps = [s for s in range(r.shape[1]) if bool(mask[b, s])]
        for k, s in enumerate(steps):
            total, disc, ended = 0.0, 1.0, False
            for l in range(n):
                if k + l >= len(steps):
                    total += disc * float(boot[b])
                    ended = True
                    break
                s2 = steps[k + l]
                total += disc * float(r[b, s2])
                disc *= gamma
                if bool(term[b, s2]):
                    ended = True
                    break
            if not ended:
                total += disc * (float(boot[b]) if k + n >= len(steps) else float(v[b, steps[k + n]]))
            out[b, s] = total - float(v[b, s])
    return out


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), b_=st.integers(1, 3), t_=st.integers(1, 25), n=st.integers(1, 30),
       gamma=st.floats(0, 1))
def test_n_step_definition_and_td_sum_identity(seed, b_, t_, n, gamma):
    r, v, m, term, _, _, boot = random_case(seed, b_, t_)
    out = n_step_advantage(r, v, n, gamma=gamma, bootstrap_value=boot, terminated=term, mask=m)
    torch.testing.assert_close(out, ref_n_step(r, v, n, gamma, m, term, boot), rtol=0, atol=1e-10)
    # §6 identity: A^(n)_t = sum_{l<n} gamma^l delta_{t+l}, with delta = GAE(lam=0)
    delta = gae(r, v, gamma=gamma, lam=0.0, mask=m, terminated=term, bootstrap_value=boot).advantages
    td_sum = torch.zeros_like(r)
    for b in range(b_):
        steps = [s for s in range(t_) if bool(m[b, s])]
        for k, s in enumerate(steps):
            acc, disc = 0.0, 1.0
            for l in range(n):
                if k + l >= len(steps):
                    break
                acc += disc * float(delta[b, steps[k + l]])
                if bool(term[b, steps[k + l]]):
                    break
                disc *= gamma
            td_sum[b, s] = acc
    torch.testing.assert_close(out, td_sum, rtol=0, atol=1e-10)


def test_n_step_limits():
    r, v, m, term, _, _, boot = random_case(11, 3, 20)
    kw = dict(gamma=0.9, mask=m, terminated=term, bootstrap_value=boot)
    lam0 = gae(r, v, lam=0.0, **kw).advantages
    lam1 = gae(r, v, lam=1.0, **kw).advantages
    torch.testing.assert_close(n_step_advantage(r, v, 1, **kw), lam0, rtol=0, atol=1e-12)
    torch.testing.assert_close(n_step_advantage(r, v, 20, **kw), lam1, rtol=0, atol=1e-12)
    torch.testing.assert_close(n_step_advantage(r, v, 10**6, **kw), lam1, rtol=0, atol=1e-12)
    # hand value: r = [1, 2, 3], V = [1, 1, 1], gamma 0.5, n = 2, no bootstrap:
    # A_0 = 1 + 0.5*2 + 0.25*1 - 1 = 1.25 ; A_1 = 2 + 0.5*3 + 0 - 1 = 2.5 ; A_2 = 3 - 1 = 2
    out = n_step_advantage(t([[1.0, 2.0, 3.0]]), t([[1.0, 1.0, 1.0]]), 2, gamma=0.5)
    torch.testing.assert_close(out, t([[1.25, 2.5, 2.0]]), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- skip-observation GAE (§20.4)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 20), gamma=st.floats(0, 1), lam=st.floats(0, 1))
def test_skip_observation_gae_matches_spec_listing(seed, n, gamma, lam):
    gen = torch.Generator().manual_seed(seed)
    end_v, next_v, rew = (torch.randn(3, n, generator=gen, dtype=F64) for _ in range(3))
    terms = (torch.rand(3, n, generator=gen) < 0.2).to(F64)
    out = skip_observation_gae(end_v, next_v, rew, terms, gamma, lam)
    for b in range(3):
        expected = ref_skip_observation_gae(end_v[b].tolist(), next_v[b].tolist(), rew[b].tolist(),
                                            terms[b].tolist(), gamma, lam)
        torch.testing.assert_close(out[b], t(expected), rtol=0, atol=1e-10)
        one_d = skip_observation_gae(end_v[b], next_v[b], rew[b], terms[b], gamma, lam)
        assert one_d.shape == (n,)
        torch.testing.assert_close(one_d, t(expected), rtol=0, atol=1e-10)


def test_skip_observation_gae_hand_example_and_terminal_garbage():
    # gamma 1, lam 0.5, actions i = 0, 1 (terminal):
    # delta_1 = 1 - 0.5 = 0.5 -> A_1 = 0.5 ; delta_0 = 0 + 0.4 - 0.2 = 0.2 -> A_0 = 0.2 + 0.5*0.5 = 0.45
    out = skip_observation_gae(t([0.2, 0.5]), t([0.4, NAN]), t([0.0, 1.0]), t([0, 1]), 1.0, 0.5)
    torch.testing.assert_close(out, t([0.45, 0.5]), rtol=0, atol=1e-12)


def test_skip_observation_gae_padding_equals_compacted_rows():
    gen = torch.Generator().manual_seed(5)
    end_v, next_v, rew = (torch.randn(2, 9, generator=gen, dtype=F64) for _ in range(3))
    terms = (torch.rand(2, 9, generator=gen) < 0.25).to(F64)
    mask = torch.rand(2, 9, generator=gen) > 0.35
    dirty = [x.clone() for x in (end_v, next_v, rew)]
    for x in dirty:
        x[~mask] = NAN
    out = skip_observation_gae(*dirty, terms, 0.95, 0.8, mask=mask)
    for b in range(2):
        keep = mask[b]
        compact = skip_observation_gae(end_v[b, keep], next_v[b, keep], rew[b, keep], terms[b, keep], 0.95, 0.8)
        torch.testing.assert_close(out[b, keep], compact, rtol=0, atol=1e-12)
        assert torch.equal(out[b, ~keep], torch.zeros(int((~keep).sum()), dtype=F64))


def transcript(seed, b_, n_actions, one_token=False):
    """Random [prompt][a_0][o_0][a_1][o_1]... rows; returns per-token tensors and action spans."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b_):
        spans, pos = [], int(torch.randint(1, 4, (1,), generator=gen))
        for _ in range(n_actions):
            length = 1 if one_token else int(torch.randint(1, 5, (1,), generator=gen))
            spans.append((pos, pos + length))
            pos += length + int(torch.randint(1, 5, (1,), generator=gen))  # observation span
        rows.append(spans)
    width = max(s[-1][1] for s in rows) + 2
    mask = torch.zeros(b_, width, dtype=torch.bool)
    rewards = torch.full((b_, width), NAN, dtype=F64)
    values = torch.full((b_, width), NAN, dtype=F64)
    for b, spans in enumerate(rows):
        for lo, hi in spans:
            mask[b, lo:hi] = True
            values[b, lo:hi] = torch.randn(hi - lo, generator=gen, dtype=F64)
            rewards[b, lo:hi] = 0.0
            rewards[b, hi - 1] = float(torch.randn(1, generator=gen, dtype=F64))  # on the last token
    return rewards, values, mask, rows


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n_actions=st.integers(1, 8), gamma=st.floats(0, 1), lam=st.floats(0, 1),
       boot=st.booleans())
def test_token_level_equals_per_action_with_one_token_actions(seed, n_actions, gamma, lam, boot):
    rewards, values, mask, rows = transcript(seed, 3, n_actions, one_token=True)
    bootstrap = torch.randn(3, dtype=F64, generator=torch.Generator().manual_seed(seed + 1)) if boot else None
    out = token_skip_observation_gae(values, rewards, mask, gamma=gamma, lam=lam, bootstrap_value=bootstrap)
    for b, spans in enumerate(rows):
        pos = [lo for lo, _ in spans]
        end_v = values[b, pos]
        next_v = torch.cat([values[b, pos[1:]], t([0.0 if bootstrap is None else float(bootstrap[b])])])
        per_action = skip_observation_gae(end_v, next_v, rewards[b, pos], torch.zeros(len(pos)), gamma, lam)
        torch.testing.assert_close(out.advantages[b, pos], per_action, rtol=0, atol=1e-10)
    assert torch.equal(out.advantages[~mask], torch.zeros(int((~mask).sum()), dtype=F64))


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n_actions=st.integers(1, 6), gamma=st.floats(0, 1), lam=st.floats(0, 1))
def test_token_level_multi_token_actions_match_loop_and_spec_at_action_ends(seed, n_actions, gamma, lam):
    rewards, values, mask, rows = transcript(seed, 2, n_actions)
    term = torch.zeros_like(mask)
    term[0, rows[0][-1][1] - 1] = True  # row 0 ends with a true terminal
    out = token_skip_observation_gae(values, rewards, mask, gamma=gamma, lam=lam, terminated=term)
    # naive per-token loop over the valid tokens (observation tokens bridged, no decay)
    torch.testing.assert_close(out.advantages, ref_gae(rewards, values, gamma, lam, mask, term), rtol=0, atol=1e-10)
    # with gamma = lam = 1 inside actions (gamma = 1 overall, lam = 1), every action-end token
    # satisfies the §20.4 recursion: A(a_iN) = r_i + V(a_{i+1,0}) - V(a_iN) + A(a_{i+1,0})
    out1 = token_skip_observation_gae(values, rewards, mask, gamma=1.0, lam=1.0, terminated=term)
    for b, spans in enumerate(rows):
        for i, (lo, hi) in enumerate(spans):
            end = hi - 1
            if i + 1 < len(spans):
                nxt = spans[i + 1][0]
                rhs = rewards[b, end] + values[b, nxt] - values[b, end] + out1.advantages[b, nxt]
            else:
                rhs = rewards[b, end] - values[b, end]
            torch.testing.assert_close(out1.advantages[b, end], rhs, rtol=0, atol=1e-10)


def test_token_level_hand_example():
    # tokens: [prompt, a0, o, o, a1]; gamma 0.9, lam 0.5; reward 1 on a1 (last action, no bootstrap)
    # A(a1) = 1 - V(a1) = 1 - 0.2 = 0.8
    # A(a0) = 0 + 0.9 * V(a1) - V(a0) + 0.45 * A(a1) = 0.18 - 0.3 + 0.36 = 0.24  (no decay across o, o)
    values = t([[NAN, 0.3, 5.0, 5.0, 0.2]])
    rewards = t([[NAN, 0.0, 7.0, 7.0, 1.0]])
    mask = torch.tensor([[0, 1, 0, 0, 1]])
    out = token_skip_observation_gae(values, rewards, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(out.advantages, t([[0.0, 0.24, 0.0, 0.0, 0.8]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.returns, t([[0.0, 0.54, 0.0, 0.0, 1.0]]), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- shaping (§21)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), t_=st.integers(1, 25), gamma=st.floats(0, 1))
def test_shaping_telescopes(seed, t_, gamma):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(2, t_, generator=gen, dtype=F64)
    phi = torch.randn(2, t_ + 1, generator=gen, dtype=F64)
    shaped = shape_rewards(r, phi, gamma=gamma)
    g0 = discounted_return(r, gamma=gamma)
    expected = g0 - phi[:, 0] + gamma**t_ * phi[:, t_]
    torch.testing.assert_close(discounted_return(shaped, gamma=gamma), expected, rtol=1e-10, atol=1e-10)
    # every reward-to-go telescopes the same way: G'_t = G_t - Phi(s_t) + gamma^(T-t) Phi(s_T)
    g = reward_to_go(r, gamma=gamma)
    gs = reward_to_go(shaped, gamma=gamma)
    powers = torch.tensor([gamma ** (t_ - s) for s in range(t_)], dtype=F64)
    torch.testing.assert_close(gs, g - phi[:, :t_] + powers * phi[:, t_:], rtol=1e-10, atol=1e-10)
    # zero terminal potential: G'_0 = G_0 - Phi(s_0)
    term = torch.zeros(2, t_)
    term[:, -1] = 1
    shaped0 = shape_rewards(r, phi, gamma=gamma, terminated=term, zero_terminal_potential=True)
    torch.testing.assert_close(discounted_return(shaped0, gamma=gamma), g0 - phi[:, 0], rtol=1e-10, atol=1e-10)


def test_shaping_with_padding_and_several_episodes():
    # row: steps 0, 2, 3 valid (1 and 4 padding); potentials column 4 = Phi after the last step.
    r = t([[1.0, NAN, 2.0, 3.0, NAN]])
    m = torch.tensor([[1, 0, 1, 1, 0]])
    phi = t([[0.5, NAN, 1.0, 2.0, 4.0, NAN]])
    out = shape_rewards(r, phi, gamma=0.5, mask=m)
    # r'_0 = 1 + 0.5*1.0 - 0.5 = 1 ; r'_2 = 2 + 0.5*2 - 1 = 2 ; r'_3 = 3 + 0.5*4 - 2 = 3
    assert torch.equal(out, t([[1.0, 0.0, 2.0, 3.0, 0.0]]))
    g = discounted_return(out, m, gamma=0.5)
    g0 = discounted_return(r, m, gamma=0.5)
    torch.testing.assert_close(g, g0 - 0.5 + 0.5**3 * 4.0)
    # two episodes in one row: terminal after step 1; Phi(terminal) = 0
    r2 = t([[1.0, 1.0, 1.0]])
    phi2 = t([[1.0, 2.0, 3.0, 6.0]])
    term = t([[0, 1, 0]])
    out2 = shape_rewards(r2, phi2, gamma=1.0, terminated=term, zero_terminal_potential=True)
    # r' = [1 + 2 - 1, 1 + 0 - 2, 1 + 6 - 3] = [2, -1, 4]
    assert torch.equal(out2, t([[2.0, -1.0, 4.0]]))
    with pytest.raises(ValueError, match="terminated"):
        shape_rewards(r2, phi2, gamma=1.0, terminated=term)


# ---------------------------------------------------------------- bad input


def test_bad_inputs_raise_naming_the_argument():
    r, v = torch.zeros(2, 4), torch.zeros(2, 4)
    cases = [
        ("rewards", lambda: gae(torch.zeros(4), torch.zeros(4), gamma=0.9, lam=0.9)),
        ("values", lambda: gae(r, torch.zeros(2, 3), gamma=0.9, lam=0.9)),
        ("gamma", lambda: gae(r, v, gamma=1.5, lam=0.9)),
        ("gamma", lambda: gae(r, v, gamma=-0.1, lam=0.9)),
        ("gamma", lambda: gae(r, v, gamma=NAN, lam=0.9)),
        ("lam", lambda: gae(r, v, gamma=0.9, lam=1.01)),
        ("mask", lambda: gae(r, v, gamma=0.9, lam=0.9, mask=torch.full((2, 4), 2))),
        ("mask", lambda: gae(r, v, gamma=0.9, lam=0.9, mask=torch.ones(2, 3))),
        ("terminated", lambda: gae(r, v, gamma=0.9, lam=0.9, terminated=torch.full((2, 4), 0.5))),
        ("truncated", lambda: gae(r, v, gamma=0.9, lam=0.9, truncated=torch.ones(2, 5))),
        ("truncation_value", lambda: gae(r, v, gamma=0.9, lam=0.9, truncated=torch.ones(2, 4))),
        ("truncation_value", lambda: gae(r, v, gamma=0.9, lam=0.9, truncation_value=torch.ones(2, 4))),
        ("truncation_value", lambda: gae(r, v, gamma=0.9, lam=0.9, truncated=torch.ones(2, 4),
                                         truncation_value=torch.full((2, 4), NAN))),
        ("rewards", lambda: gae(t([[0.0, NAN]]), t([[0.0, 0.0]]), gamma=0.9, lam=0.9)),
        ("rewards", lambda: gae(t([[0.0, INF]]), t([[0.0, 0.0]]), gamma=0.9, lam=0.9, mask=torch.ones(1, 2))),
        ("values", lambda: gae(t([[0.0, 0.0]]), t([[-INF, 0.0]]), gamma=0.9, lam=0.9)),
        ("bootstrap_value", lambda: gae(r, v, gamma=0.9, lam=0.9, bootstrap_value=torch.zeros(3))),
        ("bootstrap_value", lambda: gae(r, v, gamma=0.9, lam=0.9, bootstrap_value=t([NAN, 0.0]))),
        ("rewards", lambda: reward_to_go(torch.zeros(3))),
        ("rewards", lambda: reward_to_go(t([[NAN]]))),
        ("gamma", lambda: reward_to_go(r, gamma=2.0)),
        ("terminated", lambda: reward_to_go(r, terminated=torch.full((2, 4), -1))),
        ("rewards", lambda: discounted_return(t([[INF, 0.0]]))),
        ("mask", lambda: discounted_return(r, torch.ones(2, 5))),
        ("n", lambda: n_step_advantage(r, v, 0, gamma=0.9)),
        ("n", lambda: n_step_advantage(r, v, 2.5, gamma=0.9)),
        ("values", lambda: n_step_advantage(r, torch.zeros(2, 2), 2, gamma=0.9)),
        ("rewards", lambda: skip_observation_gae(torch.zeros(3), torch.zeros(3), torch.zeros(2, 2, 2),
                                                 torch.zeros(3), 0.9, 0.9)),
        ("action_end_values", lambda: skip_observation_gae(torch.zeros(2), torch.zeros(3), torch.zeros(3),
                                                           torch.zeros(3), 0.9, 0.9)),
        ("next_action_values", lambda: skip_observation_gae(torch.zeros(3), t([0.0, NAN, 0.0]), torch.zeros(3),
                                                            torch.zeros(3), 0.9, 0.9)),
        ("terminals", lambda: skip_observation_gae(torch.zeros(3), torch.zeros(3), torch.zeros(3),
                                                   t([0.0, 0.3, 1.0]), 0.9, 0.9)),
        ("lam", lambda: skip_observation_gae(torch.zeros(3), torch.zeros(3), torch.zeros(3),
                                             torch.zeros(3), 0.9, -1)),
        ("mask", lambda: token_skip_observation_gae(v, r, None, gamma=0.9, lam=0.9)),
        ("mask", lambda: token_skip_observation_gae(v, r, torch.full((2, 4), 3), gamma=0.9, lam=0.9)),
        ("potentials", lambda: shape_rewards(r, torch.zeros(2, 4), gamma=0.9)),
        ("potentials", lambda: shape_rewards(r, torch.full((2, 5), NAN), gamma=0.9)),
        ("gamma", lambda: shape_rewards(r, torch.zeros(2, 5), gamma=1.2)),
    ]
    for name, fn in cases:
        with pytest.raises(ValueError, match=name):
            fn()


def test_empty_and_single_step_rows():
    out = gae(torch.zeros(2, 0), torch.zeros(2, 0), gamma=0.9, lam=0.9)
    assert out.advantages.shape == (2, 0)
    out = gae(t([[2.0]]), t([[0.5]]), gamma=0.9, lam=0.9, bootstrap_value=1.0)
    torch.testing.assert_close(out.advantages, t([[2.0 + 0.9 - 0.5]]))
    # a row with no valid step gives zeros (and reads no bootstrap)
    out = gae(t([[1.0, 2.0]]), t([[0.0, 0.0]]), gamma=0.9, lam=0.9, mask=torch.zeros(1, 2),
              bootstrap_value=t([NAN]))
    assert torch.equal(out.advantages, torch.zeros(1, 2, dtype=F64))
    assert math.isfinite(float(out.returns.sum()))
