r"""Recipes as data: an :class:`Objective` states every choice that defines an update.

A recipe is a frozen record of the decisions that words like "normalize", "clip" or
"distill" hide: which advantage estimator (§5, §6, §11, §12, §20.4), which importance ratio
(§7, §17), how it is clipped or gated (§8, §18, §20.2), how per-token terms are aggregated
(§13), where KL to the reference enters (§9) and what is detached. :meth:`Objective.loss`
computes the loss *only* through the core functions, and :func:`explain` prints the exact
estimator from the same fields, so what is printed is what is optimized.

``RECIPES`` holds the twelve named recipes with the defaults of their papers; any field can
be overridden with :meth:`Objective.replace` (the trainer's config does exactly that).
"""
from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

import torch

from . import _checks
from .aggregate import MODES, aggregate
from .types import LossResult

LOSSES = ("reinforce", "ppo", "gspo", "gspo_token", "sapo", "sao", "opd", "dpo")
ADVANTAGES = ("return", "group_std", "group_center", "batch_std", "leave_one_out", "gae", "none")
KL_PLACEMENTS = ("none", "reward", "loss")
KL_KINDS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class Objective:
    """One recipe: every field that changes the estimator, and nothing else.

    Attributes:
      name: recipe name.
      loss: policy term, one of :data:`LOSSES`.
      advantage: advantage estimator, one of :data:`ADVANTAGES`:
        ``return`` (raw return, §2), ``group_std`` (GRPO, §11), ``group_center`` (Dr. GRPO,
        §12), ``batch_std`` (centred per group, scaled by the batch std), ``leave_one_out``
        (RLOO, §5), ``gae`` (critic + token-level skip-observation GAE, §6/§20.4), ``none``
        (the loss needs no advantage: OPD, DPO).
      aggregation: one of :data:`trajgrad.aggregate.MODES` (§13).
      constant: Dr. GRPO's constant normalizer (``seq_sum_constant``); ``None`` = the padded
        generation length.
      eps_low, eps_high: clip range of the ratio (PPO/GRPO/DAPO/GSPO) or the trust interval
        (SAO); ``eps_high`` ``None`` means ``eps_low``.
      dual_clip: dual-clip constant c > 1 for negative advantages (``None`` = off).
      tau_pos, tau_neg: SAPO temperatures (§18).
      ratio_gradient: SAO's ``"detached"`` or ``"attached"`` ratio (§20.2).
      beta: DPO's β (§10).
      kl_coef, kl_placement, kl_kind: KL to the reference policy (§9): in the reward (per
        token, ``r_t - kl_coef * k``) or as a loss term (``+ kl_coef * aggregate(k)``).
      gamma, lam: discount and GAE λ (critic recipes).
      std_eps: ε in ``(R - mean)/(std + ε)``.
      group_size: rollouts per prompt (1 for single-rollout methods).
      dynamic_sampling: resample groups with zero reward variance (DAPO, §11); every
        discarded group and its generation cost are logged.
      critic: the recipe trains a value function (PPO, SAO).
      critic_updates: K critic updates per actor update (SAO §20.3).
      value_clip: PPO value-clipping range (``None`` = off).
      vf_coef: weight of the value loss when it shares the backward pass.
      entropy_coef: entropy bonus weight (0 = off).
      paper: the reference the defaults come from.
    """

    name: str
    loss: str
    advantage: str
    aggregation: str
    constant: Optional[float] = None
    eps_low: float = 0.2
    eps_high: Optional[float] = None
    dual_clip: Optional[float] = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    ratio_gradient: str = "detached"
    beta: float = 0.1
    kl_coef: float = 0.0
    kl_placement: str = "none"
    kl_kind: str = "k1"
    gamma: float = 1.0
    lam: float = 1.0
    std_eps: float = 1e-6
    group_size: int = 1
    dynamic_sampling: bool = False
    critic: bool = False
    critic_updates: int = 1
    value_clip: Optional[float] = None
    vf_coef: float = 0.5
    entropy_coef: float = 0.0
    paper: str = ""

    def __post_init__(self) -> None:
        _checks.check_choice("loss", self.loss, LOSSES)
        _checks.check_choice("advantage", self.advantage, ADVANTAGES)
        _checks.check_choice("aggregation", self.aggregation, MODES)
        _checks.check_choice("kl_placement", self.kl_placement, KL_PLACEMENTS)
        _checks.check_choice("kl_kind", self.kl_kind, KL_KINDS)
        _checks.check_choice("ratio_gradient", self.ratio_gradient, ("detached", "attached"))
        _checks.check_positive("eps_low", self.eps_low)
        if self.eps_high is not None:
            _checks.check_positive("eps_high", self.eps_high)
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip: must be > 1, got {self.dual_clip}")
        _checks.check_positive("tau_pos", self.tau_pos)
        _checks.check_positive("tau_neg", self.tau_neg)
        _checks.check_positive("beta", self.beta)
        _checks.check_positive("kl_coef", self.kl_coef, allow_zero=True)
        _checks.check_in_range("gamma", self.gamma, 0.0, 1.0)
        _checks.check_in_range("lam", self.lam, 0.0, 1.0)
        _checks.check_positive("std_eps", self.std_eps, allow_zero=True)
        if self.group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {self.group_size}")
        if self.advantage in ("group_std", "group_center", "batch_std") and self.group_size < 2:
            raise ValueError(f"group_size: advantage {self.advantage!r} needs groups of >= 2, got {self.group_size}")
        if self.advantage == "leave_one_out" and self.group_size < 2:
            raise ValueError(f"group_size: leave-one-out needs groups of >= 2, got {self.group_size}")
        if self.kl_placement == "none" and self.kl_coef != 0:
            raise ValueError("kl_coef: is nonzero but kl_placement is 'none'")
        if self.constant is not None and self.aggregation != "seq_sum_constant":
            raise ValueError("constant: only used with aggregation 'seq_sum_constant'")
        if self.critic_updates < 1:
            raise ValueError(f"critic_updates: must be >= 1, got {self.critic_updates}")
        if self.advantage == "gae" and not self.critic:
            raise ValueError("critic: advantage 'gae' needs critic=True")
        _checks.check_positive("entropy_coef", self.entropy_coef, allow_zero=True)

    # ------------------------------------------------------------------ helpers
    @property
    def eps_high_(self) -> float:
        return self.eps_low if self.eps_high is None else self.eps_high

    def replace(self, **changes: Any) -> "Objective":
        """A copy with some fields changed (validated again)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: not a field of Objective")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def uses_old_logp(self) -> bool:
        return self.loss in ("ppo", "gspo", "gspo_token", "sapo", "sao")

    @property
    def uses_reference(self) -> bool:
        return self.kl_placement != "none" or self.loss == "dpo"

    # ------------------------------------------------------------------ advantages
    def sequence_advantages(self, rewards: torch.Tensor, group_ids: Optional[torch.Tensor] = None):
        """Per-response advantages from per-response rewards for the group recipes.

        Args:
          rewards: ``[N, G]`` (``N`` prompts × ``G`` rollouts) or ``[M]`` with ``group_ids``.
        Returns:
          ``trajgrad.baselines.GroupAdvantages`` (advantages in the shape of ``rewards``,
          and the per-group zero-variance flags that dynamic sampling and the logs use).
        """
        from . import baselines

        if self.advantage == "group_std":
            return baselines.group_advantages(rewards, scale="std", eps=self.std_eps, group_ids=group_ids)
        if self.advantage == "group_center":
            return baselines.group_advantages(rewards, scale="none", eps=self.std_eps, group_ids=group_ids)
        if self.advantage == "batch_std":
            return baselines.group_advantages(rewards, scale="batch_std", eps=self.std_eps, group_ids=group_ids)
        if self.advantage == "leave_one_out":
            return baselines.group_advantages(
                rewards, scale="none", eps=self.std_eps, leave_one_out=True, group_ids=group_ids
            )
        if self.advantage == "return":
            r = torch.as_tensor(rewards)
            return baselines.GroupAdvantages(r.clone(), torch.zeros_like(r), torch.zeros_like(r), torch.zeros(0, dtype=torch.bool))
        raise ValueError(f"advantage: {self.advantage!r} is not a per-response estimator (use token_advantages)")

    def token_advantages(self, values, rewards, mask, *, terminated=None, bootstrap_value=None):
        """Token-level advantages and value targets for critic recipes (§6, §20.4).

        Skip-observation GAE on the ``[B, L]`` transcript: mask-0 spans (prompt, tool
        observations, padding) are bridged, never decayed through.
        """
        from . import returns

        if self.advantage != "gae":
            raise ValueError(f"advantage: token_advantages needs 'gae', recipe uses {self.advantage!r}")
        return returns.token_skip_observation_gae(
            values, rewards, mask, gamma=self.gamma, lam=self.lam, terminated=terminated, bootstrap_value=bootstrap_value
        )

    def kl_in_reward(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-token KL penalty ``kl_coef * k(logp, ref_logp)`` to subtract from rewards (§9).

        Detached: a reward is evidence. Zero when the recipe puts no KL in the reward.
        """
        from .losses import kl_estimate

        if self.kl_placement != "reward":
            return torch.zeros_like(logp).detach()
        return (self.kl_coef * kl_estimate(logp.detach(), ref_logp, mask, kind=self.kl_kind)).detach()

    # ------------------------------------------------------------------ the loss
    def loss_fn(self):
        """The core loss function this recipe calls (for introspection and ``verify``)."""
        from . import losses

        return {
            "reinforce": losses.reinforce_loss,
            "ppo": losses.ppo_clip_loss,
            "gspo": losses.gspo_loss,
            "gspo_token": losses.gspo_token_loss,
            "sapo": losses.sapo_loss,
            "sao": losses.sao_dis_loss,
            "dpo": losses.dpo_loss,
            "opd": losses.reverse_kl_distill_loss,
        }[self.loss]

    def policy_loss(
        self,
        logp: torch.Tensor,
        advantages: Optional[torch.Tensor],
        mask: torch.Tensor,
        *,
        old_logp: Optional[torch.Tensor] = None,
        ref_logp: Optional[torch.Tensor] = None,
        denominator: Optional[Any] = None,
        constant: Optional[float] = None,
    ) -> LossResult:
        """The recipe's policy loss on one (micro-)batch of token log-probs.

        ``loss = policy_term + kl_coef * aggregate(k(logp, ref_logp))`` (KL term only when
        ``kl_placement == "loss"``), both aggregated with the recipe's mode and the same
        ``denominator`` so that micro-batches and ranks sum to the full-batch loss (§13).
        For DPO use :meth:`dpo_loss`; for OPD use :meth:`distill_loss`.
        """
        from . import losses

        if self.loss in ("dpo", "opd"):
            raise ValueError(f"loss: recipe {self.name!r} is {self.loss}; call {self.loss}_loss on the objective")
        if self.uses_old_logp and old_logp is None:
            raise ValueError(f"old_logp: required by loss {self.loss!r}")
        if advantages is None:
            raise ValueError(f"advantages: required by loss {self.loss!r}")
        c = self.constant if constant is None else constant
        agg = dict(aggregation=self.aggregation, constant=c, denominator=denominator)
        if self.loss == "reinforce":
            res = losses.reinforce_loss(logp, advantages, mask, **agg)
        elif self.loss == "ppo":
            res = losses.ppo_clip_loss(
                logp, old_logp, advantages, mask, eps_low=self.eps_low, eps_high=self.eps_high_, dual_clip=self.dual_clip, **agg
            )
        elif self.loss == "gspo":
            res = losses.gspo_loss(logp, old_logp, advantages, mask, eps_low=self.eps_low, eps_high=self.eps_high_, **agg)
        elif self.loss == "gspo_token":
            res = losses.gspo_token_loss(logp, old_logp, advantages, mask, eps_low=self.eps_low, eps_high=self.eps_high_, **agg)
        elif self.loss == "sapo":
            res = losses.sapo_loss(logp, old_logp, advantages, mask, tau_pos=self.tau_pos, tau_neg=self.tau_neg, **agg)
        elif self.loss == "sao":
            res = losses.sao_dis_loss(
                logp, old_logp, advantages, mask, eps_low=self.eps_low, eps_high=self.eps_high_,
                ratio_gradient=self.ratio_gradient, **agg,
            )
        else:  # pragma: no cover - guarded by __post_init__
            raise ValueError(f"loss: unknown {self.loss!r}")
        loss, metrics = res.loss, dict(res.metrics)
        if self.kl_placement == "loss":
            if ref_logp is None:
                raise ValueError("ref_logp: required when kl_placement is 'loss'")
            k = losses.kl_estimate(logp, ref_logp, mask, kind=self.kl_kind)
            kl_term = aggregate(k, mask, self.aggregation, constant=c, denominator=denominator)
            loss = loss + self.kl_coef * kl_term
            metrics["kl_loss_term"] = kl_term.detach()
        return LossResult(loss, metrics)

    def dpo_loss(self, chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp) -> LossResult:
        from . import losses

        if self.loss != "dpo":
            raise ValueError(f"loss: recipe {self.name!r} is not dpo")
        return losses.dpo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta=self.beta)

    def distill_loss(self, *, mask, denominator=None, **inputs) -> LossResult:
        from . import losses

        if self.loss != "opd":
            raise ValueError(f"loss: recipe {self.name!r} is not opd")
        return losses.reverse_kl_distill_loss(mask=mask, aggregation=self.aggregation, constant=self.constant,
                                              denominator=denominator, **inputs)


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
        kl_coef=0.04, kl_placement="loss", kl_kind="k3", group_size=8,
        paper="Shao et al. 2024 (DeepSeekMath), spec §11",
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
        kl_placement="reward", kl_kind="k1", gamma=1.0, lam=0.95, critic=True, value_clip=0.2, vf_coef=0.5,
        paper="Schulman et al. 2017 (PPO) with GAE (Schulman et al. 2015), spec §6, §8",
    ),
    "sao": Objective(
        name="sao", loss="sao", advantage="gae", aggregation="token_mean", eps_low=0.3, eps_high=5.0,
        ratio_gradient="detached", gamma=1.0, lam=1.0, critic=True, critic_updates=2, group_size=1,
        paper="Hou et al. 2026 (SAO), spec §20; eps (0.3, 5.0) = the paper's reasoning setting",
    ),
    "opd": Objective(
        name="opd", loss="opd", advantage="none", aggregation="token_mean",
        paper="on-policy distillation with the exact reverse KL, spec §14",
    ),
    "dpo": Objective(
        name="dpo", loss="dpo", advantage="none", aggregation="token_mean", beta=0.1,
        paper="Rafailov et al. 2023 (DPO), spec §10",
    ),
}


