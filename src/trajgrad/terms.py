r"""The built-in policy terms: one registry entry per core loss (spec §2–§20).

Each entry says which core function computes the term, which ``Objective`` fields it
reads, which log-probabilities its ratio is taken against, what it detaches, and how
``explain`` prints it. See :mod:`trajgrad.registry` for the fields of an entry.

``zero_without_advantage=True`` marks the terms that are the advantage times a function of
the row's own log-probs, so a row with zero advantages has a zero term and a zero gradient.
Not DRO (its ``z²`` penalty acts at ``A = 0``), nor Clip-Cov / KL-Cov (their covariances
are taken over the batch, so every row's log-probs move the other rows' terms).
"""
from __future__ import annotations

import torch

from . import losses
from .registry import PolicyTerm, register_policy_term


def _clip(o):
    return dict(eps_low=o.eps_low, eps_high=o.eps_high_)


# ---------------------------------------------------------------------- REINFORCE (§2, §4)
register_policy_term(PolicyTerm(
    name="reinforce", zero_without_advantage=True, fn=losses.reinforce_loss, fields=(), ratio="none", detached=(),
    aggregation="seq_mean_token_sum",
    text=lambda o: "x_it = − A_i · log π_θ(y_it)          (score function, §2/§4; no ratio, on-policy)",
    call=lambda o, x: losses.reinforce_loss(x.logp, x.advantages, x.mask, **x.agg),
))


# ---------------------------------------------------------------------- PPO clip (§7, §8)
def _ppo_text(o) -> str:
    el, eh = o.eps_low, o.eps_high_
    s = (f"ρ_it = exp(log π_θ(y_it) − sg[log π_old(y_it)])   (per-token ratio, §7)\n"
         f"x_it = − min(ρ_it A_it, clip(ρ_it, 1 − {el:g}, 1 + {eh:g}) A_it)   (§8)\n"
         f"    A > 0: no gain once ρ > {1 + eh:g};  A < 0: no gain once ρ < {1 - el:g}")
    if o.dual_clip is not None:
        s += f"\n    dual clip: for A < 0, x_it = − max(min(...), {o.dual_clip:g} · A_it)"
    return s


register_policy_term(PolicyTerm(
    name="ppo", zero_without_advantage=True, fn=losses.ppo_clip_loss, fields=("eps_low", "eps_high", "dual_clip"), ratio="old",
    detached=("old log-probs",), aggregation="token_mean", text=_ppo_text,
    call=lambda o, x: losses.ppo_clip_loss(x.logp, x.ratio_logp, x.advantages, x.mask, dual_clip=o.dual_clip,
                                           **_clip(o), **x.agg),
))


# ---------------------------------------------------------------------- GSPO (§17)
def _gspo_text(o) -> str:
    return (f"s_i = exp((1/L_i) Σ_t [log π_θ(y_it) − sg[log π_old(y_it)]])   (geometric-mean sequence ratio, §17;\n"
            "    NOT the full-sequence density ratio)\n"
            f"x_it = − min(s_i A_i, clip(s_i, 1 − {o.eps_low:g}, 1 + {o.eps_high_:g}) A_i)   at every token of response i\n"
            "    gradient: (s_i A_i / L_i) Σ_t ∇log π_θ(y_it) away from clipping")


register_policy_term(PolicyTerm(
    name="gspo", zero_without_advantage=True, fn=losses.gspo_loss, fields=("eps_low", "eps_high"), ratio="old", detached=("old log-probs",),
    aggregation="seq_mean_token_mean", text=_gspo_text, sequence_advantages=True, verify_noise=2e-3,
    call=lambda o, x: losses.gspo_loss(x.logp, x.ratio_logp, x.advantages, x.mask, **_clip(o), **x.agg),
))


def _gspo_token_text(o) -> str:
    return ("s_it = sg[s_i] · π_θ(y_it) / sg[π_θ(y_it)]    (value s_i, gradient s_i ∇log π_θ(y_it), §17)\n"
            f"x_it = − min(s_it A_it, clip(s_it, 1 − {o.eps_low:g}, 1 + {o.eps_high_:g}) A_it)\n"
            "    equals GSPO in value and gradient when A_it = A_i")


