r"""The built-in policy terms: one registry entry per core loss (spec §2–§20).

Each entry says which core function computes the term, which ``Objective`` fields it
reads, which log-probabilities its ratio is taken against, what it detaches, and how
``explain`` prints it. See :mod:`trajgrad.registry` for the fields of an entry.
"""
from __future__ import annotations

from . import losses
from .registry import PolicyTerm, register_policy_term


def _clip(o):
    return dict(eps_low=o.eps_low, eps_high=o.eps_high_)


# ---------------------------------------------------------------------- REINFORCE (§2, §4)
register_policy_term(PolicyTerm(
    name="reinforce", fn=losses.reinforce_loss, fields=(), ratio="none", detached=(),
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
    name="ppo", fn=losses.ppo_clip_loss, fields=("eps_low", "eps_high", "dual_clip"), ratio="old",
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
    name="gspo", fn=losses.gspo_loss, fields=("eps_low", "eps_high"), ratio="old", detached=("old log-probs",),
    aggregation="seq_mean_token_mean", text=_gspo_text, sequence_advantages=True, verify_noise=2e-3,
    call=lambda o, x: losses.gspo_loss(x.logp, x.ratio_logp, x.advantages, x.mask, **_clip(o), **x.agg),
))


def _gspo_token_text(o) -> str:
    return ("s_it = sg[s_i] · π_θ(y_it) / sg[π_θ(y_it)]    (value s_i, gradient s_i ∇log π_θ(y_it), §17)\n"
            f"x_it = − min(s_it A_it, clip(s_it, 1 − {o.eps_low:g}, 1 + {o.eps_high_:g}) A_it)\n"
            "    equals GSPO in value and gradient when A_it = A_i")


register_policy_term(PolicyTerm(
    name="gspo_token", fn=losses.gspo_token_loss, fields=("eps_low", "eps_high"), ratio="old",
    detached=("old log-probs", "the sequence ratio s_i inside s_it"), aggregation="seq_mean_token_mean",
    text=_gspo_token_text, verify_noise=2e-3,
    call=lambda o, x: losses.gspo_token_loss(x.logp, x.ratio_logp, x.advantages, x.mask, **_clip(o), **x.agg),
))


# ---------------------------------------------------------------------- SAPO (§18)
def _sapo_text(o) -> str:
    return ("r_it = exp(log π_θ(y_it) − sg[log π_old(y_it)])   (NOT detached: its gradient is the update)\n"
            f"τ_it = {o.tau_pos:g} if A_it > 0 else {o.tau_neg:g}\n"
            "x_it = − (4/τ_it) σ(τ_it (r_it − 1)) A_it          (§18)\n"
            "    gradient gate 4p(1−p) r A ∇log π_θ, gate = 1 at r = 1 for any τ")


register_policy_term(PolicyTerm(
    name="sapo", fn=losses.sapo_loss, fields=("tau_pos", "tau_neg"), ratio="old", detached=("old log-probs",),
    aggregation="seq_mean_token_mean", text=_sapo_text,
    call=lambda o, x: losses.sapo_loss(x.logp, x.ratio_logp, x.advantages, x.mask, tau_pos=o.tau_pos,
                                       tau_neg=o.tau_neg, **x.agg),
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
    name="sao", fn=losses.sao_dis_loss, fields=("eps_low", "eps_high", "ratio_gradient"), ratio="behaviour",
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


# ---------------------------------------------------------------------- DPO (§10)
register_policy_term(PolicyTerm(
    name="dpo", fn=losses.dpo_loss, fields=("beta",), ratio="none", detached=("reference log-probs",),
    aggregation="token_mean", kind="pairwise",
    text=lambda o: (f"loss = − log σ(β [log π_θ(y_w) − log π_ref(y_w)] − β [log π_θ(y_l) − log π_ref(y_l)]),  "
                    f"β = {o.beta:g}   (§10)\n"
                    "    sequence log-probs; reference log-probs detached; a static preference dataset"),
))
