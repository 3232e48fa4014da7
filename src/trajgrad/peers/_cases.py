"""Which peer function is which trajgrad recipe, with the options that reproduce it.

Sources of the peers' defaults: TRL 1.16 ``GRPOConfig`` (loss_type "dapo", epsilon 0.2,
epsilon_high None = epsilon, beta 0.0, use_bias_correction_kl True, scale_rewards "group");
verl 0.9.1 ``ActorConfig`` (clip_ratio 0.2, clip_ratio_c 3.0 — the dual clip is always on,
loss_agg_mode "token-mean") and ``core_algos``.
"""
from __future__ import annotations

from functools import partial

from ..advantages import (gdpo_advantages, gpg_advantages, opo_advantages, optimal_token_baseline, reinforce_pp_advantages,
                          remax_advantages, whiten)
from . import trl as T
from . import verl as V
from ._case import PeerCase

NO_KL = {"kl_coef": 0.0, "kl_placement": "none"}
PAPER_KL = {"kl_placement": "loss", "kl_coef": 0.04}  # DeepSeekMath's KL term (trajgrad's grpo has none)
TRL_EPS = {"eps_high": None}  # TRL: epsilon_high defaults to epsilon
TRL_MAX_LEN = 64              # the adapter's max_completion_length (Dr. GRPO's constant)

