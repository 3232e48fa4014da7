"""Peer recipes (verl 0.9.1, TRL 1.16.0) reproduced exactly, and the new estimators' recipes.

Each test writes the peer's documented defaults with their source and checks the recipe
against them, then compares the recipe's advantages / loss / gradient with the peer's formula
written out by hand here (not imported: neither peer is a dependency).
"""
from __future__ import annotations

import math

import pytest
import torch

from trajgrad import advantages as adv_mod
from trajgrad import losses
from trajgrad.objective import RECIPES, explain, explain_diff, get_recipe

F64 = torch.float64
B, L = 6, 9


def _batch(seed=0, noise=0.8):
    g = torch.Generator().manual_seed(seed)
    logp0 = -torch.rand(B, L, generator=g, dtype=F64) * 3
    old = logp0 + noise * torch.randn(B, L, generator=g, dtype=F64)  # ratios beyond 3 occur: dual clip bites
    ref = logp0 + 0.5 * torch.randn(B, L, generator=g, dtype=F64)
    ref[0, 0] = logp0[0, 0] + 12.0  # k3 > 10 at one token: the clamp bites
    adv = torch.randn(B, generator=g, dtype=F64)[:, None].expand(B, L).clone()
    lengths = torch.tensor([9, 4, 7, 1, 9, 5])
    mask = torch.arange(L)[None, :] < lengths[:, None]
    return logp0, old, ref, adv, mask


