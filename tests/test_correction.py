"""Tests for trajgrad.logprobs.correction (rollout correction: TIS, MIS, rejection, sequence masking)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.logprobs.correction import RolloutCorrection, rollout_correction
from trajgrad.losses import ppo_clip_loss, reinforce_loss

D64 = torch.float64


def batch(seed=0, B=6, L=9, noise=0.5):
    g = torch.Generator().manual_seed(seed)
    beh = -torch.rand(B, L, generator=g, dtype=D64) * 3
    old = beh + noise * torch.randn(B, L, generator=g, dtype=D64)
    mask = (torch.rand(B, L, generator=g) > 0.25).to(D64)
    mask[0] = 1
    mask[-1] = 0
    return beh, old, mask


def seq_sum(z, mask):
    return (z * mask).sum(-1)


def test_tis_token_and_sequence_weights():
    beh, old, mask = batch()
    z = old - beh
    c = rollout_correction(beh, old, mask, kind="tis", level="token", cap=1.5)
    want = torch.exp(z).clamp(max=1.5) * mask
    assert torch.allclose(c.weight, want, atol=1e-14)
    assert not c.weight.requires_grad
    n = mask.sum()
    assert c.metrics["correction/truncated_frac"].item() == pytest.approx((((z.exp() > 1.5) & (mask > 0)).sum() / n).item())
    assert c.metrics["correction/kl/k1"].item() == pytest.approx((-(z * mask).sum() / n).item())
    assert c.metrics["correction/kl/k3"].item() == pytest.approx((((z.exp() - 1 - z) * mask).sum() / n).item())
    cs = rollout_correction(beh, old, mask, kind="tis", level="sequence", cap=3.0)
    ws = torch.exp(seq_sum(z, mask)).clamp(max=3.0)[:, None] * mask
    assert torch.allclose(cs.weight, ws, atol=1e-12)
    assert torch.equal(c.keep, mask > 0)  # TIS drops nothing


def test_sequence_products_are_formed_in_log_space():
    L = 4000
    beh = torch.full((2, L), -2.0, dtype=D64)
    old = beh + 0.5  # prod rho = e^2000 overflows; e^-2000 underflows
    old[1] = beh[1] - 0.5
    c = rollout_correction(beh, old, torch.ones(2, L), kind="tis", level="sequence", cap=2.0)
    assert torch.allclose(c.weight[0], torch.full((L,), 2.0, dtype=D64))
    assert (c.weight[1] == 0).all() and torch.isfinite(c.weight).all()
    m = rollout_correction(beh, old, torch.ones(2, L), kind="mis", level="sequence", bounds=(0.5, 2.0))
    assert (m.weight == 0).all() and m.metrics["correction/masked_frac"].item() == 1.0


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_mis_levels(level):
    beh, old, mask = batch(1, noise=0.08 if level == "sequence" else 0.3)
    z = old - beh
    a, b = 0.8, 1.25
    c = rollout_correction(beh, old, mask, kind="mis", level=level, bounds=(a, b))
    lengths = mask.sum(-1).clamp_min(1)
    test = {"token": z, "sequence": seq_sum(z, mask)[:, None].expand_as(z),
            "geometric": (seq_sum(z, mask) / lengths)[:, None].expand_as(z)}[level].exp()
    inside = (test >= a) & (test <= b) & (mask > 0)
    assert torch.equal(c.keep, inside)
    assert torch.allclose(c.weight, torch.where(inside, test, torch.zeros_like(test)), atol=1e-12)
    frac = ((~inside) & (mask > 0)).sum() / mask.sum()
    assert c.metrics["correction/masked_frac"].item() == pytest.approx(frac.item())
    assert 0 < frac < 1


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rejection_by_divergence(est, level):
    beh, old, mask = batch(2, noise=0.4)
    z = old - beh
    k = {"k1": -z, "k2": 0.5 * z * z, "k3": z.exp() - 1 - z}[est]
    thr = 0.05
    c = rollout_correction(beh, old, mask, kind="none", reject=est, reject_threshold=thr, reject_level=level)
    if level == "token":
        rej = (k > thr) & (mask > 0)
    else:
        seq_k = (k * mask).sum(-1) / mask.sum(-1).clamp_min(1)
        rej = (seq_k > thr)[:, None] & (mask > 0)
    assert torch.equal(c.keep, (mask > 0) & ~rej)
    assert torch.equal(c.weight, c.keep.to(D64))
    assert c.metrics["correction/rejected_frac"].item() == pytest.approx((rej.sum() / mask.sum()).item())


def test_deepseek_offpolicy_sequence_masking_only_drops_negative_advantages():
    beh = torch.full((4, 3), -1.0, dtype=D64)
    old = beh.clone()
    old[0] -= 0.5  # mismatch mean(log mu - log pi) = 0.5 > delta, A < 0: dropped
    old[1] -= 0.5  # same mismatch, A > 0: kept
    old[2] -= 0.05  # small mismatch, A < 0: kept
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0], dtype=D64)
    c = rollout_correction(beh, old, torch.ones(4, 3), advantages=adv, kind="none", seq_mask_delta=0.1)
    assert c.keep.all(-1).tolist() == [False, True, True, True]
    assert c.metrics["correction/seq_masked_frac"].item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="advantages"):
        rollout_correction(beh, old, torch.ones(4, 3), kind="none", seq_mask_delta=0.1)


def test_bypass_mode_weights_are_the_keep_mask():
    beh, old, mask = batch(3)
    c = rollout_correction(beh, old, mask, kind="mis", bounds=(0.7, 1.4), mode="bypass")
    assert torch.equal(c.weight, c.keep.to(D64))
    with pytest.raises(ValueError, match="mode"):
        rollout_correction(beh, old, mask, kind="tis", mode="bypass")


def test_ess_and_weight_statistics():
    beh, old, mask = batch(4)
    c = rollout_correction(beh, old, mask, kind="tis", cap=2.0)
    w = c.weight[mask > 0]
    n = w.numel()
    assert c.metrics["correction/ess"].item() == pytest.approx((w.sum() ** 2 / (w * w).sum() / n).item())
    assert c.metrics["correction/weight/min"].item() == pytest.approx(w.min().item())
    assert c.metrics["correction/weight/max"].item() == pytest.approx(w.max().item())
    assert c.metrics["correction/weight/mean"].item() == pytest.approx(w.mean().item())


def test_identical_sources_are_a_no_op():
    beh, _, mask = batch(5)
    for kw in ({"kind": "tis"}, {"kind": "mis"}, {"kind": "none", "reject": "k3", "reject_threshold": 1e-9}):
        c = rollout_correction(beh, beh.clone(), mask, **kw)
        assert torch.equal(c.weight, mask)
        assert c.metrics["correction/ess"].item() == pytest.approx(1.0)
        assert c.metrics["correction/kl/k1"].item() == 0.0


@settings(max_examples=20, deadline=None)
@given(v=st.sampled_from([math.nan, math.inf, -math.inf]), which=st.sampled_from(["beh", "old"]))
def test_nonfinite_at_masked_positions_is_inert(v, which):
    beh, old, mask = batch(6)
    mask[1, 1] = 0
    c0 = rollout_correction(beh, old, mask, kind="mis", level="geometric", reject="k2", reject_threshold=0.5)
    x = {"beh": beh.clone(), "old": old.clone()}
    x[which][1, 1] = v
    c = rollout_correction(x["beh"], x["old"], mask, kind="mis", level="geometric", reject="k2", reject_threshold=0.5)
    assert torch.equal(c.weight, c0.weight)
    assert all(torch.equal(c.metrics[k], c0.metrics[k]) for k in c0.metrics)


def test_weights_in_a_loss_leave_the_numerator_not_the_denominator():
    beh, old, mask = batch(7)
    g = torch.Generator().manual_seed(0)
    logp = (old + 0.1 * torch.randn(old.shape, generator=g, dtype=D64)).requires_grad_(True)
    adv = torch.randn(old.shape, generator=g, dtype=D64)
    c = RolloutCorrection(kind="mis", bounds=(0.7, 1.4))(beh, old, mask)
    res = ppo_clip_loss(logp, old, adv, mask, weights=c.weight)
    plain = ppo_clip_loss(logp.detach(), old, adv, mask)
    assert plain.metrics["tokens"] == res.metrics["tokens"]
    # decoupled: per-token PPO term times the detached weight, divided by ALL valid tokens
    lp = logp.detach().clone().requires_grad_(True)
    r = torch.exp(lp - old)
    s = torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    manual = -(c.apply(s)).sum() / mask.sum()
    assert res.loss.item() == pytest.approx(manual.item(), rel=1e-12)
    res.loss.backward()
    manual.backward()
    assert torch.allclose(logp.grad, lp.grad, atol=1e-14)
    # aggregating over the keep mask removes the dropped tokens from the denominator too
    kept = reinforce_loss(logp.detach(), adv, c.denominator_mask().to(D64))
    assert kept.metrics["tokens"].item() == c.keep.sum().item() < mask.sum().item()


@pytest.mark.parametrize(
    "kw,name",
    [
        ({"kind": "is"}, "kind"),
        ({"kind": "tis", "level": "arithmetic"}, "level"),
        ({"cap": 0.0}, "cap"),
        ({"cap": math.inf}, "cap"),
        ({"kind": "mis", "bounds": (2.0, 1.0)}, "bounds"),
        ({"kind": "mis", "bounds": (0.5,)}, "bounds"),
        ({"reject": "k4", "reject_threshold": 1.0}, "reject"),
        ({"reject": "k1"}, "reject_threshold"),
        ({"reject_threshold": 1.0}, "reject_threshold"),
        ({"seq_mask_delta": -1.0}, "seq_mask_delta"),
        ({"mode": "x"}, "mode"),
    ],
)
def test_bad_settings_name_themselves(kw, name):
    beh, old, mask = batch()
    with pytest.raises(ValueError, match=name):
        rollout_correction(beh, old, mask, **kw)


def test_bad_tensors_name_themselves():
    beh, old, mask = batch()
    bad = old.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="target_logp"):
        rollout_correction(beh, bad, mask)
    with pytest.raises(ValueError, match="behaviour_logp"):
        rollout_correction(bad, old, mask)
    with pytest.raises(ValueError, match="mask"):
        rollout_correction(beh, old, mask * 3)
    with pytest.raises(ValueError, match="target_logp"):
        rollout_correction(beh, old[:, :2], mask)


def test_describe_names_the_setting():
    text = RolloutCorrection(kind="mis", level="geometric", bounds=(0.5, 2.0), reject="k3", reject_threshold=0.1,
                             seq_mask_delta=0.2).describe()
    assert "masked IS" in text and "geometric" in text and "k3" in text and "A<0" in text and "denominator" in text
