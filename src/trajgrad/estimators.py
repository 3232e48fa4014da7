r"""The built-in advantage estimators: one registry entry each (spec §2, §5, §6, §11, §12, §20.4).

Sequence-level estimators map per-response rewards (``[N, G]``, or ``[M]`` with
``group_ids``) to one advantage per response through :mod:`trajgrad.baselines`; the token
level estimator (``gae``) maps critic values and token rewards to per-token advantages through
:func:`trajgrad.returns.token_skip_observation_gae`. See :mod:`trajgrad.registry`.
"""
from __future__ import annotations

import torch

from . import advantages
from .advantages import baselines, group_baselines, returns
from .registry import AdvantageEstimator, register_advantage_estimator


def _group(scale: str, *, leave_one_out: bool = False):
    def call(o, rewards, group_ids=None):
        return baselines.group_advantages(rewards, scale=scale, eps=o.std_eps, leave_one_out=leave_one_out,
                                          group_ids=group_ids, unbiased=o.std_unbiased if scale != "none" else False)
    return call


def _std_text(o) -> str:
    return "unbiased std (1/(G−1), Bessel)" if o.std_unbiased else "population std (1/G)"


def _raw_return(o, rewards, group_ids=None):
    r = torch.as_tensor(rewards)
    return baselines.GroupAdvantages(r.clone(), torch.zeros_like(r), torch.zeros_like(r), torch.zeros(0, dtype=torch.bool))


register_advantage_estimator(AdvantageEstimator(
    name="return", level="sequence", call=_raw_return, fields=(),
    text=lambda o: "A_i = R_i  (the raw return; no baseline)",
))

register_advantage_estimator(AdvantageEstimator(
    name="group_std", level="sequence", call=_group("std"), fields=("std_eps", "std_unbiased"), min_group=2,
    text=lambda o: (f"A_i = (R_i − mean_G(R)) / (std_G(R) + {o.std_eps:g}),  G = {o.group_size}, {_std_text(o)}\n"
                    "    groups with std = 0 have A = 0 (no relative signal, §11); std scaling reweights prompts (§12)"),
))

register_advantage_estimator(AdvantageEstimator(
    name="group_center", level="sequence", call=_group("none"), fields=(), min_group=2,
    text=lambda o: f"A_i = R_i − mean_G(R),  G = {o.group_size}  (no std scaling: Dr. GRPO, §12)",
))

register_advantage_estimator(AdvantageEstimator(
    name="batch_std", level="sequence", call=_group("batch_std"), fields=("std_eps", "std_unbiased"), min_group=2,
    text=lambda o: f"A_i = (R_i − mean_G(R)) / (std_batch(R) + {o.std_eps:g}),  G = {o.group_size}, {_std_text(o)}",
))

register_advantage_estimator(AdvantageEstimator(
    name="leave_one_out", level="sequence", call=_group("none", leave_one_out=True), fields=(), min_group=2,
    text=lambda o: f"A_i = R_i − (1/(G−1)) Σ_{{k≠i}} R_k,  G = {o.group_size}  (leave-one-out, §5)",
))


def _gae(o, values, rewards, mask, terminated=None, bootstrap_value=None):
    out = returns.token_skip_observation_gae(values, rewards, mask, gamma=o.gamma, lam=o.lam, terminated=terminated,
                                             bootstrap_value=bootstrap_value)
    if o.whiten_advantages:  # verl: whiten the advantages over the batch's valid tokens; targets unchanged
        out = out._replace(advantages=baselines.whiten(out.advantages, mask))
    return out


def _gae_text(o) -> str:
    s = (f"A_t = Σ_l (γλ)^l δ_{{t+l}},  δ_t = r_t + γ V(next action token) − V(t),  γ = {o.gamma:g}, "
         f"λ = {o.lam:g}\n"
         "    skip-observation: tool-observation and prompt tokens are bridged, not decayed through (§20.4);\n"
         "    true termination zeroes the bootstrap, truncation bootstraps from V (§6)")
    if o.whiten_advantages:
        s += ("\n    whitened over the batch: A_t ← (A_t − μ) / sqrt(σ² + 1e-8), μ, σ² (Bessel) over every valid token\n"
              "    of the whole batch (verl); the value targets are computed before and stay unwhitened")
    return s


register_advantage_estimator(AdvantageEstimator(
    name="gae", level="token", call=_gae, fields=("gamma", "lam", "whiten_advantages"), needs_critic=True,
    text=_gae_text,
))

register_advantage_estimator(AdvantageEstimator(
    name="none", level="none", call=None, fields=(), text=lambda o: "none (the loss takes no advantage)",
))


