"""Validation of an :class:`~trajgrad.objective.Objective`'s fields (every error names its field).

Generic checks (types, finite values, domains, choices from the registries) and the rules
that keep printed = optimized: a critic only with an estimator that uses one, KL and entropy
terms only for token-level terms, an advantage estimator exactly when the term takes one,
and each entry's own ``validate``.
"""
from __future__ import annotations

import math

from . import _checks
from .aggregate import MODES
from .registry import ADVANTAGE_ESTIMATORS, POLICY_TERMS


def validate(o) -> None:
    """Raise ``ValueError`` naming the first field of ``o`` that is out of its domain."""
    from .objective import CLIP_COV_HIGH, DPO_LOSS_TYPES, KL_KINDS, KL_PLACEMENTS, SAPO_LEVELS, _finite_positive

    _checks.check_choice("sapo_level", o.sapo_level, SAPO_LEVELS)
    _finite_positive("weight_eps_low", o.weight_eps_low)
    _checks.check_in_range("weight_eps_low", o.weight_eps_low, 0.0, 1.0, inclusive=(False, True))
    for f in ("log_clip_low", "log_clip_high", "delta_low", "delta_high", "cov_ratio", "cov_kl_coef"):
        _finite_positive(f, getattr(o, f), allow_zero=f == "cov_kl_coef")
    _checks.check_in_range("cov_ratio", o.cov_ratio, 0.0, 1.0, inclusive=(False, True))
    v = o.cov_low
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v < CLIP_COV_HIGH:
        raise ValueError(f"cov_low: must be a finite number below {CLIP_COV_HIGH:g}, got {v!r}")
    _checks.check_choice("loss", o.loss, tuple(POLICY_TERMS))
    _checks.check_choice("advantage", o.advantage, tuple(ADVANTAGE_ESTIMATORS))
    _checks.check_choice("aggregation", o.aggregation, MODES)
    _checks.check_choice("kl_placement", o.kl_placement, KL_PLACEMENTS)
    _checks.check_choice("kl_kind", o.kl_kind, KL_KINDS)
    _checks.check_choice("ratio_gradient", o.ratio_gradient, ("detached", "attached"))
    _checks.check_choice("dpo_loss_type", o.dpo_loss_type, DPO_LOSS_TYPES)
    for f in ("std_unbiased", "whiten_advantages", "kl_bias_correction"):
        if not isinstance(getattr(o, f), bool):
            raise ValueError(f"{f}: must be True or False, got {getattr(o, f)!r}")
    _finite_positive("label_smoothing", o.label_smoothing, allow_zero=True)
    _checks.check_in_range("label_smoothing", o.label_smoothing, 0.0, 0.5, inclusive=(True, False))
    if isinstance(o.simpo_gamma, bool) or not isinstance(o.simpo_gamma, (int, float)) \
            or not math.isfinite(o.simpo_gamma):
        raise ValueError(f"simpo_gamma: must be a finite number, got {o.simpo_gamma!r}")
    _finite_positive("eps_low", o.eps_low)
    if "eps_low" in o.term.fields and not o.eps_low < 1:
        raise ValueError(f"eps_low: must lie in (0, 1) (the lower bound 1 − eps_low must be positive), got {o.eps_low}")
    if o.eps_high is not None:
        _finite_positive("eps_high", o.eps_high)
    if o.dual_clip is not None:
        _finite_positive("dual_clip", o.dual_clip)
        if not o.dual_clip > 1:
            raise ValueError(f"dual_clip: must be > 1, got {o.dual_clip}")
    for f in ("tau_pos", "tau_neg", "beta"):
        _finite_positive(f, getattr(o, f))
    _finite_positive("kl_coef", o.kl_coef, allow_zero=True)
    _finite_positive("std_eps", o.std_eps, allow_zero=True)
    _finite_positive("entropy_coef", o.entropy_coef, allow_zero=True)
    if o.entropy_target is not None:
        _finite_positive("entropy_target", o.entropy_target, allow_zero=True)
    _finite_positive("entropy_coef_lr", o.entropy_coef_lr)
    _finite_positive("entropy_coef_max", o.entropy_coef_max)
    if o.entropy_target is not None and o.entropy_coef > o.entropy_coef_max:
        raise ValueError(f"entropy_coef: must lie in [0, entropy_coef_max = {o.entropy_coef_max:g}] when the "
                         f"coefficient adapts, got {o.entropy_coef:g}")
    for f in ("gamma", "lam"):
        _finite_positive(f, getattr(o, f), allow_zero=True)
        _checks.check_in_range(f, getattr(o, f), 0.0, 1.0)
    if o.constant is not None:
        _finite_positive("constant", o.constant)
    if o.value_clip is not None:
        _finite_positive("value_clip", o.value_clip)
    for f in ("group_size", "critic_updates"):
        v = getattr(o, f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{f}: must be an integer >= 1, got {v!r}")
    est, term = o.estimator, o.term
    if o.group_size < est.min_group:
        raise ValueError(f"group_size: advantage {o.advantage!r} needs groups of >= {est.min_group}, "
                         f"got {o.group_size}")
    if o.dynamic_sampling and o.group_size < 2:
        raise ValueError("dynamic_sampling: needs groups (group_size >= 2)")
    if o.kl_placement == "none" and o.kl_coef != 0:
        raise ValueError("kl_coef: is nonzero but kl_placement is 'none'")
    if o.kl_placement != "none" and o.kl_coef == 0:
        raise ValueError(f"kl_coef: is 0 but kl_placement is {o.kl_placement!r} (a KL term that does nothing); "
                         "give kl_coef > 0 or kl_placement 'none'")
    if o.constant is not None and o.aggregation != "seq_sum_constant":
        raise ValueError("constant: only used with aggregation 'seq_sum_constant'")
    if est.needs_critic and not o.critic:
        raise ValueError(f"critic: advantage {o.advantage!r} needs critic=True")
    if o.critic and not est.needs_critic:
        raise ValueError(f"critic: advantage {o.advantage!r} uses no value function; a critic would train unused")
    if term.kind != "token":
        if o.kl_placement != "none":
            raise ValueError(f"kl_placement: loss {o.loss!r} ({term.kind}) takes no KL term; use 'none'")
        if o.entropy_coef:
            raise ValueError(f"entropy_coef: loss {o.loss!r} ({term.kind}) takes no entropy bonus")
        if o.entropy_target is not None:
            raise ValueError(f"entropy_target: loss {o.loss!r} ({term.kind}) takes no entropy bonus")
        if est.level != "none":
            raise ValueError(f"advantage: loss {o.loss!r} ({term.kind}) takes no advantage; use 'none'")
    elif est.level == "none":
        raise ValueError(f"advantage: loss {o.loss!r} needs an advantage estimator, got 'none'")
    if o.rollout_correction and term.kind != "token":
        raise ValueError(f"rollout_correction: loss {o.loss!r} ({term.kind}) takes no rollout correction")
    if o.rollout_correction and o.rollout_correction.mode == "decoupled" and term.ratio == "behaviour":
        raise ValueError(f"rollout_correction: loss {o.loss!r} takes its ratio against the behaviour log-probs "
                         "already; use mode 'bypass' (masks only) or no correction")
    if term.sequence_advantages and est.level == "token":
        raise ValueError(f"advantage: loss {o.loss!r} needs one advantage per response, {o.advantage!r} is per token")
    for check in (term.validate, est.validate):
        if check is not None:
            check(o)
    _finite_positive("jsd_beta", o.jsd_beta, allow_zero=True)
    _checks.check_in_range("jsd_beta", o.jsd_beta, 0.0, 1.0)
    _checks.check_choice("jsd_normalized", o.jsd_normalized, ("kl_at_ends", "normalized", "unnormalized"))
    if o.dppo_ratio_cap is not None:
        _finite_positive("dppo_ratio_cap", o.dppo_ratio_cap)