register_policy_term(PolicyTerm(
    name="gspo_token", zero_without_advantage=True, fn=losses.gspo_token_loss, fields=("eps_low", "eps_high"), ratio="old",
    detached=("old log-probs", "the sequence ratio s_i inside s_it"), aggregation="seq_mean_token_mean",
    text=_gspo_token_text, verify_noise=2e-3,
    call=lambda o, x: losses.gspo_token_loss(x.logp, x.ratio_logp, x.advantages, x.mask, **_clip(o), **x.agg),
))


# ---------------------------------------------------------------------- SAPO (§18)
def _sapo_text(o) -> str:
    if o.sapo_level == "sequence":
        return ("s_i = exp((1/L_i) Σ_t [log π_θ(y_it) − sg[log π_old(y_it)]])   (GSPO's sequence ratio, NOT detached)\n"
                f"τ_i = {o.tau_pos:g} if A_i > 0 else {o.tau_neg:g}\n"
                "x_it = − (4/τ_i) σ(τ_i (s_i − 1)) A_i   at every token of response i   (sequence-level SAPO)\n"
                "    gradient 4p(1−p) s_i A_i (1/L_i) Σ_t ∇log π_θ(y_it): one soft-gated weight per response")
    return ("r_it = exp(log π_θ(y_it) − sg[log π_old(y_it)])   (NOT detached: its gradient is the update)\n"
            f"τ_it = {o.tau_pos:g} if A_it > 0 else {o.tau_neg:g}\n"
            "x_it = − (4/τ_it) σ(τ_it (r_it − 1)) A_it          (§18)\n"
            "    gradient gate 4p(1−p) r A ∇log π_θ, gate = 1 at r = 1 for any τ")


def _sapo_validate(o) -> None:
    if o.sapo_level == "sequence" and o.estimator.level == "token":
        raise ValueError("sapo_level: 'sequence' needs one advantage per response; "
                         f"advantage {o.advantage!r} is per token")


register_policy_term(PolicyTerm(
    name="sapo", zero_without_advantage=True, fn=losses.sapo_loss, fields=("tau_pos", "tau_neg", "sapo_level"), ratio="old",
    detached=("old log-probs",), aggregation="seq_mean_token_mean", text=_sapo_text, validate=_sapo_validate,
    call=lambda o, x: losses.sapo_loss(x.logp, x.ratio_logp, x.advantages, x.mask, tau_pos=o.tau_pos,
                                       tau_neg=o.tau_neg, level=o.sapo_level, **x.agg),
))


# ---------------------------------------------------------------------- SAO direct double-sided IS (§20.2)
def _sao_text(o) -> str:
    detached = o.ratio_gradient == "detached"
    w = "sg[r_t · 1{trusted}]" if detached else "r_t · 1{trusted}  (attached)"
    g = "A r ∇log π" if detached else "A r (1 + log π) ∇log π"
    return (f"r_t = exp(log π_θ(a_t) − log π_rollout(a_t))   (direct to the rollout engine's log-probs, §20.2)\n"
            f"trusted = {1 - o.eps_low:g} < r_t < {1 + o.eps_high_:g}   (strict; both tails rejected, not clipped)\n"
            f"x_t = − {w} · A_t · log π_θ(a_t)\n"
            f"    gradient inside the interval: {g}; zero outside")


register_policy_term(PolicyTerm(
    name="sao", zero_without_advantage=True, fn=losses.sao_dis_loss, fields=("eps_low", "eps_high", "ratio_gradient"), ratio="behaviour",
    detached=lambda o: ("rollout log-probs",) + (("the trusted ratio weight",) if o.ratio_gradient == "detached" else ()),
    aggregation="token_mean", text=_sao_text, verify_noise=0.6,
    call=lambda o, x: losses.sao_dis_loss(x.logp, x.ratio_logp, x.advantages, x.mask, ratio_gradient=o.ratio_gradient,
                                          **_clip(o), **x.agg),
))


