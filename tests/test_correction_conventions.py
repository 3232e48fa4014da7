"""Rollout-correction conventions against hand loops written from the papers: the DeepSeek-V3.2
off-policy sequence mask (advantage level, mismatch policy), TIS at geometric level, two-sided
TIS, MIS with equal bounds."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.logprobs.correction import RolloutCorrection, rollout_correction
from trajgrad.losses import reinforce_loss

D64 = torch.float64


def _batch(seed, B=5, L=6):
    g = torch.Generator().manual_seed(seed)
    beh = -torch.rand(B, L, generator=g, dtype=D64) * 2
    old = beh - 0.4 * torch.rand(B, L, generator=g, dtype=D64)
    cur = old + 0.3 * torch.randn(B, L, generator=g, dtype=D64)
    mask = torch.rand(B, L, generator=g) > 0.3
    mask[0] = True
    adv = torch.randn(B, L, generator=g, dtype=D64)
    return beh, old, cur, mask, adv


def _opsm_hand(beh, pi, mask, adv, delta, level):
    """DeepSeek-V3.2 eq.: M[i,t] = 0 if A[i,t] < 0 and (1/|o_i|) sum_t log(mu/pi) > delta, else 1."""
    B, L = mask.shape
    keep = [[False] * L for _ in range(B)]
    for i in range(B):
        ts = [t for t in range(L) if mask[i, t]]
        if not ts:
            continue
        mism = sum(float(beh[i, t]) - float(pi[i, t]) for t in ts) / len(ts)
        row_a = sum(float(adv[i, t]) for t in ts) / len(ts)
        for t in ts:
            a = float(adv[i, t]) if level == "token" else row_a
            keep[i][t] = not (a < 0 and mism > delta)
    return torch.tensor(keep)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("policy", ["current", "proximal"])
def test_opsm_levels_and_policies_match_the_paper_in_value_and_gradient(level, policy):
    beh, old, cur, mask, adv = _batch(3, B=10)
    delta = 0.1
    c = rollout_correction(beh, old, mask, advantages=adv, kind="none", seq_mask_delta=delta,
                           advantage_level=level, mismatch_policy=policy, current_logp=cur)
    want = _opsm_hand(beh, cur if policy == "current" else old, mask, adv, delta, level)
    assert torch.equal(c.keep, want) and 0 < int((mask & ~want).sum()) < int(mask.sum())
    # the corrected REINFORCE loss -sum_t M A log pi / N and its gradient, against the hand loop
    logp = cur.clone().requires_grad_(True)
    got = reinforce_loss(logp, adv, mask.to(D64), weights=c.weight).loss
    g_got, = torch.autograd.grad(got, logp)
    lp = cur.clone().requires_grad_(True)
    hand = sum(-float(adv[i, t]) * lp[i, t] for i in range(10) for t in range(6) if want[i, t]) / int(mask.sum())
    g_hand, = torch.autograd.grad(hand, lp)
    assert torch.allclose(got, hand, atol=1e-12) and torch.allclose(g_got, g_hand, atol=1e-12)


def test_opsm_docstring_worked_example():
    beh = torch.tensor([[-1.0, -1.0]], dtype=D64)
    tgt = beh - torch.tensor([[0.3, 0.1]], dtype=D64)  # log mu - log pi = (0.3, 0.1), mismatch 0.2 > 0.1
    adv = torch.tensor([[1.0, -1.0]], dtype=D64)
    m = torch.ones(1, 2, dtype=torch.bool)
    keep = {lv: rollout_correction(beh, tgt, m, advantages=adv, kind="none", seq_mask_delta=0.1,
                                   advantage_level=lv).keep.tolist() for lv in ("token", "sequence", "first")}
    assert keep == {"token": [[True, False]], "sequence": [[True, True]], "first": [[True, True]]}
    with pytest.raises(ValueError, match="advantage_level"):
        rollout_correction(beh, tgt, m, advantages=adv, kind="none", seq_mask_delta=0.1)


def test_opsm_default_is_the_earlier_first_valid_convention_where_it_is_defined():
    beh, old, cur, mask, adv = _batch(5, B=8)
    per_row = adv[:, 0]
    row_const = per_row[:, None].expand_as(adv).clone()
    row_const[~mask] = math.nan  # masked positions never count
    for a in (per_row, row_const):
        base = rollout_correction(beh, old, mask, advantages=a, kind="none", seq_mask_delta=0.1)
        for lv in ("first", "sequence", "token"):
            other = rollout_correction(beh, old, mask, advantages=a, kind="none", seq_mask_delta=0.1,
                                       advantage_level=lv)
            assert torch.equal(base.keep, other.keep) and torch.equal(base.weight, other.weight)
        assert 0 < int(base.drops["seq_masked"].sum())
    # "first" reproduces the earlier convention on row-varying advantages: the first valid token's sign
    first = rollout_correction(beh, old, mask, advantages=adv, kind="none", seq_mask_delta=0.1,
                               advantage_level="first")
    for i in range(8):
        t0 = int(mask[i].to(torch.int8).argmax())
        mism = float(((beh[i] - old[i]) * mask[i]).sum() / mask[i].sum())
        dropped = float(adv[i, t0]) < 0 and mism > 0.1
        assert first.keep[i][mask[i]].tolist() == [not dropped] * int(mask[i].sum())


def test_opsm_masked_positions_do_not_leak():
    beh, old, cur, mask, adv = _batch(7)
    kw = dict(kind="tis", seq_mask_delta=0.1, advantage_level="sequence", mismatch_policy="current")
    base = rollout_correction(beh, old, mask, advantages=adv, current_logp=cur, **kw)
    poison = lambda x, v: torch.where(mask, x, torch.full_like(x, v))  # noqa: E731
    for v in (math.nan, math.inf, -math.inf):
        c = rollout_correction(poison(beh, v), poison(old, v), mask, advantages=poison(adv, v),
                               current_logp=poison(cur, v), **kw)
        assert torch.equal(c.weight, base.weight) and torch.equal(c.keep, base.keep)


@pytest.mark.parametrize("kw,name", [
    ({"advantage_level": "row"}, "advantage_level"),
    ({"mismatch_policy": "sampler"}, "mismatch_policy"),
    ({"advantage_level": "token", "seq_mask_delta": None}, "advantage_level"),
    ({"mismatch_policy": "current", "seq_mask_delta": None}, "mismatch_policy"),
    ({"mismatch_policy": "proximal", "mode": "bypass", "kind": "none"}, "mismatch_policy"),
    ({"mismatch_policy": "current", "advantage_level": "token"}, "current_logp"),
    ({"cap_low": 0.0}, "cap_low"),
    ({"cap_low": 3.0, "cap": 2.0}, "cap_low"),
    ({"cap_low": 0.5, "kind": "mis"}, "cap_low"),
    ({"kind": "mis", "bounds": (0.0, 0.0)}, "bounds"),
])
def test_new_settings_name_themselves(kw, name):
    beh, old, cur, mask, adv = _batch(1)
    kw = {"seq_mask_delta": 0.1, **kw}
    with pytest.raises(ValueError, match=name):
        rollout_correction(beh, old, mask, advantages=adv, **kw)


def test_bypass_current_is_the_target_and_describe_names_the_choices():
    beh, old, cur, mask, adv = _batch(2)
    a = rollout_correction(beh, cur, mask, advantages=adv, kind="none", mode="bypass", seq_mask_delta=0.1,
                           advantage_level="token", mismatch_policy="current")
    b = rollout_correction(beh, cur, mask, advantages=adv, kind="none", mode="bypass", seq_mask_delta=0.1,
                           advantage_level="token")
    assert torch.equal(a.keep, b.keep)
    text = RolloutCorrection(kind="tis", cap_low=0.5, seq_mask_delta=0.1, advantage_level="token",
                             mismatch_policy="current").describe()
    assert "min(max(rho, 0.5), 2)" in text and "A per token, pi = the current policy" in text
    assert RolloutCorrection(seq_mask_delta=0.1).describe() == (
        "decoupled: truncated IS min(rho, 2) at token level; rho = pi_old/mu; drop A<0 sequences with "
        "mean(log mu - log pi) > 0.1; sequence mask: A one per sequence ([B, L] must be constant per row), "
        "pi = the proximal policy; dropped tokens stay in the denominator")
    bypass = RolloutCorrection(kind="none", mode="bypass", seq_mask_delta=0.1, advantage_level="sequence")
    assert "A the row's mean, pi = the current policy" in bypass.describe()
    # without the sequence mask the text is the earlier one
    assert RolloutCorrection(kind="tis", cap=3.0).describe() == (
        "decoupled: truncated IS min(rho, 3) at token level; rho = pi_old/mu; dropped tokens stay in the denominator")


def _tis_hand(beh, tgt, mask, level, cap, cap_low):
    """w = min(max(r, c), C) with r = rho_t (token), prod rho (sequence) or its geometric mean."""
    B, L = mask.shape
    w = torch.zeros(B, L, dtype=D64)
    for i in range(B):
        ts = [t for t in range(L) if mask[i, t]]
        for t in ts:
            if level == "token":
                r = math.exp(float(tgt[i, t] - beh[i, t]))
            else:
                s = sum(float(tgt[i, u] - beh[i, u]) for u in ts)
                r = math.exp(s if level == "sequence" else s / len(ts))
            w[i, t] = min(max(r, cap_low or 0.0), cap)
    return w


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("cap_low", [None, 0.8])
def test_tis_levels_and_two_sided_match_the_hand_loop(level, cap_low):
    beh, old, cur, mask, adv = _batch(11)
    c = rollout_correction(beh, old + 0.2 * (cur - old), mask, kind="tis", level=level, cap=1.3, cap_low=cap_low)
    want = _tis_hand(beh, old + 0.2 * (cur - old), mask, level, 1.3, cap_low)
    assert torch.allclose(c.weight, want, atol=1e-12)
    logp = cur.clone().requires_grad_(True)
    g, = torch.autograd.grad(reinforce_loss(logp, adv, mask.to(D64), weights=c.weight).loss, logp)
    assert torch.allclose(g, -want * adv / mask.sum(), atol=1e-12)


def test_tis_and_mis_docstring_worked_examples():
    one = torch.ones(1, 3, dtype=torch.bool)
    beh = torch.zeros(1, 3, dtype=D64)
    rho = torch.tensor([[4.0, 1.0, 0.25]], dtype=D64)
    c = rollout_correction(beh, rho.log(), one, kind="tis", cap=2.0, cap_low=0.5)
    assert torch.allclose(c.weight, torch.tensor([[2.0, 1.0, 0.5]], dtype=D64))
    assert c.metrics["correction/truncated_frac"].item() == pytest.approx(2 / 3)
    two = torch.ones(1, 2, dtype=torch.bool)
    g = rollout_correction(torch.zeros(1, 2, dtype=D64), torch.tensor([[math.log(4.0), 0.0]], dtype=D64), two,
                           kind="tis", level="geometric", cap=1.5)
    assert torch.allclose(g.weight, torch.full((1, 2), 1.5, dtype=D64))
    m = rollout_correction(torch.zeros(1, 2, dtype=D64), torch.tensor([[0.0, math.log(2.0)]], dtype=D64), two,
                           kind="mis", bounds=(1.0, 1.0))
    assert m.weight.tolist() == [[1.0, 0.0]] and m.keep.tolist() == [[True, False]]


@settings(max_examples=30, deadline=None)
@given(z=st.lists(st.floats(-3, 3), min_size=1, max_size=6), a=st.floats(0.1, 3.0))
def test_mis_equal_bounds_keep_exactly_the_ratio_at_the_bound(z, a):
    zt = torch.tensor([z], dtype=D64)
    zt[0, 0] = math.log(a)
    m = rollout_correction(torch.zeros_like(zt), zt, torch.ones_like(zt, dtype=torch.bool), kind="mis",
                           bounds=(a, a))
    want = [math.log(a) <= float(v) <= math.log(a) for v in zt[0]]
    assert m.keep[0].tolist() == want and m.keep[0, 0]
    assert torch.allclose(m.weight[0, 0], torch.tensor(a, dtype=D64))


@settings(max_examples=30, deadline=None)
@given(z=st.lists(st.floats(-4, 4), min_size=1, max_size=6), lo=st.floats(0.05, 0.95), hi=st.floats(1.05, 5.0))
def test_two_sided_tis_weights_lie_within_the_caps(z, lo, hi):
    zt = torch.tensor([z], dtype=D64)
    w = rollout_correction(torch.zeros_like(zt), zt, torch.ones_like(zt, dtype=torch.bool), kind="tis",
                           cap=hi, cap_low=lo).weight
    assert bool(((w >= lo * (1 - 1e-12)) & (w <= hi * (1 + 1e-12))).all())
