"""The new recipes (cispo, gmpo, dppo_tv, dppo_kl, clip_cov, kl_cov), sequence-level SAPO and
rollout correction through Objective: verify passes, explain prints, policy_loss applies."""
import math

import pytest
import torch

from trajgrad import losses
from trajgrad.logprobs.correction import OFF, RolloutCorrection, rollout_correction
from trajgrad.losses import cov
from trajgrad.objective import RECIPES, explain, explain_diff, get_recipe
from trajgrad.registry import PolicyInputs
from trajgrad.verify import verify

D64 = torch.float64
NEW = ("cispo", "gmpo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov")


@pytest.mark.parametrize("name", ["cispo", "gmpo", "dppo_tv", "dppo_kl"])
def test_verify_passes_the_core_function_against_its_recipe(name):
    o = RECIPES[name]
    kw = {
        "cispo": dict(eps_high=o.eps_high_),
        "gmpo": dict(clip_low=o.log_clip_low, clip_high=o.log_clip_high),
        "dppo_tv": dict(delta_low=o.delta_low, delta_high=o.delta_high),
        "dppo_kl": dict(delta_low=o.delta_low, delta_high=o.delta_high),
    }[name]
    fn = o.term.fn

    def impl(logp, old_logp, advantages, mask, denominator=None):
        return fn(logp, old_logp, advantages, mask, aggregation=o.aggregation, denominator=denominator, **kw)

    rep = verify(impl, name)
    assert rep.passed, rep.table()
    assert all(c.passed is not None for c in rep.checks)  # micro-batches included


def test_verify_catches_a_wrong_cispo():
    def attached(logp, old_logp, advantages, mask, denominator=None):
        r = torch.exp(torch.clamp(logp - old_logp, max=math.log(1.28)))  # weight NOT detached
        m = mask.bool()
        term = torch.where(m, -r * advantages * logp, torch.zeros_like(logp))
        return term.sum() / m.sum()

    assert not verify(attached, "cispo").passed


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_verify_passes_the_covariance_losses_per_batch(name):
    # selection depends on the batch (covariance means and the selected count), so splitting the
    # batch over micro-batches or ranks selects differently: those checks cannot pass by design;
    # every other check must
    o = RECIPES[name]

    def impl(logp, old_logp, advantages, mask):
        if name == "kl_cov":
            return losses.kl_cov_loss(logp, old_logp, advantages, mask, kl_ratio=o.cov_ratio, kl_coef=o.cov_kl_coef)
        seed = cov._batch_seed(PolicyInputs(logp, advantages, mask, None, None, None, None, {}))
        return losses.clip_cov_loss(logp, old_logp, advantages, mask, clip_ratio=o.cov_ratio, cov_low=o.cov_low,
                                    seed=seed)

    rep = verify(impl, name)
    batch_split = {"micro_batches", "ranks_average"}
    assert all(c.passed is not False for c in rep.checks if c.name not in batch_split), rep.table()
    assert {c.name for c in rep.checks} - batch_split >= {"value", "gradient", "masked_nan", "padding"}


@pytest.mark.parametrize("name", NEW)
def test_explain_prints_each_new_recipe(name):
    text = explain(name)
    assert f"recipe: {name}" in text
    assert "per-token term" in text and "detached" in text
    marker = {"cispo": "sg[clip(r_it, 0, 1.28)]", "gmpo": "min(z_it, 0.4)", "dppo_tv": "binary total variation",
              "dppo_kl": "binary KL", "clip_cov": "1 < Cov < 5", "kl_cov": "largest positive Cov"}[name]
    assert marker in text, text


def test_sequence_level_sapo_through_the_recipe():
    o = get_recipe("sapo", sapo_level="sequence")
    assert "sequence-level SAPO" in explain(o)
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4, 6, generator=g, dtype=D64)).requires_grad_(True)
    old = logp.detach() + 0.2 * torch.randn(4, 6, generator=g, dtype=D64)
    adv = torch.randn(4, generator=g, dtype=D64)
    mask = torch.ones(4, 6)
    res = o.policy_loss(logp, adv, mask, old_logp=old)
    ref = losses.sapo_loss(logp, old, adv, mask, level="sequence")
    assert res.loss.item() == pytest.approx(ref.loss.item(), rel=1e-14)
    with pytest.raises(ValueError, match="sapo_level"):
        get_recipe("sapo", sapo_level="turn")
    with pytest.raises(ValueError, match="sapo_level"):
        get_recipe("grpo", sapo_level="sequence")  # not read by PPO