TRL = [
    PeerCase("trl", "GRPOTrainer._compute_loss with GRPOConfig() defaults  [recipe trl-grpo]",
             partial(T.grpo_loss, "dapo"), "trl-grpo", {}),
    PeerCase("trl", "GRPOTrainer._compute_loss(loss_type='dapo', epsilon_high=0.28)  [recipe trl-dapo]",
             partial(T.grpo_loss, "dapo", epsilon_high=0.28), "trl-dapo", {}),
    PeerCase("trl", "GRPOTrainer._compute_loss(loss_type='dapo')  [TRL's default]", partial(T.grpo_loss, "dapo"),
             "dapo", {**TRL_EPS, "dynamic_sampling": False},
             notes=("TRL samples no extra groups: dynamic sampling off",)),
    PeerCase("trl", "GRPOTrainer._compute_loss(loss_type='bnpo')", partial(T.grpo_loss, "bnpo"),
             "dapo", {**TRL_EPS, "dynamic_sampling": False}),
    PeerCase("trl", "GRPOTrainer._compute_loss(loss_type='grpo')", partial(T.grpo_loss, "grpo"),
             "grpo", dict(NO_KL), denominator="rows"),
    PeerCase("trl", "GRPOTrainer._compute_loss(loss_type='grpo', beta=0.04)  [use_bias_correction_kl=True, TRL's default]",
             partial(T.grpo_loss, "grpo", beta=0.04, use_bias_correction_kl=True), "grpo",
             {**PAPER_KL, "kl_bias_correction": True}, include_kl=True, denominator="rows"),
    PeerCase("trl", "GRPOTrainer._compute_loss(loss_type='grpo', beta=0.04, use_bias_correction_kl=False)",
             partial(T.grpo_loss, "grpo", beta=0.04), "grpo", dict(PAPER_KL), include_kl=True, denominator="rows"),
    PeerCase("trl", "GRPOTrainer._compute_loss(loss_type='dr_grpo')",
             partial(T.grpo_loss, "dr_grpo", max_completion_length=TRL_MAX_LEN), "dr_grpo",
             {"constant": float(TRL_MAX_LEN)}, denominator="rows"),
    PeerCase("trl", "GRPOTrainer._compute_loss(loss_type='luspo', importance_sampling_level='sequence')",
             partial(T.grpo_loss, "luspo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
             "gspo", {"aggregation": "seq_mean_token_sum"}, denominator="rows",
             notes=("LUSPO = GSPO's sequence term weighted by the response length: aggregation seq_mean_token_sum "
                    "(TRL refuses luspo at token level)",)),
    PeerCase("trl", "GRPOTrainer._compute_loss(loss_type='cispo', epsilon_high=5.0)",
             partial(T.grpo_loss, "cispo", epsilon_high=5.0), "cispo", {"eps_high": 4.0},
             notes=("TRL's epsilon_high is the weight's cap itself (trajgrad: 1 + eps_high)",)),
    PeerCase("trl", "GRPOTrainer._compute_loss(loss_type='sapo')", partial(T.grpo_loss, "sapo"),
             "sapo", {}, denominator="rows"),
    PeerCase("trl", "GRPOTrainer._compute_loss(loss_type='sapo', importance_sampling_level='sequence')",
             partial(T.grpo_loss, "sapo", importance_sampling_level="sequence"), "sapo", {"sapo_level": "sequence"},
             denominator="rows"),
    PeerCase("trl", "GRPOTrainer._compute_loss(loss_type='vespo')", partial(T.grpo_loss, "vespo"), "vespo", {}),
    PeerCase("trl", "GRPOTrainer._compute_loss(importance_sampling_level='sequence')  [GSPO]",
             partial(T.grpo_loss, "grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
             "gspo", {}, denominator="rows"),
]

TRL += [
    PeerCase("trl", "DPOTrainer._compute_loss(loss_type=['sigmoid'])  [DPO, TRL's default]", partial(T.dpo_loss, "sigmoid"),
             "dpo", {}, kind="pairwise",
             notes=("TRL's sigmoid ignores label_smoothing (trajgrad's is conservative DPO for ε > 0; equal at ε = 0)",)),
    PeerCase("trl", "DPOTrainer._compute_loss(loss_type=['hinge'])  [SLiC]", partial(T.dpo_loss, "hinge"),
             "dpo", {"dpo_loss_type": "hinge"}, kind="pairwise"),
    PeerCase("trl", "DPOTrainer._compute_loss(loss_type=['ipo'])", partial(T.dpo_loss, "ipo"),
             "dpo", {"dpo_loss_type": "ipo"}, kind="pairwise",
             notes=("TRL divides each log-ratio by the response's token count: trajgrad's ipo with the lengths "
                    "passed (chosen_length / rejected_length); without them it is the paper's summed form",)),
    PeerCase("trl", "DPOTrainer._compute_loss(loss_type=['robust'], label_smoothing=0.1)  [rDPO]",
             partial(T.dpo_loss, "robust", label_smoothing=0.1), "dpo",
             {"dpo_loss_type": "robust", "label_smoothing": 0.1}, kind="pairwise"),
]

VERL = [
    PeerCase("verl", "compute_policy_loss_vanilla + kl_penalty('low_var_kl') in the loss, defaults  [recipe verl-grpo]",
             partial(V.policy_loss_with_kl, "low_var_kl", 0.001), "verl-grpo", {}, include_kl=True),
    PeerCase("verl", "compute_grpo_outcome_advantage, defaults  [recipe verl-grpo]", V.grpo_advantage,
             "verl-grpo", {}, kind="advantage"),
    PeerCase("verl", "compute_policy_loss_vanilla, defaults  [recipe verl-ppo]",
             partial(V.policy_loss, "vanilla", loss_agg_mode="token-mean"), "verl-ppo", {}),
    PeerCase("verl", "compute_gae_advantage_return + masked_whiten, defaults  [recipe verl-ppo]", V.gae_whitened,
             "verl-ppo", {"lam": 0.95}, kind="token_advantage"),
    PeerCase("verl", "compute_policy_loss_vanilla(loss_agg_mode='token-mean')  [verl's default]",
             partial(V.policy_loss, "vanilla", loss_agg_mode="token-mean"),
             "dapo", {**TRL_EPS, "dual_clip": 3.0, "dynamic_sampling": False}),
    PeerCase("verl", "compute_policy_loss_vanilla(loss_agg_mode='seq-mean-token-mean')",
             partial(V.policy_loss, "vanilla", loss_agg_mode="seq-mean-token-mean"),
             "grpo", {**NO_KL, "dual_clip": 3.0}),
    PeerCase("verl", "compute_policy_loss_vanilla(loss_agg_mode='seq-mean-token-sum')",
             partial(V.policy_loss, "vanilla", loss_agg_mode="seq-mean-token-sum"),
             "grpo", {**NO_KL, "dual_clip": 3.0, "aggregation": "seq_mean_token_sum"}),
    PeerCase("verl", "compute_policy_loss_vanilla(loss_agg_mode='seq-mean-token-sum-norm')",
             partial(V.policy_loss, "vanilla", loss_agg_mode="seq-mean-token-sum-norm"),
             "dr_grpo", {"constant": None, "dual_clip": 3.0}, convention_checks=("padding",),
             notes=("loss_scale_factor defaults to the padded response length (trajgrad: constant=None)",)),
    PeerCase("verl", "compute_policy_loss_gspo", partial(V.policy_loss, "gspo", loss_agg_mode="seq-mean-token-mean",
                                                       clip_ratio_low=3e-4, clip_ratio_high=4e-4), "gspo", {}),
    PeerCase("verl", "compute_policy_loss_sapo", partial(V.policy_loss, "sapo", loss_agg_mode="seq-mean-token-mean"),
             "sapo", {}),
    PeerCase("verl", "compute_policy_loss_reinforce",
             partial(V.policy_loss, "compute_policy_loss_reinforce", loss_agg_mode="seq-mean-token-sum"),
             "reinforce", {}),
    PeerCase("verl", "compute_policy_loss_cispo", partial(V.policy_loss, "cispo", loss_agg_mode="token-mean"),
             "cispo", {"eps_high": 0.2, "weight_eps_low": 0.2},
             notes=("verl clips the detached weight on both sides, [1 − clip_ratio_low, 1 + clip_ratio_high]",)),
    PeerCase("verl", "compute_policy_loss_geo_mean(clip_ratio=0.4)  [GMPO]",
             partial(V.policy_loss, "geo_mean", loss_agg_mode="seq-mean-token-mean", clip_ratio=0.4,
                     clip_ratio_low=0.4, clip_ratio_high=0.4), "gmpo", {}, denominator="rows",
             notes=("verl's geo_mean averages over every row and ignores loss_agg_mode",)),
    PeerCase("verl", "compute_policy_loss_dppo_tv(clip_ratio=0.1)",
             partial(V.policy_loss, "dppo_tv", loss_agg_mode="token-mean", clip_ratio=0.1, clip_ratio_low=0.1,
                     clip_ratio_high=0.1), "dppo_tv", {"dppo_ratio_cap": 3.0},
             notes=("verl truncates the detached ratio at clip_ratio_c (3.0 with ActorConfig's defaults)",)),
    PeerCase("verl", "compute_policy_loss_dppo_kl(clip_ratio=0.05)",
             partial(V.policy_loss, "dppo_kl", loss_agg_mode="token-mean", clip_ratio=0.05, clip_ratio_low=0.05,
                     clip_ratio_high=0.05), "dppo_kl", {"dppo_ratio_cap": 3.0},
             notes=("verl adds 1e-8 inside the binary KL's second logarithm (an effect only at p ≈ 1)",)),
    PeerCase("verl", "compute_grpo_outcome_advantage(norm_adv_by_std_in_grpo=True)", V.grpo_advantage,
             "grpo", {"std_unbiased": True}, kind="advantage",
             notes=("a group of one gets mean 0 and std 1 (its raw reward); trajgrad refuses groups of one",)),
    PeerCase("verl", "compute_grpo_outcome_advantage(norm_adv_by_std_in_grpo=False)  [Dr. GRPO]",
             partial(V.grpo_advantage, False), "dr_grpo", {}, kind="advantage"),
    PeerCase("verl", "compute_rloo_outcome_advantage", V.rloo_advantage, "rloo", {}, kind="advantage"),
    PeerCase("verl", "kl_penalty('k1')", partial(V.kl_penalty, "k1"), "grpo", {**PAPER_KL, "kl_kind": "k1"}, kind="kl"),
    PeerCase("verl", "kl_penalty('k2')", partial(V.kl_penalty, "k2"), "grpo", {**PAPER_KL, "kl_kind": "k2"}, kind="kl"),
    PeerCase("verl", "kl_penalty('low_var_kl')  [verl's k3, clamped]", partial(V.kl_penalty, "low_var_kl"), "grpo",
             {**PAPER_KL, "kl_kind": "low_var_kl"}, kind="kl"),
    PeerCase("verl", "kl_penalty('k3+')  [straight-through]", partial(V.kl_penalty, "k3+"), "grpo",
             {**PAPER_KL, "kl_kind": "low_var_kl+"}, kind="kl"),
    PeerCase("verl", "kl_penalty('k1+')  [straight-through]", partial(V.kl_penalty, "k1+"), "grpo",
             {**PAPER_KL, "kl_kind": "k1+"}, kind="kl"),
    PeerCase("verl", "kl_penalty('low_var_kl+')", partial(V.kl_penalty, "low_var_kl+"), "grpo",
             {**PAPER_KL, "kl_kind": "low_var_kl+"}, kind="kl"),
    PeerCase("verl", "compute_gae_advantage_return + masked_whiten  [verl-ppo advantages]", V.gae_whitened,
             "ppo", {"whiten_advantages": True, "gamma": 1.0, "lam": 0.95}, kind="token_advantage"),
]



def _token_weighted(r, lengths):
    """``[M]`` per-response values whitened over tokens (verl's ``masked_whiten`` of the broadcast values)."""
    import torch

    mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    return whiten(r[:, None].expand(-1, mask.shape[1]), mask, unbiased=True, eps=1e-8)[:, 0]


def _rpp_lengths(group_baseline: bool):
    def ours(r, gids, lengths):
        return reinforce_pp_advantages(r, group_baseline=group_baseline, group_ids=gids if group_baseline else None,
                                       lengths=lengths, unbiased=True, eps=1e-8).advantages
    return ours


def _gdpo_lengths(r, gids, lengths):
    s = gdpo_advantages(r[:, None], group_ids=gids, eps=1e-6, unbiased=True, batch_normalize=False).advantages
    return _token_weighted(s, lengths)


def _gpg_nonzero(r, gids):
    return gpg_advantages(r, group_ids=gids, count="nonzero").advantages


def _opo(r, gids, lengths):
    return opo_advantages(r, lengths, group_ids=gids).advantages


def _two_components(r):
    """Two reward components from one: the reward itself and a binary one (a stand-in for a format reward)."""
    import torch

    return torch.stack([r, (torch.round(3 * r) % 2).abs()], dim=-1)


GDPO_WEIGHTS = (1.0, 0.5)


def _gdpo_components(r, gids, lengths):
    import torch

    s = gdpo_advantages(_two_components(r), group_ids=gids, weights=torch.tensor(GDPO_WEIGHTS, dtype=r.dtype),
                        eps=1e-6, unbiased=True, batch_normalize=False).advantages
    return _token_weighted(s, lengths)


def _greedy_reward(r, gids):
    """A stand-in for the greedy response's reward, one per prompt: its first rollout's reward minus 0.5."""
    import torch

    first = {}
    for i, g in enumerate(gids.tolist()):
        first.setdefault(g, float(r[i]) - 0.5)
    return torch.tensor([first[g] for g in gids.tolist()], dtype=r.dtype)


def _remax(r, gids, lengths):
    return remax_advantages(r, _greedy_reward(r, gids))


def _otb(align: str):
    def ours(rewards, mask, gids, lp, s2):
        return optimal_token_baseline(rewards, mask, gids, lp, s2, align=align).advantages
    return ours


OTB_NOTE = ("needs the rollout policy's Σ_v π(v)² per token, which the trainer does not record: no registry "
            "estimator; compared against the core function")
TOKEN_WEIGHTED = ("verl whitens over tokens (masked_whiten): each response weighs by its token count and Bessel's "
                  "correction counts tokens, 1/(N_tokens − 1); the recipe's estimator weighs every response once "
                  "with 1/(N_responses − 1) (the paper's form), so they differ even at equal lengths")
BYPASS = "bypass_mode: old_log_prob is the rollout's log-prob; verify passes the same tensor as old and behaviour"

VERL += [
    PeerCase("verl", "compute_grpo_vectorized_outcome_advantage", partial(V.outcome_advantage, "grpo_vectorized"),
             "grpo", {"std_unbiased": True}, kind="advantage", tol=1e-5,
             notes=("computes the group statistics in float32 whatever the input dtype (deviation: float32 rounding; "
                    "tolerance 1e-5 instead of 1e-9), with the variance floored at 1e-6 before the square root",)),
    PeerCase("verl", "compute_rloo_vectorized_outcome_advantage", partial(V.outcome_advantage, "rloo_vectorized"),
             "rloo", {}, kind="advantage"),
    PeerCase("verl", "compute_reinforce_plus_plus_outcome_advantage  [γ = 1, outcome reward]",
             partial(V.outcome_advantage, "reinforce_plus_plus"), "reinforce_pp", {}, kind="advantage",
             ours=_rpp_lengths(False), ours_name="reinforce_pp_advantages(lengths=token counts)",
             notes=(TOKEN_WEIGHTED,)),
    PeerCase("verl", "compute_reinforce_plus_plus_baseline_outcome_advantage",
             partial(V.outcome_advantage, "reinforce_plus_plus_baseline"), "reinforce_pp_baseline", {}, kind="advantage",
             ours=_rpp_lengths(True), ours_name="reinforce_pp_advantages(group_baseline=True, lengths=token counts)",
             notes=(TOKEN_WEIGHTED, "a group of one keeps its raw reward (mean 0); trajgrad refuses groups of one")),
    PeerCase("verl", "compute_gdpo_outcome_advantage  [one reward component]", partial(V.outcome_advantage, "gdpo"),
             "gdpo", {"std_eps": 1e-6}, kind="advantage", ours=_gdpo_lengths,
             ours_name="gdpo_advantages(batch_normalize=False) whitened over tokens",
             notes=(TOKEN_WEIGHTED, "the batch step adds 1e-8 under the square root (trajgrad's recipe: std + std_eps)")),
    PeerCase("verl", "compute_grpo_passk_outcome_advantage", partial(V.outcome_advantage, "grpo_passk"),
             "passk", {}, kind="advantage"),
    PeerCase("verl", "compute_gpg_outcome_advantage", partial(V.outcome_advantage, "gpg"), "gpg", {},
             kind="advantage", ours=lambda r, g, lengths: _gpg_nonzero(r, g), ours_name="gpg_advantages(count='nonzero')",
             notes=("verl's α = B / (number of non-zero rewards); the paper's (trajgrad's recipe) α = B / (responses in "
                    "groups whose rewards are not all equal)",)),
    PeerCase("verl", "compute_opo_outcome_advantage", partial(V.outcome_advantage, "opo"), "dr_grpo", {},
             kind="advantage", ours=lambda r, g, lengths: _opo(r, g, lengths), ours_name="opo_advantages(lengths=token counts)",
             notes=("the length-weighted baseline needs the response lengths, which Objective.sequence_advantages does "
                    "not take: compared against trajgrad.advantages.group_baselines.opo_advantages; equal lengths = dr_grpo's",
                    "a group of one keeps its raw reward (baseline 0); trajgrad's baseline is the response itself (A = 0)")),
    PeerCase("verl", "compute_remax_outcome_advantage", partial(V.remax_advantage, _greedy_reward), "reinforce", {},
             kind="advantage", ours=_remax, ours_name="remax_advantages(baseline_rewards=greedy rewards)",
             notes=("the greedy response's reward is an input (a stand-in per prompt here); no registry estimator: "
                    "the trainer does not generate the greedy response",)),
    PeerCase("verl", "compute_optimal_token_baseline_advantage  [handle_zero_tail=True]", V.optimal_token_baseline,
             "reinforce", {}, kind="token_baseline", ours=_otb("position"),
             ours_name="group_baselines.optimal_token_baseline", notes=(OTB_NOTE,)),
    PeerCase("verl", "compute_multi_turn_optimal_token_baseline_advantage  [tir_optimal_token_baseline]",
             partial(V.optimal_token_baseline, "tir_optimal_token_baseline"), "reinforce", {}, kind="token_baseline",
             ours=_otb("action"), ours_name="group_baselines.optimal_token_baseline(align='action')",
             observations=True, notes=(OTB_NOTE, "responses with a tool observation inside: tokens share a baseline "
                                                 "by action-token index")),
    PeerCase("verl", "compute_policy_loss_dro(dro_beta=0.1)",
             partial(V.policy_loss, "dro", loss_agg_mode="token-mean", policy_loss_fields={"dro_beta": 0.1}),
             "dro", {}),
    PeerCase("verl", "compute_policy_loss_kl_cov  [PolicyLossConfig defaults: ppo_kl_coef 0.1]",
             partial(V.cov_loss, "kl_cov"), "kl_cov", {"cov_kl_coef": 0.1}, kind="cov_topk",
             convention_checks=("selection_count",),
             notes=("compared at kl_cov_ratio = cov_ratio = 1/16 on 160 and 320 valid tokens, where ⌊rN⌋ = rN",)),
    PeerCase("verl", "compute_policy_loss_clip_cov  [seeded: torch.manual_seed]", partial(V.cov_loss, "clip_cov"),
             "clip_cov", {}, kind="cov_random", convention_checks=("value",),
             notes=("value: verl multiplies the selected tokens' terms by 0, which drops their value as well as "
                    "their gradient; trajgrad keeps the value and detaches the gradient (equal gradients)",)),
    PeerCase("verl", "compute_gdpo_outcome_advantage(gdpo_reward_keys=[2 components], gdpo_reward_weights=[1, 0.5])",
             partial(V.gdpo_advantage, _two_components, GDPO_WEIGHTS), "gdpo", {"std_eps": 1e-6}, kind="advantage",
             ours=_gdpo_components, ours_name="gdpo_advantages(weights=, batch_normalize=False) whitened over tokens",
             tol=1e-5, notes=(TOKEN_WEIGHTED, "verl reads the component scores as float32 (tolerance 1e-5)")),
    PeerCase("verl", "compute_value_loss(cliprange_value=0.5)  [recipe verl-ppo's critic]", V.value_loss,
             "verl-ppo", {}, kind="critic"),
    PeerCase("verl", "compute_policy_loss_gpg", partial(V.policy_loss, "gpg", loss_agg_mode="token-mean"),
             "reinforce", {"aggregation": "token_mean"},
             notes=("GPG's loss is −A · log π with no ratio: REINFORCE aggregated by token mean",)),
    PeerCase("verl", "compute_policy_loss_bypass_mode(loss_type='ppo_clip')  [default]",
             partial(V.policy_loss, "bypass_mode", loss_agg_mode="token-mean",
                     policy_loss_fields={"rollout_correction": {"loss_type": "ppo_clip"}}),
             "dapo", {**TRL_EPS, "dual_clip": 3.0, "dynamic_sampling": False}, notes=(BYPASS,)),
    PeerCase("verl", "compute_policy_loss_bypass_mode(loss_type='reinforce', rollout_is=None)",
             partial(V.policy_loss, "bypass_mode", loss_agg_mode="token-mean",
                     policy_loss_fields={"rollout_correction": {"loss_type": "reinforce", "rollout_is": None}}),
             "reinforce", {"aggregation": "token_mean"}, notes=(BYPASS,)),
    PeerCase("verl", "compute_policy_loss_bypass_mode(loss_type='reinforce', rollout_is='token')",
             partial(V.policy_loss, "bypass_mode", loss_agg_mode="token-mean",
                     policy_loss_fields={"rollout_correction": {"loss_type": "reinforce", "rollout_is": "token",
                                                                "rollout_is_threshold": 2.0}}),
             "cispo", {"eps_high": 1.0}, notes=(BYPASS, "the truncated IS weight sg[min(π_θ/π_rollout, 2)] on "
                                                "−A · log π is CISPO's clipped weight with cap 1 + eps_high = 2")),
]

CASES = {"trl": TRL, "verl": VERL}

# compared, and they differ: trajgrad has no counterpart (tests/test_peers.py runs them and checks they differ)
DIFFERS = {"trl": [], "verl": [
    PeerCase("verl", "compute_policy_loss_bypass_mode(loss_type='reinforce')  [rollout_is='sequence', default]",
             partial(V.policy_loss, "bypass_mode", loss_agg_mode="token-mean",
                     policy_loss_fields={"rollout_correction": {"loss_type": "reinforce"}}),
             "reinforce", {"aggregation": "token_mean"}, notes=(BYPASS,),
             no_counterpart=("each response is weighted by sg[min(Π_t π_θ/π_rollout, 2)], a truncated sequence IS "
                             "weight of the *current* policy on −A · log π; trajgrad's rollout correction takes its "
                             "weight from π_old/π_behaviour (decoupled) and refuses truncated IS in bypass mode")),
]}

_NO_DPO = ("no trajgrad counterpart (trajgrad's pairwise losses: sigmoid, robust, hinge, ipo, simpo)")
# not compared: (peer function or setting, why)
UNCOVERED = {
    "trl": [
        ("DPOTrainer loss_type exo_pair, nca_pair, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, "
         "discopop, sft, sigmoid_norm", _NO_DPO),
        ("DPOTrainer f_divergence_type forward_kl / js_divergence / alpha_divergence, ld_alpha, use_weighting (WPO)",
         "no trajgrad counterpart: trajgrad's DPO scores are the reverse-KL log-ratios"),
        ("GRPOTrainer delta (INTELLECT-2's two-sided ratio cap), off_policy_mask_threshold (OPSM), "
         "top_entropy_quantile", "no trajgrad counterpart as an Objective option"),
        ("GRPOTrainer's advantages (scale_rewards group / batch / none)",
         "computed inside _generate_and_score_completions together with generation, not a function that can be "
         "called alone; the recipes trl-grpo / trl-dapo are checked against the documented defaults "
         "(tests/test_peer_recipes.py)"),
    ],
    "verl": [
        ("compute_policy_loss_bypass_mode(loss_type='reinforce')  [rollout_is='sequence', verl's default]",
         "compared: differs — " + DIFFERS["verl"][0].no_counterpart),
        ("kl_penalty('abs') (and 'abs+')", "no trajgrad counterpart: |log π_θ − log π_ref| is not one of kl_kind's "
         "estimators ('kl' and 'mse' are verl's aliases of 'k1' and 'k2', compared above)"),
    ],
}
