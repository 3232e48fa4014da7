r"""Policy, preference, KL and value losses (spec §2–§22).

Every ``*_loss`` takes per-token ``[B, L]`` tensors aligned with the targets, a 0/1
action mask, detaches its evidence (advantages, old/rollout/reference log-probs,
returns), zeroes masked slots before any nonlinear operation, aggregates with an
explicit ``aggregation=`` (and optional global ``denominator=``), and returns
``LossResult(loss, metrics)``.

* ``reinforce_loss`` (§2, §4): :math:`-A\ell`; default ``token_mean``.
* ``ppo_clip_loss`` (§8): :math:`-\min(\rho A,\operatorname{clip}(\rho)A)`, optional
  dual clip; default ``token_mean``.
* ``gspo_loss`` (§17): :math:`-\min(s_iA_i,\operatorname{clip}(s_i)A_i)` on the
  geometric-mean sequence ratio; default ``seq_mean_token_mean``.
* ``gspo_token_loss`` (§17): the same with :math:`s_{i,t}=\mathrm{sg}[s_i]\,
  \pi_\theta/\mathrm{sg}[\pi_\theta]` and per-token advantages; default
  ``seq_mean_token_mean``.
* ``sapo_loss`` (§18): :math:`-\frac4\tau\sigma(\tau(r-1))A`; default
  ``seq_mean_token_mean``.
* ``sao_dis_loss`` (§20.2): :math:`-f(r)A\ell`, :math:`f` rejecting both tails; default
  ``token_mean``.
* ``cispo_loss`` (MiniMax-M1): :math:`-\mathrm{sg}[\operatorname{clip}(r)]A\ell`; default
  ``token_mean``.
* ``gmpo_loss`` (Zhao et al. 2025): :math:`-A_i\exp(\frac1{L_i}\sum_t\tilde z_{i,t})`, token
  log ratios clipped by the sign of :math:`A`; default ``seq_mean_token_mean``.
* ``dppo_tv_loss`` / ``dppo_kl_loss`` (Qi et al. 2026): policy gradient masked by a binary
  TV / KL trust region on the sampled token's probability; default ``token_mean``.
* ``clip_cov_loss`` / ``kl_cov_loss`` (Cui et al. 2025): covariance-selected tokens detached /
  KL-penalized; default ``token_mean``.
* ``dro_loss`` (DRO's policy term, verl's ``dro``): :math:`-A\ell+\frac\beta2z^2`; default
  ``token_mean``.
* ``vespo_loss`` (VESPO): :math:`-\mathrm{sg}[\varphi(w_i)]A\ell`, a Gamma-shaped weight of the
  sequence ratio; default ``token_mean``.
* ``dpo_loss`` (§10): :math:`-\log\sigma(\hat r_w-\hat r_l)`, mean over pairs.
* ``value_loss`` (§20.3): :math:`\frac12(V-R)^2`, optionally clipped; default
  ``token_mean``.
* ``reverse_kl_distill_loss`` (§14, exact over the vocabulary, chunked),
  ``forward_kl_distill_loss``, ``jsd_distill_loss``, ``sampled_token_kl`` (a different
  objective), ``multi_teacher_distill_loss`` (§15; ``TeacherRouter`` for learned
  per-position weights); default ``token_mean``.
* ``kl_estimate`` (k1/k2/k3) and ``exact_kl`` (§9, §14); ``LagrangeMultiplier`` (§22).
"""
from ..types import LossResult
from .distill import (
    forward_kl_distill_loss,
    jsd_distill_loss,
    multi_teacher_distill_loss,
    reverse_kl_distill_loss,
    sampled_token_kl,
)
from .cispo import cispo_loss
from .cov import clip_cov_candidates, clip_cov_loss, kl_cov_loss, kl_cov_top_tokens, token_covariance
from .dpo import dpo_loss, sequence_logp
from .dro import dro_loss
from .dppo import dppo_binary_divergence, dppo_kl_loss, dppo_trust_mask, dppo_tv_loss
from .gmpo import gmpo_loss
from .gspo import gspo_loss, gspo_token_loss
from .kl import exact_kl, kl_estimate
from ..control import LagrangeMultiplier, TeacherRouter
from .lagrangian import lagrangian_loss
from .multi_teacher import normalized_teacher_weights
from ._clip import resolve_eps_high
from .ppo import ppo_clip_loss
from .reinforce import reinforce_loss
from .sao import sao_dis_loss
from .sapo import sapo_loss
from .value import value_loss
from .vespo import vespo_loss

__all__ = [
    "LossResult",
    "reinforce_loss",
    "ppo_clip_loss",
    "gspo_loss",
    "gspo_token_loss",
    "sapo_loss",
    "sao_dis_loss",
    "cispo_loss",
    "gmpo_loss",
    "dppo_tv_loss",
    "dppo_kl_loss",
    "clip_cov_loss",
    "dro_loss",
    "vespo_loss",
    "kl_cov_loss",
    "dpo_loss",
    "sequence_logp",
    "kl_estimate",
    "exact_kl",
    "value_loss",
    "LagrangeMultiplier",
    "reverse_kl_distill_loss",
    "forward_kl_distill_loss",
    "jsd_distill_loss",
    "sampled_token_kl",
    "multi_teacher_distill_loss",
    "TeacherRouter",
    "token_covariance",
    "clip_cov_candidates",
    "kl_cov_top_tokens",
    "normalized_teacher_weights",
    "lagrangian_loss",
    "dppo_binary_divergence",
    "dppo_trust_mask",
    "resolve_eps_high",
]