def _verl_vanilla_pg(logp, old, adv, mask, clip=0.2, clip_c=3.0):
    """verl compute_policy_loss_vanilla + agg_loss('token-mean'), written out."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    c1 = torch.maximum(l1, l2)
    c2 = torch.minimum(-adv * clip_c, c1)
    per = torch.where(adv < 0, c2, c1)
    m = mask.to(F64)
    return (torch.where(mask, per, 0.0) * m).sum() / m.sum()


def _verl_low_var_kl(logp, ref):
    kl = torch.clamp(ref - logp, -20, 20)
    return torch.clamp(torch.exp(kl) - kl - 1, -10, 10)


def _token_mean(x, mask):
    return torch.where(mask, x, 0.0).sum() / mask.sum()


# ---------------------------------------------------------------------------------- verl
def test_verl_grpo_reproduces_verl_defaults():
    """verl 0.9.1 (wheel verl-0.9.1-py3-none-any.whl; docs/algo/grpo.md):

    * advantages: ``compute_grpo_outcome_advantage``: (score − mean) / (torch.std + 1e-6), torch.std
      is Bessel's; ``norm_adv_by_std_in_grpo: True`` (ppo_trainer.yaml);
    * policy loss ``vanilla``: clip_ratio 0.2 (low = high = 0.2), dual clip ``clip_ratio_c: 3.0``
      always on, ``loss_agg_mode: token-mean`` (actor.yaml);
    * KL: grpo.md "use_kl_loss ... Please set it to True for GRPO", ``kl_loss_coef: 0.001``,
      ``kl_loss_type: low_var_kl`` = k3 clamped to [−10, 10] (``kl_penalty_forward``), aggregated
      with the same loss_agg_mode; ``use_kl_in_reward: False``; ``entropy_coeff: 0``;
    * group size: ``rollout.n=5`` in examples/grpo_trainer/run_qwen3-8b.sh (config default 1).
    """
    o = RECIPES["verl-grpo"]
    assert (o.loss, o.advantage, o.aggregation) == ("ppo", "group_std", "token_mean")
    assert (o.eps_low, o.eps_high_, o.dual_clip) == (0.2, 0.2, 3.0)
    assert (o.std_unbiased, o.std_eps) == (True, 1e-6)
    assert (o.kl_placement, o.kl_coef, o.kl_kind, o.kl_bias_correction) == ("loss", 0.001, "low_var_kl", False)
    assert (o.entropy_coef, o.group_size) == (0.0, 5)
    # advantages: verl's per-group torch.std loop
    g = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 2, (4, 5), generator=g).to(F64) + 0.1 * torch.randn(4, 5, generator=g, dtype=F64)
    ref = torch.stack([(r - r.mean()) / (torch.std(r) + 1e-6) for r in rewards])
    assert torch.allclose(o.sequence_advantages(rewards).advantages, ref, atol=1e-14)
    # loss: vanilla PG (dual clip) + 0.001 · token-mean(low_var_kl), value and gradient
    logp0, old, ref_lp, adv, mask = _batch()
    a = logp0.clone().requires_grad_(True)
    ours = o.policy_loss(a, adv, mask, old_logp=old, ref_logp=ref_lp).loss
    b = logp0.clone().requires_grad_(True)
    theirs = _verl_vanilla_pg(b, old, adv, mask) + 0.001 * _token_mean(_verl_low_var_kl(b, ref_lp), mask)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-12)
    (ga,), (gb,) = torch.autograd.grad(ours, a), torch.autograd.grad(theirs, b)
    assert torch.allclose(ga, gb, atol=1e-13)
    # the dual clip and the KL clamp both act on this batch (the comparison is not vacuous)
    assert bool(((adv < 0) & (logp0 - old > math.log(3.0)) & mask).any())
    assert _verl_low_var_kl(logp0, ref_lp).max().item() == 10.0


def test_verl_k3_plus_is_low_var_kl_plus():
    """verl ``kl_loss_type: k3+``: value of (clamped) k3, gradient of k2 (``kl_penalty``)."""
    o = get_recipe("verl-grpo", kl_kind="low_var_kl+")
    logp0, old, ref_lp, adv, mask = _batch(1)
    a = logp0.clone().requires_grad_(True)
    ours = o.policy_loss(a, adv, mask, old_logp=old, ref_logp=ref_lp).loss
    b = logp0.clone().requires_grad_(True)
    k2 = 0.5 * (b - ref_lp) ** 2
    kl = k2 - k2.detach() + _verl_low_var_kl(b, ref_lp).detach()
    theirs = _verl_vanilla_pg(b, old, adv, mask) + 0.001 * _token_mean(kl, mask)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-12)
    (ga,), (gb,) = torch.autograd.grad(ours, a), torch.autograd.grad(theirs, b)
    assert torch.allclose(ga, gb, atol=1e-13)


def test_verl_ppo_reproduces_verl_defaults():
    """verl 0.9.1 PPO (ppo_trainer.yaml, actor.yaml, critic.yaml, core_algos.py):

    * ``adv_estimator: gae``, ``gamma: 1.0``, ``lam: 1.0``; ``compute_gae_advantage_return`` ends with
      ``masked_whiten(advantages, response_mask)`` (shift_mean=True, Bessel variance over tokens,
      rsqrt(var + 1e-8)); returns = advantages + values before whitening;
    * actor: clip 0.2, dual clip 3.0, token-mean; critic ``cliprange_value: 0.5``, value loss
      0.5 · token-mean(max((V − R)², (clip_by_value(V, V_old ± 0.5) − R)²));
    * ``use_kl_in_reward: False`` and ``use_kl_loss: false``: no KL; ``entropy_coeff: 0``.
    """
    o = RECIPES["verl-ppo"]
    assert (o.loss, o.advantage, o.aggregation, o.critic) == ("ppo", "gae", "token_mean", True)
    assert (o.gamma, o.lam, o.whiten_advantages) == (1.0, 1.0, True)
    assert (o.eps_low, o.eps_high_, o.dual_clip, o.value_clip) == (0.2, 0.2, 3.0, 0.5)
    assert (o.kl_placement, o.entropy_coef) == ("none", 0.0)
    g = torch.Generator().manual_seed(5)
    values = torch.randn(B, L, generator=g, dtype=F64)
    lengths = torch.tensor([9, 4, 7, 1, 9, 5])
    mask = torch.arange(L)[None, :] < lengths[:, None]
    rewards = torch.zeros(B, L, dtype=F64)
    rewards[torch.arange(B), lengths - 1] = torch.randn(B, generator=g, dtype=F64)
    out = o.token_advantages(values, rewards, mask, bootstrap_value=0.0)
    # verl's GAE loop (right-padded single turn), then its masked_whiten
    m = mask.to(F64)
    nextv, last, rev = torch.zeros(B, dtype=F64), torch.zeros(B, dtype=F64), []
    for t in reversed(range(L)):
        delta = rewards[:, t] + nextv - values[:, t]
        lg = delta + last
        nextv = values[:, t] * m[:, t] + (1 - m[:, t]) * nextv
        last = lg * m[:, t] + (1 - m[:, t]) * last
        rev.append(last)
    a = torch.stack(rev[::-1], 1)
    ret = a + values
    mean = (a * m).sum() / m.sum()
    var = (((a - mean) ** 2) * m).sum() / (m.sum() - 1)
    white = (a - mean) * torch.rsqrt(var + 1e-8)
    assert torch.allclose(out.advantages[mask], white[mask], atol=1e-12)
    assert torch.allclose(out.returns[mask], ret[mask], atol=1e-12)
    # the value loss
    vpred0 = values + 0.8 * torch.randn(B, L, generator=g, dtype=F64)
    vp = vpred0.clone().requires_grad_(True)
    ours = o.value_loss(vp, ret, mask, old_values=values).loss
    vp2 = vpred0.clone().requires_grad_(True)
    clipped = torch.minimum(torch.maximum(vp2, values - 0.5), values + 0.5)
    theirs = 0.5 * _token_mean(torch.maximum((vp2 - ret) ** 2, (clipped - ret) ** 2), mask)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-12)
    (ga,), (gb,) = torch.autograd.grad(ours, vp), torch.autograd.grad(theirs, vp2)
    assert torch.allclose(ga, gb, atol=1e-13)


# ----------------------------------------------------------------------------------- TRL
def _trl_grpo_loss(logp, old, ref, adv, mask, eps_low=0.2, eps_high=0.2, beta=0.0, bias_correction=True):
    """TRL 1.16 GRPOTrainer._compute_loss, loss_type='dapo', token-level IS, written out."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if bias_correction:
            kl = kl * coef_1
        per = per + beta * kl
    return _token_mean(per, mask)