# ---------------------------------------------------------------------- REINFORCE++ (Hu et al. 2025)
def _reinforce_pp(group_baseline: bool):
    def call(o, rewards, group_ids=None):
        return advantages.reinforce_pp_advantages(rewards, group_baseline=group_baseline, group_ids=group_ids,
                                                  unbiased=o.std_unbiased, eps=o.std_eps)
    return call


def _reinforce_pp_text(group_baseline: bool):
    def text(o) -> str:
        centred = "R_i − mean_G(R)" if group_baseline else "R_i"
        var = "Bessel (1/(n−1))" if o.std_unbiased else "population (1/n)"
        g = f",  G = {o.group_size}" if group_baseline else ""
        return (f"Ã_i = {centred}{g};  A_i = (Ã_i − mean_batch(Ã)) / sqrt(var_batch(Ã) + {o.std_eps:g}),  "
                f"{var} variance\n"
                "    one normalization over the whole batch of responses, not per prompt (REINFORCE++; a per-token\n"
                "    KL goes into the reward before it, kl_placement = 'reward')")
    return text


register_advantage_estimator(AdvantageEstimator(
    name="reinforce_pp", level="sequence", call=_reinforce_pp(False), fields=("std_eps", "std_unbiased"),
    text=_reinforce_pp_text(False),
))

register_advantage_estimator(AdvantageEstimator(
    name="reinforce_pp_baseline", level="sequence", call=_reinforce_pp(True), fields=("std_eps", "std_unbiased"),
    min_group=2, text=_reinforce_pp_text(True),
))


# ---------------------------------------------------------------------- MaxRL (Tajwar et al. 2026)
register_advantage_estimator(AdvantageEstimator(
    name="maxrl", level="sequence", fields=(), min_group=2,
    call=lambda o, rewards, group_ids=None: advantages.maxrl_advantages(rewards, group_ids=group_ids),
    text=lambda o: (f"A_i = (R_i − mean_G(R)) / mean_G(R),  G = {o.group_size};  A_i = 0 when mean_G(R) = 0 "
                    "(no success)\n"
                    "    rewards ≥ 0 (success indicator); = the score averaged over successful rollouts minus a control\n"
                    "    variate: prompts weigh ~1/p (maximum likelihood of success, MaxRL)"),
))


# ---------------------------------------------------------------------- GDPO (Liu et al. 2026)
def _gdpo(o, rewards, group_ids=None):
    r = torch.as_tensor(rewards)
    if r.ndim == (1 if group_ids is not None else 2):  # one reward component
        r = r[..., None]
    return advantages.gdpo_advantages(r, group_ids=group_ids, eps=o.std_eps, unbiased=o.std_unbiased)


register_advantage_estimator(AdvantageEstimator(
    name="gdpo", level="sequence", call=_gdpo, fields=("std_eps", "std_unbiased"), min_group=2,
    text=lambda o: (f"A^k_i = (R^k_i − mean_G(R^k)) / (std_G(R^k) + {o.std_eps:g}) for each reward component k,  "
                    f"G = {o.group_size}, {_std_text(o)}\n"
                    f"S_i = Σ_k A^k_i;  A_i = (S_i − mean_batch(S)) / (std_batch(S) + {o.std_eps:g})   (GDPO: components\n"
                    "    normalized apart, so different reward combinations keep different advantages)"),
))


# ---------------------------------------------------------------------- Pass@k (arXiv 2503.19595), GPG (Chu et al. 2025)
def _passk(o, rewards, group_ids=None):
    return group_baselines.passk_advantages(rewards, group_ids=group_ids, unbiased=o.std_unbiased, eps=o.std_eps)


register_advantage_estimator(AdvantageEstimator(
    name="passk", level="sequence", call=_passk, fields=("std_eps", "std_unbiased"), min_group=2,
    text=lambda o: (f"A_i = (R_(1) − R_(2)) / (std_G(R) + {o.std_eps:g}) for the best response of each group, 0 for "
                    f"the others,  G = {o.group_size}, {_std_text(o)}\n"
                    "    R_(1), R_(2): the two largest rewards of the group; the margin over the best *other* response\n"
                    "    credits only the group's best answer (max@G / pass@G; verl's grpo_passk)"),
))

register_advantage_estimator(AdvantageEstimator(
    name="gpg", level="sequence", fields=(), min_group=2,
    call=lambda o, rewards, group_ids=None: group_baselines.gpg_advantages(rewards, group_ids=group_ids),
    text=lambda o: (f"A_i = α (R_i − mean_G(R)),  α = B / B_valid,  G = {o.group_size}\n"
                    "    B responses in the batch, B_valid of them in groups whose rewards are not all equal: the\n"
                    "    gradient is rescaled to the mean over the responses that carry a signal (GPG; no std scaling)"),
))