# ---------------------------------------------------------------------- exact on-policy distillation (§14)
register_policy_term(PolicyTerm(
    name="opd", fn=losses.reverse_kl_distill_loss, fields=(), ratio="none", detached=("teacher distribution",),
    aggregation="token_mean", kind="distill",
    text=lambda o: ("x_t = Σ_v π_θ(v|h_t) [log π_θ(v|h_t) − sg[log π_E(v|h_t)]]   (exact reverse KL over the full "
                    "vocabulary, §14;\n    not the sampled-token approximation)"),
))


# ---------------------------------------------------------------------- generalized JSD(β) distillation (§14)
_JSD_NORMALIZED = {"kl_at_ends": "kl_at_ends", "normalized": True, "unnormalized": False}


def _jsd_text(o) -> str:
    b = o.jsd_beta
    ends = {"kl_at_ends": "JSD(β) itself; at β = 0 the forward KL KL(π_E‖π_θ), at β = 1 the reverse KL (TRL's convention)",
            "normalized": "JSD(β) / (β(1 − β)): continuous on [0, 1], forward KL at 0, reverse KL at 1",
            "unnormalized": "JSD(β) itself (0 at β ∈ {0, 1})"}[o.jsd_normalized]
    return (f"m = {b:g} · sg[π_E] + {1 - b:g} · π_θ   (the teacher's weight β = {b:g})\n"
            f"x_t = {b:g} · KL(sg[π_E] ‖ m) + {1 - b:g} · KL(π_θ ‖ m)   exact over the vocabulary (§14)\n"
            f"    {ends}")


register_policy_term(PolicyTerm(
    name="generalized_jsd", fn=losses.jsd_distill_loss, fields=("jsd_beta", "jsd_normalized"), ratio="none",
    detached=("teacher distribution",), aggregation="token_mean", kind="distill", text=_jsd_text,
    call=lambda o, x: losses.jsd_distill_loss(beta=o.jsd_beta, normalized=_JSD_NORMALIZED[o.jsd_normalized], **x),
))


# ---------------------------------------------------------------------- DPO (§10)
register_policy_term(PolicyTerm(
    name="dpo", fn=losses.dpo_loss, fields=("beta",), ratio="none", detached=("reference log-probs",),
    aggregation="token_mean", kind="pairwise",
    text=lambda o: (f"loss = − log σ(β [log π_θ(y_w) − log π_ref(y_w)] − β [log π_θ(y_l) − log π_ref(y_l)]),  "
                    f"β = {o.beta:g}   (§10)\n"
                    "    sequence log-probs; reference log-probs detached; a static preference dataset"),
))


# ---------------------------------------------------------------------- VESPO (arXiv 2602.10693)
def _vespo_text(o) -> str:
    return ("log w_i = clamp(Σ_t clamp(log π_θ(y_it) − log π_old(y_it), ±20), log 1e-8, 20)   (full sequence ratio)\n"
            "φ(w) = e^λ w^k e^(−λw)   (φ(1) = 1),  (k, λ) = (2, 3) if A_it ≥ 0, (3, 2) if A_it < 0   (the paper's)\n"
            "x_it = − sg[φ(w_i)] · A_it · log π_θ(y_it)   (a smooth weight on the sequence ratio, no clipping)")


register_policy_term(PolicyTerm(
    name="vespo", zero_without_advantage=True, fn=losses.vespo_loss, fields=(), ratio="old", detached=("old log-probs", "the weight φ(w_i)"),
    aggregation="token_mean", text=_vespo_text,
    call=lambda o, x: losses.vespo_loss(x.logp, x.ratio_logp, x.advantages, x.mask, **x.agg),
))


# ---------------------------------------------------------------------- DRO's policy term (Richemond et al. 2024)
register_policy_term(PolicyTerm(
    name="dro", fn=losses.dro_loss, fields=("beta",), ratio="old", detached=("old log-probs",),
    aggregation="token_mean",
    text=lambda o: ("z_it = log π_θ(y_it) − sg[log π_old(y_it)]\n"
                    f"x_it = − A_it · log π_θ(y_it) + ({o.beta:g}/2) · z_it²   (quadratic log-ratio penalty, DRO)\n"
                    f"    gradient ({o.beta:g} z_it − A_it) ∇log π_θ: REINFORCE at z = 0, pulled back to π_old beyond"),
    call=lambda o, x: losses.dro_loss(x.logp, x.ratio_logp, x.advantages, x.mask, beta=o.beta, **x.agg),
))