def test_trl_grpo_reproduces_trl_defaults():
    """TRL 1.16.0 GRPOConfig (trl/trainer/grpo_config.py) and GRPOTrainer:

    * ``scale_rewards="group"``: (R − group mean) / (nanstd + 1e-4), ``nanstd`` Bessel-corrected;
    * ``loss_type="dapo"``: Σ per-token loss / active tokens of the accumulated batch (token mean
      with a global denominator); ``epsilon=0.2``, ``epsilon_high=None`` (= epsilon), no ``delta``;
    * ``beta=0.0``: no KL term and no reference model; when beta ≠ 0 the KL is k3 added to the
      per-token loss, and ``use_bias_correction_kl=True`` (default) multiplies it by the attached
      ratio π_θ/π_old; ``num_generations=8``; ``entropy_coef=0``; ``num_iterations=1``;
      ``importance_sampling_level="token"``; vLLM IS correction only with ``use_vllm=True``
      (default False), rollout correction being a separate option.
    """
    o = RECIPES["trl-grpo"]
    assert (o.loss, o.advantage, o.aggregation) == ("ppo", "group_std", "token_mean")
    assert (o.std_unbiased, o.std_eps, o.eps_low, o.eps_high_, o.dual_clip) == (True, 1e-4, 0.2, 0.2, None)
    assert (o.kl_placement, o.kl_coef, o.group_size, o.entropy_coef) == ("none", 0.0, 8, 0.0)
    g = torch.Generator().manual_seed(7)
    rewards = torch.randint(0, 3, (3, 8), generator=g).to(F64)
    ref_adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    assert torch.allclose(o.sequence_advantages(rewards).advantages, ref_adv, atol=1e-14)
    logp0, old, ref_lp, adv, mask = _batch(2)
    for recipe, kw in ((o, dict(beta=0.0)),
                       (get_recipe("trl-grpo", kl_placement="loss", kl_coef=0.04), dict(beta=0.04))):
        a = logp0.clone().requires_grad_(True)
        ours = recipe.policy_loss(a, adv, mask, old_logp=old, ref_logp=ref_lp).loss
        b = logp0.clone().requires_grad_(True)
        theirs = _trl_grpo_loss(b, old, ref_lp, adv, mask, **kw)
        assert ours.item() == pytest.approx(theirs.item(), abs=1e-12)
        (ga,), (gb,) = torch.autograd.grad(ours, a), torch.autograd.grad(theirs, b)
        assert torch.allclose(ga, gb, atol=1e-13)
    # the bias correction is what makes the difference once the KL is on
    plain = get_recipe("trl-grpo", kl_placement="loss", kl_coef=0.04, kl_bias_correction=False)
    a = logp0.clone().requires_grad_(True)
    (g_plain,) = torch.autograd.grad(plain.policy_loss(a, adv, mask, old_logp=old, ref_logp=ref_lp).loss, a)
    b = logp0.clone().requires_grad_(True)
    (g_trl,) = torch.autograd.grad(_trl_grpo_loss(b, old, ref_lp, adv, mask, beta=0.04), b)
    assert not torch.allclose(g_plain, g_trl)