def get_recipe(name: str, **overrides: Any) -> Objective:
    """A recipe by name, with fields overridden (validated)."""
    if name not in RECIPES:
        raise ValueError(f"recipe: unknown {name!r}; known: {', '.join(RECIPES)}")
    obj = RECIPES[name]
    return obj.replace(**overrides) if overrides else obj


# ---------------------------------------------------------------------- explain
_AGG_TEXT = {
    "token_mean": "Σ_i Σ_t m_it x_it / Σ_i L_i            (every token weighs the same; long responses weigh more)",
    "seq_mean_token_mean": "(1/B) Σ_i (1/L_i) Σ_t m_it x_it     (every response weighs the same; tokens of long responses weigh less)",
    "seq_mean_token_sum": "(1/B) Σ_i Σ_t m_it x_it             (sum over a response's tokens, mean over responses)",
    "seq_sum_constant": "(1/B) Σ_i Σ_t m_it x_it / C          (C constant = {C}; no per-response length normalization)",
}


def _advantage_text(o: Objective) -> str:
    G = o.group_size
    if o.advantage == "return":
        return "A_i = R_i  (the raw return; no baseline)"
    if o.advantage == "group_std":
        return (f"A_i = (R_i − mean_G(R)) / (std_G(R) + {o.std_eps:g}),  G = {G}, population std (1/G)\n"
                "    groups with std = 0 have A = 0 (no relative signal, §11); std scaling reweights prompts (§12)")
    if o.advantage == "group_center":
        return f"A_i = R_i − mean_G(R),  G = {G}  (no std scaling: Dr. GRPO, §12)"
    if o.advantage == "batch_std":
        return f"A_i = (R_i − mean_G(R)) / (std_batch(R) + {o.std_eps:g}),  G = {G}"
    if o.advantage == "leave_one_out":
        return f"A_i = R_i − (1/(G−1)) Σ_{{k≠i}} R_k,  G = {G}  (leave-one-out, §5)"
    if o.advantage == "gae":
        return (f"A_t = Σ_l (γλ)^l δ_{{t+l}},  δ_t = r_t + γ V(next action token) − V(t),  γ = {o.gamma:g}, λ = {o.lam:g}\n"
                "    skip-observation: tool-observation and prompt tokens are bridged, not decayed through (§20.4);\n"
                "    true termination zeroes the bootstrap, truncation bootstraps from V (§6)")
    return "none (the loss takes no advantage)"


