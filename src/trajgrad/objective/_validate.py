"""The checks of an :class:`~trajgrad.objective.Objective` that relate several fields (each error names a field).

Every field's own domain is checked by its declaration (:class:`trajgrad.registry.Param`'s
``check``, in the module that declares it); this module holds the rules between fields that keep
printed = optimized: a group size the estimator accepts, a KL coefficient exactly when a KL term
is placed, a critic only with an estimator that uses one, KL and entropy terms only for
token-level terms, an advantage estimator exactly when the term takes one, the sequence mask's
advantage level given where the advantages vary within a response, and each entry's own ``validate``.
"""
from __future__ import annotations


def validate(o) -> None:
    """Raise ``ValueError`` naming the first field of ``o`` that contradicts another."""
    est, term = o.estimator, o.term
    if o.entropy_target is not None and o.entropy_coef > o.entropy_coef_max:
        raise ValueError(f"entropy_coef: must lie in [0, entropy_coef_max = {o.entropy_coef_max:g}] when the "
                         f"coefficient adapts, got {o.entropy_coef:g}")
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
    rc = o.rollout_correction
    if rc and rc.seq_mask_delta is not None and rc.advantage_level is None and est.level == "token":
        raise ValueError(f"rollout_correction.advantage_level: the off-policy sequence mask (seq_mask_delta) is given "
                         f"per-token advantages by {o.advantage!r}, which vary within a response; give "
                         "advantage_level 'token' or 'sequence' (or 'first')")
    if term.sequence_advantages and est.level == "token":
        raise ValueError(f"advantage: loss {o.loss!r} needs one advantage per response, {o.advantage!r} is per token")
    for check in (term.validate, est.validate):
        if check is not None:
            check(o)