def test_trl_dapo_reproduces_trl_documented_configuration():
    """TRL docs/source/paper_index.md, "DAPO": ``loss_type="dapo"``, ``epsilon=0.2``,
    ``epsilon_high=0.28``, ``num_generations=16``, ``beta=0.0``, ``mask_truncated_completions=True``
    (a sampling/trainer setting, not part of the objective) and "Dynamic Sampling (not supported
    in TRL)"; scale_rewards keeps its default "group" (Bessel std + 1e-4)."""
    o = RECIPES["trl-dapo"]
    assert (o.aggregation, o.eps_low, o.eps_high_, o.group_size) == ("token_mean", 0.2, 0.28, 16)
    assert (o.kl_placement, o.dynamic_sampling, o.std_unbiased, o.std_eps) == ("none", False, True, 1e-4)
    logp0, old, ref_lp, adv, mask = _batch(3)
    a = logp0.clone().requires_grad_(True)
    ours = o.policy_loss(a, adv, mask, old_logp=old).loss
    b = logp0.clone().requires_grad_(True)
    theirs = _trl_grpo_loss(b, old, ref_lp, adv, mask, eps_high=0.28)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-12)
    (ga,), (gb,) = torch.autograd.grad(ours, a), torch.autograd.grad(theirs, b)
    assert torch.allclose(ga, gb, atol=1e-13)


def test_explain_diff_trl_grpo_vs_grpo_names_every_differing_convention():
    text = explain_diff("trl-grpo", get_recipe("grpo", kl_placement="loss", kl_coef=0.04))  # DeepSeekMath's KL
    for piece in ("std_unbiased", "std_eps", "aggregation", "kl_placement", "kl_coef",
                  "unbiased std (1/(G−1), Bessel)", "population std (1/G)", "token_mean", "seq_mean_token_mean",
                  "KL to reference", "in the loss: + 0.04"):
        assert piece in text, piece
    fields = text.split("\n\n")[1]
    assert "eps_low" not in fields and "group_size" not in fields  # equal conventions are not listed