def _policy_text(o: Objective) -> str:
    el, eh = o.eps_low, o.eps_high_
    if o.loss == "reinforce":
        return "x_it = − A_i · log π_θ(y_it)          (score function, §2/§4; no ratio, on-policy)"
    if o.loss == "ppo":
        s = (f"ρ_it = exp(log π_θ(y_it) − sg[log π_old(y_it)])   (per-token ratio, §7)\n"
             f"x_it = − min(ρ_it A_it, clip(ρ_it, 1 − {el:g}, 1 + {eh:g}) A_it)   (§8)\n"
             f"    A > 0: no gain once ρ > {1 + eh:g};  A < 0: no gain once ρ < {1 - el:g}")
        if o.dual_clip is not None:
            s += f"\n    dual clip: for A < 0, x_it = − max(min(...), {o.dual_clip:g} · A_it)"
        return s
    if o.loss == "gspo":
        return (f"s_i = exp((1/L_i) Σ_t [log π_θ(y_it) − sg[log π_old(y_it)]])   (geometric-mean sequence ratio, §17;\n"
                "    NOT the full-sequence density ratio)\n"
                f"x_it = − min(s_i A_i, clip(s_i, 1 − {el:g}, 1 + {eh:g}) A_i)   at every token of response i\n"
                "    gradient: (s_i A_i / L_i) Σ_t ∇log π_θ(y_it) away from clipping")
    if o.loss == "gspo_token":
        return ("s_it = sg[s_i] · π_θ(y_it) / sg[π_θ(y_it)]    (value s_i, gradient s_i ∇log π_θ(y_it), §17)\n"
                f"x_it = − min(s_it A_it, clip(s_it, 1 − {el:g}, 1 + {eh:g}) A_it)\n"
                "    equals GSPO in value and gradient when A_it = A_i")
    if o.loss == "sapo":
        return ("r_it = exp(log π_θ(y_it) − sg[log π_old(y_it)])   (NOT detached: its gradient is the update)\n"
                f"τ_it = {o.tau_pos:g} if A_it > 0 else {o.tau_neg:g}\n"
                "x_it = − (4/τ_it) σ(τ_it (r_it − 1)) A_it          (§18)\n"
                "    gradient gate 4p(1−p) r A ∇log π_θ, gate = 1 at r = 1 for any τ")
    if o.loss == "sao":
        w = "sg[r_t · 1{trusted}]" if o.ratio_gradient == "detached" else "r_t · 1{trusted}  (attached)"
        g = "A r ∇log π" if o.ratio_gradient == "detached" else "A r (1 + log π) ∇log π"
        return (f"r_t = exp(log π_θ(a_t) − log π_rollout(a_t))   (direct to the rollout engine's log-probs, §20.2)\n"
                f"trusted = {1 - el:g} < r_t < {1 + eh:g}   (strict; both tails rejected, not clipped)\n"
                f"x_t = − {w} · A_t · log π_θ(a_t)\n"
                f"    gradient inside the interval: {g}; zero outside")
    if o.loss == "opd":
        return ("x_t = Σ_v π_θ(v|h_t) [log π_θ(v|h_t) − sg[log π_E(v|h_t)]]   (exact reverse KL over the full vocabulary, §14;\n"
                "    not the sampled-token approximation)")
    if o.loss == "dpo":
        return (f"loss = − log σ(β [log π_θ(y_w) − log π_ref(y_w)] − β [log π_θ(y_l) − log π_ref(y_l)]),  β = {o.beta:g}   (§10)\n"
                "    sequence log-probs; reference log-probs detached; a static preference dataset")
    raise ValueError(o.loss)  # pragma: no cover