def _batch(seed=0, B=6, L=8):
    g = torch.Generator().manual_seed(seed)
    beh = -torch.rand(B, L, generator=g, dtype=D64) * 2
    old = beh + 0.3 * torch.randn(B, L, generator=g, dtype=D64)
    logp = (old + 0.1 * torch.randn(B, L, generator=g, dtype=D64)).requires_grad_(True)
    adv = torch.randn(B, generator=g, dtype=D64)
    mask = (torch.rand(B, L, generator=g) > 0.2).to(D64)
    return logp, old, beh, adv, mask


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "sapo", "cispo", "gmpo", "dppo_tv", "kl_cov", "reinforce"])
def test_decoupled_correction_multiplies_each_token_term_by_the_weight(name):
    rc = RolloutCorrection(kind="mis", level="token", bounds=(0.8, 1.25))
    base = get_recipe(name)
    o = base.replace(rollout_correction=rc)
    logp, old, beh, adv, mask = _batch()
    res = o.policy_loss(logp, adv, mask, old_logp=old, behaviour_logp=beh, ref_logp=old)
    w = rollout_correction(beh, old, mask, kind="mis", bounds=(0.8, 1.25)).weight
    lp = logp.detach().clone().requires_grad_(True)
    base_nokl = base.replace(kl_coef=0.0, kl_placement="none") if base.kl_placement != "none" else base
    x = PolicyInputs(lp, adv, mask, None if base.term.ratio == "none" else old, old, beh, None,
                     dict(aggregation=base.aggregation, constant=base.constant, denominator=None, weights=w))
    manual = base_nokl.term.call(base_nokl, x)
    kl = 0.0
    if base.kl_placement == "loss":
        kl = res.metrics["kl_loss_term"].item() * base.kl_coef
    assert res.loss.item() == pytest.approx(manual.loss.item() + kl, rel=1e-12)
    assert 0 < res.metrics["correction/masked_frac"].item() < 1
    assert "correction/ess" in res.metrics
    assert "masked IS" in explain(o) and "rollout correction" in explain(o)
    assert "rollout correction" not in explain(base)


def test_bypass_mode_takes_the_ratio_against_the_behaviour_log_probs():
    o = get_recipe("dapo", rollout_correction={"kind": "mis", "bounds": [0.5, 2.0], "mode": "bypass"})
    assert isinstance(o.rollout_correction, RolloutCorrection) and o.rollout_correction.bounds == (0.5, 2.0)
    logp, old, beh, adv, mask = _batch(1)
    res = o.policy_loss(logp, adv, mask, behaviour_logp=beh)  # no old_logp needed
    keep = rollout_correction(beh, logp.detach(), mask, kind="mis", bounds=(0.5, 2.0), mode="bypass").weight
    ref = losses.ppo_clip_loss(logp, beh, adv, mask, eps_low=0.2, eps_high=0.28, weights=keep)
    assert res.loss.item() == pytest.approx(ref.loss.item(), rel=1e-12)
    assert "bypass" in explain(o)


def test_correction_settings_are_validated_and_diffed():
    with pytest.raises(ValueError, match="behaviour_logp"):
        logp, old, beh, adv, mask = _batch()
        get_recipe("grpo", rollout_correction=RolloutCorrection()).policy_loss(logp, adv, mask, old_logp=old,
                                                                              ref_logp=old)
    with pytest.raises(ValueError, match="rollout_correction"):
        get_recipe("sao", rollout_correction=RolloutCorrection(kind="tis"))  # its ratio is to the sampler already
    with pytest.raises(ValueError, match="rollout_correction"):
        get_recipe("dpo", rollout_correction=RolloutCorrection())
    with pytest.raises(ValueError, match="rollout_correction"):
        get_recipe("grpo", rollout_correction={"kind": "tis", "cap": 2.0, "colour": 1})
    with pytest.raises(ValueError, match="cap"):
        get_recipe("grpo", rollout_correction={"kind": "tis", "cap": -2.0})
    with pytest.raises(ValueError, match=r"^rollout_correction\.advantage_level:"):  # SAO's GAE advantages vary per token
        get_recipe("sao", rollout_correction=RolloutCorrection(kind="none", mode="bypass", seq_mask_delta=0.1))
    sao = get_recipe("sao", rollout_correction=RolloutCorrection(kind="none", mode="bypass", seq_mask_delta=0.1,
                                                                 advantage_level="token"))
    assert "drop A<0" in explain(sao)
    assert get_recipe("grpo", rollout_correction=None).rollout_correction is OFF and not OFF
    d = explain_diff("grpo", get_recipe("grpo", rollout_correction=RolloutCorrection(kind="tis", cap=3.0)))
    assert "rollout_correction" in d and "truncated IS min(rho, 3)" in d


def test_correction_metrics_and_masked_tokens_stay_in_the_denominator():
    o = get_recipe("dapo", rollout_correction=RolloutCorrection(kind="none", reject="k3", reject_threshold=0.02,
                                                                reject_level="token"))
    logp, old, beh, adv, mask = _batch(2)
    res = o.policy_loss(logp, adv, mask, old_logp=old, behaviour_logp=beh)
    assert 0 < res.metrics["correction/rejected_frac"].item() < 1
    assert res.metrics["tokens"].item() == mask.sum().item()
    res.loss.backward()
    z = old - beh
    rejected = (z.exp() - 1 - z > 0.02) & (mask > 0)
    assert (logp.grad[rejected] == 0).all() and (logp.grad[~rejected & (mask > 0)] != 0).any()