def test_explain_prints_each_peer_convention():
    assert "clip(k3 = π_ref/π_θ − 1 − log(π_ref/π_θ), −10, 10)" in explain("verl-grpo")
    assert "dual clip: for A < 0" in explain("verl-grpo")
    assert "unbiased std" in explain("verl-grpo")
    assert "whitened over the batch" in explain("verl-ppo") and "whitened" not in explain("ppo")
    assert "ρ_t = π_θ/sg[π_old] attached" in explain("trl-grpo", kl_placement="loss", kl_coef=0.04)
    assert "straight-through" in explain("grpo", kl_kind="k3+", kl_placement="loss", kl_coef=0.04)
    assert "token_sum" in explain("grpo", aggregation="token_sum")
    assert "hinge" in explain("dpo", dpo_loss_type="hinge")


# ------------------------------------------------------------------------ new estimators
def test_new_estimator_recipes_call_their_core_functions():
    g = torch.Generator().manual_seed(9)
    r = torch.randint(0, 2, (3, 8), generator=g).to(F64)
    ids = torch.arange(3).repeat_interleave(8)
    flat = r.flatten()
    o = RECIPES["reinforce_pp"]
    assert (o.kl_placement, o.kl_kind, o.std_eps, o.std_unbiased) == ("reward", "k1", 1e-8, True)
    assert torch.equal(o.sequence_advantages(flat, group_ids=ids).advantages,
                       adv_mod.reinforce_pp_advantages(flat, eps=1e-8).advantages)
    o = RECIPES["reinforce_pp_baseline"]
    assert torch.equal(o.sequence_advantages(flat, group_ids=ids).advantages,
                       adv_mod.reinforce_pp_advantages(flat, group_baseline=True, group_ids=ids, eps=1e-8).advantages)
    o = RECIPES["maxrl"]
    assert torch.equal(o.sequence_advantages(r).advantages, adv_mod.maxrl_advantages(r).advantages)
    o = RECIPES["gdpo"]
    one = o.sequence_advantages(flat, group_ids=ids).advantages
    assert torch.equal(one, adv_mod.gdpo_advantages(flat[:, None], group_ids=ids, eps=1e-4, unbiased=True).advantages)
    comps = torch.stack([r, 1 - r, torch.randn(3, 8, generator=g, dtype=F64)], -1)
    assert torch.equal(o.sequence_advantages(comps).advantages,
                       adv_mod.gdpo_advantages(comps, eps=1e-4, unbiased=True).advantages)
    assert "(Ã_i − mean_batch(Ã)) / sqrt(var_batch(Ã) + 1e-08)" in explain("reinforce_pp")
    assert "Ã_i = R_i − mean_G(R)" in explain("reinforce_pp_baseline")
    assert "A_i = (R_i − mean_G(R)) / mean_G(R)" in explain("maxrl") and "mean_G(R) = 0" in explain("maxrl")
    assert "for each reward component k" in explain("gdpo")


def test_dpo_loss_type_through_the_objective():
    g = torch.Generator().manual_seed(11)
    c, r = -torch.rand(4, generator=g, dtype=F64) * 10, -torch.rand(4, generator=g, dtype=F64) * 10
    rc, rr = c + torch.randn(4, generator=g, dtype=F64), r + torch.randn(4, generator=g, dtype=F64)
    lc, lr = torch.tensor([3.0, 5.0, 2.0, 8.0], dtype=F64), torch.tensor([4.0, 1.0, 6.0, 2.0], dtype=F64)
    for lt in ("sigmoid", "robust", "hinge", "ipo"):
        kw = dict(label_smoothing=0.1) if lt == "robust" else {}
        o = get_recipe("dpo", dpo_loss_type=lt, **kw)
        a = o.dpo_loss(c, r, rc, rr, chosen_length=lc, rejected_length=lr).loss
        b = losses.dpo_loss(c, r, rc, rr, beta=0.1, loss_type=lt, chosen_length=lc, rejected_length=lr, **kw).loss
        assert a.item() == b.item()
    o = get_recipe("dpo", dpo_loss_type="simpo", simpo_gamma=1.0)
    assert o.dpo_loss(c, r, None, None, chosen_length=lc, rejected_length=lr).loss.item() == losses.dpo_loss(
        c, r, None, None, loss_type="simpo", simpo_gamma=1.0, chosen_length=lc, rejected_length=lr).loss.item()