def _kl_text(o: Objective) -> str:
    k = {"k1": "k1 = log π_θ − log π_ref", "k2": "k2 = ½ (log π_θ − log π_ref)²",
         "k3": "k3 = π_ref/π_θ − 1 − log(π_ref/π_θ)"}[o.kl_kind]
    if o.kl_placement == "none":
        return "none"
    if o.kl_placement == "reward":
        return f"in the reward: r_t ← r_t − {o.kl_coef:g} · sg[{k}]  (per token, detached)"
    return f"in the loss: + {o.kl_coef:g} · aggregate({k})  (same aggregation and denominator as the policy term)"


def explain(recipe: "str | Objective", **overrides: Any) -> str:
    """The exact estimator a recipe optimizes, as text generated from its fields."""
    o = get_recipe(recipe, **overrides) if isinstance(recipe, str) else (recipe.replace(**overrides) if overrides else recipe)
    C = "the padded generation length L" if o.constant is None else f"{o.constant:g}"
    detached = ["advantages", "rewards"]
    if o.uses_old_logp:
        detached.append("rollout/old log-probs" if o.loss != "sao" else "rollout log-probs")
    if o.kl_placement != "none" or o.loss == "dpo":
        detached.append("reference log-probs")
    if o.critic:
        detached.append("value targets (GAE returns)")
    if o.loss == "opd":
        detached = ["teacher distribution"]
    if o.loss == "gspo_token":
        detached.append("the sequence ratio s_i inside s_it")
    if o.loss == "sao" and o.ratio_gradient == "detached":
        detached.append("the trusted ratio weight")
    lines = [
        f"recipe: {o.name}    ({o.paper})" if o.paper else f"recipe: {o.name}",
        "",
        "advantage:",
        textwrap.indent(_advantage_text(o), "  "),
        "",
        "per-token term (to minimize):",
        textwrap.indent(_policy_text(o), "  "),
        "",
        "aggregation: " + o.aggregation,
        "  loss = " + _AGG_TEXT[o.aggregation].format(C=C) if o.loss != "dpo" else "  mean over preference pairs",
        "  masked tokens (prompt, tool observations, padding) enter neither numerator nor denominator;",
        "  with micro-batches or ranks the denominator is the global count, summed before backward (§13)",
        "",
        "KL to reference: " + _kl_text(o),
    ]
    if o.critic:
        vc = f"clipped to ±{o.value_clip:g} around the old value" if o.value_clip is not None else "unclipped"
        lines += ["", f"critic: value loss ½ (V − sg[R̂])² ({vc}), {o.critic_updates} critic update(s) per actor update"]
    if o.entropy_coef:
        lines += [f"entropy bonus: − {o.entropy_coef:g} · aggregate(H(π_θ))"]
    if o.dynamic_sampling:
        lines += ["", "dynamic sampling: groups whose rewards have zero variance are resampled; each discarded",
                  "  group and the tokens it cost are logged (this changes which prompts enter the update, §11)"]
    lines += ["", "detached (stop-gradient): " + ", ".join(detached)]
    return "\n".join(lines)
