"""Recipes as data: validation, explain() text generated from fields, losses through the core."""
import math

import pytest
import torch

from trajgrad import losses
from trajgrad.aggregate import Normalizer, aggregate
from trajgrad.objective import RECIPES, Objective, explain, get_recipe

F64 = torch.float64


def _batch(seed=0, B=4, L=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=F64) * 2
    old = logp + 0.3 * torch.randn(B, L, generator=g, dtype=F64)
    ref = logp + 0.2 * torch.randn(B, L, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)[:, None].expand(B, L).clone()
    mask = (torch.rand(B, L, generator=g, dtype=F64) > 0.3).double()
    mask[:, 0] = 1
    return logp, old, ref, adv, mask


def test_twelve_recipes_and_explain_each():
    assert set(RECIPES) >= {"reinforce", "rloo", "grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "sapo", "ppo",
                            "sao", "opd", "dpo"}
    for name in RECIPES:
        text = explain(name)
        assert name in text and "aggregation" in text and "detached" in text


def test_explain_reflects_overrides():
    assert "1 + 0.28" in explain("dapo")
    assert "1 + 0.35" in explain("dapo", eps_high=0.35)
    assert "attached" in explain("sao", ratio_gradient="attached")
    assert "A r (1 + log π)" in explain("sao", ratio_gradient="attached")
    assert "KL to reference: none" in explain("grpo") and "KL to reference: none" in explain("grpo", kl_coef=0.0,
                                                                                            kl_placement="none")
    assert "+ 0.04 · aggregate(k3" in explain("grpo", kl_placement="loss", kl_coef=0.04)


@pytest.mark.parametrize(
    "field,value",
    [("loss", "nope"), ("aggregation", "mean"), ("eps_low", 0.0), ("gamma", 1.5), ("kl_kind", "k4"),
     ("ratio_gradient", "half"), ("group_size", 1), ("dual_clip", 0.5)],
)
def test_bad_fields_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RECIPES["grpo"].replace(**{field: value})


def test_unknown_recipe_and_field():
    with pytest.raises(ValueError, match="recipe"):
        get_recipe("grpo2")
    with pytest.raises(ValueError, match="not_a_field"):
        get_recipe("grpo", not_a_field=1)


def test_grpo_policy_loss_is_ppo_plus_k3_term():
    logp, old, ref, adv, mask = _batch()
    obj = RECIPES["grpo"].replace(kl_placement="loss", kl_coef=0.04)  # DeepSeekMath's KL term
    lp1 = logp.clone().requires_grad_(True)
    res = obj.policy_loss(lp1, adv, mask, old_logp=old, ref_logp=ref)
    lp2 = logp.clone().requires_grad_(True)
    manual = losses.ppo_clip_loss(lp2, old, adv, mask, eps_low=0.2, eps_high=0.2, aggregation="seq_mean_token_mean").loss
    manual = manual + 0.04 * aggregate(losses.kl_estimate(lp2, ref, mask, kind="k3"), mask, "seq_mean_token_mean")
    assert torch.allclose(res.loss, manual, atol=1e-12)
    g1, = torch.autograd.grad(res.loss, lp1)
    g2, = torch.autograd.grad(manual, lp2)
    assert torch.allclose(g1, g2, atol=1e-12)


@pytest.mark.parametrize("name", ["reinforce", "rloo", "grpo", "dr_grpo", "dapo", "gspo", "gspo_token", "sapo", "ppo", "sao"])
def test_micro_batches_with_global_denominator_equal_full_batch(name):
    obj = RECIPES[name]
    logp, old, ref, adv, mask = _batch(seed=3, B=6, L=7)
    if obj.loss == "gspo":
        adv = adv  # constant per sequence already
    lp = logp.clone().requires_grad_(True)
    full = obj.policy_loss(lp, adv, mask, old_logp=old, ref_logp=ref).loss
    gfull, = torch.autograd.grad(full, lp)
    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
    norm = Normalizer.from_masks([mask[p] for p in parts], obj.aggregation, constant=obj.constant)
    lp2 = logp.clone().requires_grad_(True)
    total = sum(obj.policy_loss(lp2[p], adv[p], mask[p], old_logp=old[p], ref_logp=ref[p],
                                denominator=norm.denominator()).loss for p in parts)
    g2, = torch.autograd.grad(total, lp2)
    assert torch.allclose(total, full, atol=1e-12)
    assert torch.allclose(g2, gfull, atol=1e-12)


def test_sequence_advantages_group_estimators():
    r = torch.tensor([[0.0, 1.0, 2.0]], dtype=F64)
    assert torch.allclose(RECIPES["rloo"].replace(group_size=3).sequence_advantages(r).advantages,
                          torch.tensor([[-1.5, 0.0, 1.5]], dtype=F64))
    centred = RECIPES["dr_grpo"].sequence_advantages(r).advantages
    assert torch.allclose(centred, torch.tensor([[-1.0, 0.0, 1.0]], dtype=F64))
    std = RECIPES["grpo"].sequence_advantages(r).advantages
    assert torch.allclose(std, torch.tensor([[-1.0, 0.0, 1.0]], dtype=F64) / (math.sqrt(2 / 3) + 1e-6))


def test_kl_in_reward_is_detached_and_zero_when_not_in_reward():
    logp, old, ref, adv, mask = _batch()
    lp = logp.clone().requires_grad_(True)
    pen = RECIPES["ppo"].kl_in_reward(lp, ref, mask)
    assert not pen.requires_grad
    assert torch.allclose(pen, 0.05 * torch.where(mask.bool(), logp - ref, 0.0))
    assert torch.count_nonzero(RECIPES["grpo"].kl_in_reward(lp, ref, mask)) == 0


def test_policy_loss_requires_its_inputs():
    logp, old, ref, adv, mask = _batch()
    with pytest.raises(ValueError, match="old_logp"):
        RECIPES["ppo"].policy_loss(logp, adv, mask)
    with pytest.raises(ValueError, match="ref_logp"):
        get_recipe("grpo", kl_placement="loss", kl_coef=0.04).policy_loss(logp, adv, mask, old_logp=old)
    with pytest.raises(ValueError, match="loss"):
        RECIPES["dpo"].policy_loss(logp, adv, mask)