def test_new_fields_are_validated_and_refused_where_unread():
    with pytest.raises(ValueError, match="dpo_loss_type"):
        get_recipe("dpo", dpo_loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        get_recipe("dpo", label_smoothing=0.5)
    with pytest.raises(ValueError, match="std_unbiased"):
        get_recipe("grpo", std_unbiased=1)
    with pytest.raises(ValueError, match="kl_bias_correction: has no effect"):
        get_recipe("ppo", kl_bias_correction=True)  # KL in the reward: nothing to weight
    with pytest.raises(ValueError, match="whiten_advantages: has no effect"):
        get_recipe("grpo", whiten_advantages=True)
    with pytest.raises(ValueError, match="std_unbiased: has no effect"):
        get_recipe("dr_grpo", std_unbiased=True)
    with pytest.raises(ValueError, match="simpo_gamma: has no effect"):
        get_recipe("dpo", simpo_gamma=1.0)
    with pytest.raises(ValueError, match="kl_kind"):
        get_recipe("grpo", kl_kind="k4")


def test_kl_bias_correction_on_policy_without_old_logp():
    """On-policy (no separate old log-probs) the weight is π_θ/sg[π_θ]: value 1, gradient not 0."""
    o = get_recipe("reinforce", kl_placement="loss", kl_coef=0.1, kl_kind="k3", kl_bias_correction=True)
    logp0, _, ref_lp, adv, mask = _batch(4)
    a = logp0.clone().requires_grad_(True)
    ours = o.policy_loss(a, adv, mask, ref_logp=ref_lp)
    b = logp0.clone().requires_grad_(True)
    k3 = torch.exp(ref_lp - b) - (ref_lp - b) - 1
    # seq_mean_token_sum (the reinforce recipe's mode) of ρ·k3 and of −A log π
    per = torch.where(mask, -adv * b + 0.1 * k3 * torch.exp(b - b.detach()), 0.0)
    theirs = per.sum() / mask.any(-1).sum()
    assert ours.loss.item() == pytest.approx(theirs.item(), abs=1e-12)
    (ga,), (gb,) = torch.autograd.grad(ours.loss, a), torch.autograd.grad(theirs, b)
    assert torch.allclose(ga, gb, atol=1e-13)


def test_verify_passes_trajgrad_own_losses_against_the_new_recipes():
    import functools

    from trajgrad.aggregate import aggregate
    from trajgrad.verify import verify

    for name in ("verl-grpo", "verl-ppo", "trl-grpo", "trl-dapo", "reinforce_pp", "reinforce_pp_baseline", "maxrl",
                 "gdpo"):
        o = RECIPES[name]
        fn = functools.partial(losses.ppo_clip_loss, eps_low=o.eps_low, eps_high=o.eps_high_, dual_clip=o.dual_clip,
                               aggregation=o.aggregation)
        rep = verify(fn, name)
        assert rep.passed, (name, rep.table())

    # with its KL term: PPO + 0.001 · token-mean(k3 clamped to ±10); a k2 KL in its place is caught
    def with_kl(kind, logp, old_logp, advantages, mask, denominator=None, ref_logp=None):
        res = losses.ppo_clip_loss(logp, old_logp, advantages, mask, dual_clip=3.0, denominator=denominator)
        k = losses.kl_estimate(logp, ref_logp, mask, kind=kind, clamp=10.0)
        return res.loss + 0.001 * aggregate(k, mask, "token_mean", denominator=denominator)

    assert verify(functools.partial(with_kl, "k3"), "verl-grpo", include_kl=True).passed
    assert not verify(functools.partial(with_kl, "k2"), "verl-grpo", include_kl=True).passed