# ---------------------------------------------------------------------- CISPO (MiniMax-M1)
def _cispo_text(o) -> str:
    lo = "0" if o.weight_eps_low >= 1 else f"{1 - o.weight_eps_low:g}"
    return ("r_it = exp(log π_θ(y_it) − log π_old(y_it))\n"
            f"x_it = − sg[clip(r_it, {lo}, {1 + o.eps_high_:g})] · A_it · log π_θ(y_it)   (clipped IS weight, MiniMax-M1)\n"
            "    every token keeps a gradient, weighted by the clipped ratio (PPO would zero the clipped ones)")


register_policy_term(PolicyTerm(
    name="cispo", zero_without_advantage=True, fn=losses.cispo_loss, fields=("eps_high", "weight_eps_low"), ratio="old",
    detached=("old log-probs", "the clipped IS weight"), aggregation="token_mean", text=_cispo_text,
    call=lambda o, x: losses.cispo_loss(x.logp, x.ratio_logp, x.advantages, x.mask,
                                        eps_low=None if o.weight_eps_low >= 1 else o.weight_eps_low,
                                        eps_high=o.eps_high_, **x.agg),
))


# ---------------------------------------------------------------------- GMPO (Zhao et al. 2025)
def _gmpo_text(o) -> str:
    cl, ch = o.log_clip_low, o.log_clip_high
    return ("z_it = log π_θ(y_it) − sg[log π_old(y_it)]\n"
            f"z̃_it = min(z_it, {ch:g}) if A_i > 0;  max(z_it, −{cl:g}) if A_i < 0   (token-level clip in log space)\n"
            "x_it = − A_i · exp((1/L_i) Σ_t z̃_it)   at every token of response i   (geometric mean of clipped ratios)\n"
            "    gradient (A_i s̃_i / L_i) ∇log π_θ(y_it) on unclipped tokens, 0 on clipped ones")


register_policy_term(PolicyTerm(
    name="gmpo", zero_without_advantage=True, fn=losses.gmpo_loss, fields=("log_clip_low", "log_clip_high"), ratio="old",
    detached=("old log-probs",), aggregation="seq_mean_token_mean", text=_gmpo_text, sequence_advantages=True,
    call=lambda o, x: losses.gmpo_loss(x.logp, x.ratio_logp, x.advantages, x.mask, clip_low=o.log_clip_low,
                                       clip_high=o.log_clip_high, **x.agg),
))


# ---------------------------------------------------------------------- DPPO (Qi et al. 2026)
def _dppo_text(kind):
    def text(o) -> str:
        if kind == "tv":
            d = "D_it = p_it − q_it  (p = π_θ(y_it), q = π_old(y_it): binary total variation, signed)"
            m = f"M_it = 0 if (A > 0 and D > {o.delta_high:g}) or (A < 0 and D < −{o.delta_low:g}), else 1"
        else:
            d = "D_it = q log(q/p) + (1−q) log((1−q)/(1−p))  (binary KL of the sampled token, p = π_θ, q = π_old)"
            m = (f"M_it = 0 if (A > 0, p > q, D > {o.delta_high:g}) or (A < 0, p < q, D > {o.delta_low:g}), else 1")
        r = "r_it" if o.dppo_ratio_cap is None else f"min(r_it, {o.dppo_ratio_cap:g})"
        return (d + "\n" + m + "   (trust region on the probability, one-sided like §8)\n"
                f"x_it = − M_it · sg[{r}] · A_it · log π_θ(y_it),  r_it = π_θ/π_old   (gradient M sg[{r}] A ∇log π_θ)")
    return text


