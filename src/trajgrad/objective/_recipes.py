r"""The named recipes: each an :class:`~trajgrad.objective.Objective` with its paper's defaults.

Any field can be changed with ``Objective.replace`` / ``get_recipe(name, **overrides)`` (the
trainer's ``recipe.overrides`` does exactly that); ``trajgrad explain NAME`` prints one.
"""
from __future__ import annotations

from typing import Any, Dict

from ._core import Objective

RECIPES: Dict[str, Objective] = {
    "reinforce": Objective(
        name="reinforce", loss="reinforce", advantage="return", aggregation="seq_mean_token_sum",
        paper="Williams 1992 (spec §2): E[R(τ) Σ_t ∇log π(a_t|h_t)]",
    ),
    "rloo": Objective(
        name="rloo", loss="reinforce", advantage="leave_one_out", aggregation="seq_mean_token_sum", group_size=4,
        paper="Ahmadian et al. 2024 (REINFORCE leave-one-out), spec §5",
    ),
    "grpo": Objective(
        name="grpo", loss="ppo", advantage="group_std", aggregation="seq_mean_token_mean", eps_low=0.2,
        kl_kind="k3", group_size=8,
        paper=("Shao et al. 2024 (DeepSeekMath), spec §11; no KL term, as TRL's GRPOConfig (beta 0) and the "
               "presets; the paper's: kl_placement 'loss', kl_coef 0.04 (k3)"),
    ),
    "dr_grpo": Objective(
        name="dr_grpo", loss="ppo", advantage="group_center", aggregation="seq_sum_constant", constant=1024.0,
        eps_low=0.2, group_size=8, paper="Liu et al. 2025 (Understanding R1-Zero-Like Training), spec §12",
    ),
    "dapo": Objective(
        name="dapo", loss="ppo", advantage="group_std", aggregation="token_mean", eps_low=0.2, eps_high=0.28,
        group_size=8, dynamic_sampling=True, paper="Yu et al. 2025 (DAPO): clip-higher, token-level loss, dynamic sampling",
    ),
    "gspo": Objective(
        name="gspo", loss="gspo", advantage="group_std", aggregation="seq_mean_token_mean", eps_low=3e-4, eps_high=4e-4,
        group_size=8, paper="Zheng et al. 2025 (GSPO), spec §17",
    ),
    "gspo_token": Objective(
        name="gspo_token", loss="gspo_token", advantage="group_std", aggregation="seq_mean_token_mean",
        eps_low=3e-4, eps_high=4e-4, group_size=8, paper="Zheng et al. 2025 (GSPO-token), spec §17",
    ),
    "sapo": Objective(
        name="sapo", loss="sapo", advantage="group_std", aggregation="seq_mean_token_mean", tau_pos=1.0, tau_neg=1.05,
        group_size=8, paper="Gao et al. 2025 (SAPO), spec §18",
    ),
    "ppo": Objective(
        name="ppo", loss="ppo", advantage="gae", aggregation="token_mean", eps_low=0.2, kl_coef=0.05,
        kl_placement="reward", kl_kind="k1", gamma=1.0, lam=0.95, critic=True, value_clip=0.2,
        paper="Schulman et al. 2017 (PPO) with GAE (Schulman et al. 2015), spec §6, §8",
    ),
    "sao": Objective(
        name="sao", loss="sao", advantage="gae", aggregation="token_mean", eps_low=0.3, eps_high=5.0,
        ratio_gradient="detached", gamma=1.0, lam=1.0, critic=True, critic_updates=2, group_size=1,
        paper="Hou et al. 2026 (SAO), spec §20; eps (0.3, 5.0) = the paper's reasoning setting",
    ),
    "gkd": Objective(
        name="gkd", loss="generalized_jsd", advantage="none", aggregation="token_mean", jsd_beta=0.5,
        paper="Agarwal et al. 2024 (GKD): on-policy generalized JSD(β), spec §14; TRL's GKDTrainer convention",
    ),
    "opd": Objective(
        name="opd", loss="opd", advantage="none", aggregation="token_mean",
        paper="on-policy distillation with the exact reverse KL, spec §14",
    ),
    "dpo": Objective(
        name="dpo", loss="dpo", advantage="none", aggregation="token_mean", beta=0.1,
        paper="Rafailov et al. 2023 (DPO), spec §10",
    ),
    "cispo": Objective(
        name="cispo", loss="cispo", advantage="group_std", aggregation="token_mean", eps_high=0.28,
        weight_eps_low=1.0, group_size=8,
        paper="MiniMax 2025 (MiniMax-M1, CISPO); eps_high not published, 0.28 = DAPO's clip-higher",
    ),
    "gmpo": Objective(
        name="gmpo", loss="gmpo", advantage="group_std", aggregation="seq_mean_token_mean", log_clip_low=0.4,
        log_clip_high=0.4, group_size=8, paper="Zhao et al. 2025 (GMPO): clip range (e^-0.4, e^0.4)",
    ),
    "dppo_tv": Objective(
        name="dppo_tv", loss="dppo_tv", advantage="group_std", aggregation="token_mean", delta_low=0.1,
        delta_high=0.1, group_size=8, paper="Qi et al. 2026 (DPPO-Binary-TV); delta tuned per setting",
    ),
    "dppo_kl": Objective(
        name="dppo_kl", loss="dppo_kl", advantage="group_std", aggregation="token_mean", delta_low=0.05,
        delta_high=0.05, group_size=8, paper="Qi et al. 2026 (DPPO-Binary-KL); delta tuned per setting",
    ),
    "clip_cov": Objective(
        name="clip_cov", loss="clip_cov", advantage="group_std", aggregation="token_mean", eps_low=0.2,
        cov_ratio=2e-4, cov_low=1.0, group_size=8,
        paper="Cui et al. 2025 (The Entropy Mechanism of RL for Reasoning LMs, Clip-Cov)",
    ),
    "kl_cov": Objective(
        name="kl_cov", loss="kl_cov", advantage="group_std", aggregation="token_mean", cov_ratio=2e-3,
        cov_kl_coef=1.0, group_size=8,
        paper="Cui et al. 2025 (The Entropy Mechanism of RL for Reasoning LMs, KL-Cov; ratio 2e-3 for 7B)",
    ),
    "gpg": Objective(
        name="gpg", loss="reinforce", advantage="gpg", aggregation="token_mean", group_size=8,
        paper="Chu et al. 2025 (GPG, arXiv 2504.02546): −A · log π, A = α (R − mean), no ratio, clip or KL",
    ),
    "passk": Objective(
        name="passk", loss="reinforce", advantage="passk", aggregation="token_mean", std_unbiased=True, group_size=8,
        paper=("arXiv 2503.19595: the score-function gradient of max@G with a leave-one-out baseline (verl's "
               "grpo_passk advantages, Bessel std)"),
    ),
    "vespo": Objective(
        name="vespo", loss="vespo", advantage="group_std", aggregation="token_mean", group_size=8,
        paper="VESPO (arXiv 2602.10693): Gamma-shaped weight of the sequence IS ratio, (k, λ) = (2, 3) / (3, 2)",
    ),
    "dro": Objective(
        name="dro", loss="dro", advantage="group_center", aggregation="token_mean", beta=0.1, group_size=8,
        paper=("Richemond et al. 2024 (DRO, arXiv 2405.19107), on-policy policy term as verl's dro; "
               "β = 0.1 is not published by verl (dro_beta has no default)"),
    ),
    # ------------------------------------------------------------------ peers' defaults, reproduced
    "verl-grpo": Objective(
        name="verl-grpo", loss="ppo", advantage="group_std", aggregation="token_mean", eps_low=0.2,
        dual_clip=3.0, std_eps=1e-6, std_unbiased=True, kl_placement="loss", kl_coef=0.001, kl_kind="low_var_kl",
        group_size=5,
        paper=("verl 0.9.1 GRPO defaults (docs/algo/grpo.md, examples/grpo_trainer): torch.std groups, token-mean, "
               "clip 0.2, dual clip 3, k3 KL loss clamped to ±10, coef 0.001, n = 5"),
    ),
    "verl-ppo": Objective(
        name="verl-ppo", loss="ppo", advantage="gae", aggregation="token_mean", eps_low=0.2,
        dual_clip=3.0, gamma=1.0, lam=1.0, whiten_advantages=True, critic=True, value_clip=0.5,
        paper=("verl 0.9.1 PPO defaults (ppo_trainer.yaml, actor.yaml, critic.yaml): GAE γ = λ = 1 whitened over "
               "tokens, token-mean, clip 0.2, dual clip 3, value clip 0.5, no KL"),
    ),
    "trl-grpo": Objective(
        name="trl-grpo", loss="ppo", advantage="group_std", aggregation="token_mean", eps_low=0.2,
        std_eps=1e-4, std_unbiased=True, kl_kind="k3", kl_bias_correction=True, group_size=8,
        paper=("TRL 1.16 GRPOConfig defaults: scale_rewards='group' (Bessel std + 1e-4), loss_type='dapo' "
               "(token mean over the accumulated batch), epsilon 0.2, beta 0 (no KL), num_generations 8"),
    ),
    "trl-dapo": Objective(
        name="trl-dapo", loss="ppo", advantage="group_std", aggregation="token_mean", eps_low=0.2, eps_high=0.28,
        std_eps=1e-4, std_unbiased=True, kl_kind="k3", kl_bias_correction=True, group_size=16,
        paper=("TRL's DAPO configuration (paper_index.md): loss_type='dapo', epsilon 0.2, epsilon_high 0.28, "
               "beta 0, num_generations 16; dynamic sampling is not supported in TRL"),
    ),
    # ------------------------------------------------------------------ estimators of issue 13
    "reinforce_pp": Objective(
        name="reinforce_pp", loss="ppo", advantage="reinforce_pp", aggregation="token_mean", eps_low=0.2,
        std_eps=1e-8, std_unbiased=True, kl_placement="reward", kl_kind="k1", kl_coef=0.001, group_size=1,
        paper="Hu et al. 2025 (REINFORCE++, arXiv 2501.03262): global batch normalization, k1 KL in the reward",
    ),
    "reinforce_pp_baseline": Objective(
        name="reinforce_pp_baseline", loss="ppo", advantage="reinforce_pp_baseline", aggregation="token_mean",
        eps_low=0.2, std_eps=1e-8, std_unbiased=True, kl_placement="reward", kl_kind="k1", kl_coef=0.001,
        group_size=8,
        paper="Hu et al. 2025 (REINFORCE++-baseline): group mean subtracted, then global batch normalization",
    ),
    "maxrl": Objective(
        name="maxrl", loss="ppo", advantage="maxrl", aggregation="token_mean", eps_low=0.2, group_size=8,
        paper="Tajwar et al. 2026 (MaxRL, arXiv 2602.02710): A = (R − mean)/mean, GRPO's clipped loss",
    ),
    "gdpo": Objective(
        name="gdpo", loss="ppo", advantage="gdpo", aggregation="token_mean", eps_low=0.2, std_eps=1e-4,
        std_unbiased=True, group_size=8,
        paper="Liu et al. 2026 (GDPO, arXiv 2601.05242): per-component group normalization, sum, batch normalization",
    ),
}


def get_recipe(name: str, **overrides: Any) -> Objective:
    """A recipe by name, with fields overridden (validated)."""
    if name not in RECIPES:
        raise ValueError(f"recipe: unknown {name!r}; known: {', '.join(RECIPES)}")
    obj = RECIPES[name]
    return obj.replace(**overrides) if overrides else obj