register_policy_term(PolicyTerm(
    name="dppo_tv", zero_without_advantage=True, fn=losses.dppo_tv_loss, fields=("delta_low", "delta_high", "dppo_ratio_cap"), ratio="old",
    detached=("old log-probs", "the ratio weight", "the trust-region mask"), aggregation="token_mean",
    text=_dppo_text("tv"), verify_noise=0.6,
    call=lambda o, x: losses.dppo_tv_loss(x.logp, x.ratio_logp, x.advantages, x.mask, delta_low=o.delta_low,
                                          delta_high=o.delta_high, ratio_cap=o.dppo_ratio_cap, **x.agg),
))
register_policy_term(PolicyTerm(
    name="dppo_kl", zero_without_advantage=True, fn=losses.dppo_kl_loss, fields=("delta_low", "delta_high", "dppo_ratio_cap"),
    ratio="old", detached=("old log-probs", "the ratio weight", "the trust-region mask"), aggregation="token_mean",
    text=_dppo_text("kl"), verify_noise=0.6,
    call=lambda o, x: losses.dppo_kl_loss(x.logp, x.ratio_logp, x.advantages, x.mask, delta_low=o.delta_low,
                                          delta_high=o.delta_high, ratio_cap=o.dppo_ratio_cap, **x.agg),
))


# ---------------------------------------------------------------------- Clip-Cov / KL-Cov (Cui et al. 2025)
_COV = "Cov_it = (log π_θ(y_it) − mean log π) (A_it − mean A)   (detached, means over the batch's valid tokens)"


def _batch_seed(x) -> int:
    """A selection seed that is a function of the batch content (same batch, same tokens)."""
    with torch.no_grad():
        m = torch.as_tensor(x.mask).to(torch.float64)
        lp = torch.where(m > 0, x.logp.detach().to(torch.float64), torch.zeros((), dtype=torch.float64))
        adv = torch.as_tensor(x.advantages).detach().to(torch.float64)
        valid = m > 0 if adv.ndim == 2 else (m > 0).any(-1)
        adv = torch.where(valid, adv, torch.zeros((), dtype=torch.float64))
        key = (float(lp.sum()), float((lp * lp).sum()), float(adv.sum()), int(m.sum()))
    return hash(key) & 0x7FFFFFFF


def _clip_cov_text(o) -> str:
    return (_COV + "\n"
            f"S = random (seeded by the batch) selection of {o.cov_ratio:g}·N tokens with {o.cov_low:g} < Cov < 5, "
            "not clipped by PPO\n"
            f"x_it = − min(ρ A, clip(ρ, 1 − {o.eps_low:g}, 1 + {o.eps_high_:g}) A), with sg[·] on the tokens of S   "
            "(their gradient is removed)")


def _kl_cov_text(o) -> str:
    return (_COV + "\n"
            f"T = the {o.cov_ratio:g}·N tokens of largest positive Cov\n"
            f"x_it = − ρ_it A_it + {o.cov_kl_coef:g} · 1[t ∈ T] · |log π_θ(y_it) − log π_old(y_it)|   (no clipping)")


register_policy_term(PolicyTerm(
    name="clip_cov", fn=losses.clip_cov_loss, fields=("eps_low", "eps_high", "cov_ratio", "cov_low"),
    ratio="old", detached=("old log-probs", "the covariance", "the selected tokens' terms"), aggregation="token_mean",
    text=_clip_cov_text,
    call=lambda o, x: losses.clip_cov_loss(x.logp, x.ratio_logp, x.advantages, x.mask, clip_ratio=o.cov_ratio,
                                           cov_low=o.cov_low, cov_high=5.0, seed=_batch_seed(x), **_clip(o),
                                           **x.agg),
))
register_policy_term(PolicyTerm(
    name="kl_cov", fn=losses.kl_cov_loss, fields=("cov_ratio", "cov_kl_coef"), ratio="old",
    detached=("old log-probs", "the covariance"), aggregation="token_mean", text=_kl_cov_text,
    call=lambda o, x: losses.kl_cov_loss(x.logp, x.ratio_logp, x.advantages, x.mask, kl_ratio=o.cov_ratio,
                                         kl_coef=o.cov_kl_coef, **x.agg),
))
