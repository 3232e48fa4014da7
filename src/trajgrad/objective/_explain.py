r"""``explain``: the exact estimator a recipe optimizes, as text generated from its registry entries.

:func:`explain` prints every part of a recipe (advantage estimator and normalization, the
per-token term with its ratio and clipping, aggregation, KL placement and estimator, rollout
correction, critic, entropy bonus, dynamic sampling, what is detached) from the same entries
and fields :meth:`trajgrad.objective.Objective.policy_loss` computes with; :func:`explain_diff`
compares two recipes part by part; :func:`sections` gives the parts by name.
"""
from __future__ import annotations

import textwrap
from typing import Any, Dict, List, Sequence

from ._core import Objective
from ._recipes import get_recipe

_AGG_TEXT = {
    "token_mean": "Σ_i Σ_t m_it x_it / Σ_i L_i            (every token weighs the same; long responses weigh more)",
    "seq_mean_token_mean": "(1/B) Σ_i (1/L_i) Σ_t m_it x_it     (every response weighs the same; tokens of long responses weigh less)",
    "seq_mean_token_sum": "(1/B) Σ_i Σ_t m_it x_it             (sum over a response's tokens, mean over responses)",
    "seq_sum_constant": "(1/B) Σ_i Σ_t m_it x_it / C          (C constant = {C}; no per-response length normalization)",
    "token_sum": "Σ_i Σ_t m_it x_it                   (plain sum over valid tokens; no normalization)",
}


_K3 = "k3 = π_ref/π_θ − 1 − log(π_ref/π_θ)"
_KL_TEXT = {
    "k1": "k1 = log π_θ − log π_ref", "k2": "k2 = ½ (log π_θ − log π_ref)²", "k3": _K3,
    "k1+": "k1+ = k2 − sg[k2] + sg[k1]  (value k1 = log π_θ − log π_ref, gradient of k2 = ½ z²: straight-through)",
    "k3+": f"k3+ = k2 − sg[k2] + sg[k3]  (value {_K3}, gradient of k2 = ½ z²: straight-through)",
    "low_var_kl": f"clip({_K3}, −10, 10)  (verl's low_var_kl; zero gradient where clipped)",
    "low_var_kl+": f"k2 − sg[k2] + sg[clip(k3, −10, 10)]  ({_K3}; value clipped k3, gradient of k2 = ½ z²)",
}


def _kl_text(o: Objective) -> str:
    k = _KL_TEXT[o.kl_kind]
    if o.kl_placement == "none":
        return "none"
    if o.kl_placement == "reward":
        return f"in the reward: r_t ← r_t − {o.kl_coef:g} · sg[{k}]  (per token, detached)"
    if o.kl_bias_correction:
        k = (f"ρ_t · [{k}],  ρ_t = π_θ/sg[π_old] attached (bias correction: unbiased reverse-KL gradient for "
             "tokens sampled from π_old)")
    return f"in the loss: + {o.kl_coef:g} · aggregate({k})  (same aggregation and denominator as the policy term)"


_DPO_TEXT = {
    "sigmoid": "− (1 − ε) log σ(z) − ε log σ(−z)   (DPO; ε = {ls:g} label smoothing, conservative DPO when > 0)",
    "robust": "[− (1 − ε) log σ(z) + ε log σ(−z)] / (1 − 2ε),  ε = {ls:g}   (robust DPO under label noise)",
    "hinge": "max(0, 1 − z)   (SLiC hinge)",
    "ipo": "(h − 1/(2β))²,  h = z/β, per-token log-ratios when lengths are given (TRL)   (IPO)",
    "simpo": ("− (1 − ε) log σ(x) − ε log σ(−x),  x = β (log π_θ(y_w)/|y_w| − log π_θ(y_l)/|y_l|) − {g:g},  ε = {ls:g}"
              "   (SimPO: no reference model)"),
}


def _dpo_variant_text(o: Objective) -> str:
    return ("preference loss: " + o.dpo_loss_type + ",  z = β [log π_θ(y_w) − log π_ref(y_w)] − β [log π_θ(y_l) − "
            "log π_ref(y_l)]\n    loss = " + _DPO_TEXT[o.dpo_loss_type].format(ls=o.label_smoothing, g=o.simpo_gamma))


def _aggregation_text(o: Objective) -> str:
    if o.kind == "pairwise":
        return "mean over preference pairs"
    C = "the padded generation length L" if o.constant is None else f"{o.constant:g}"
    text = _AGG_TEXT.get(o.aggregation)
    line = f"loss = {text.format(C=C)}" if text else f"loss = aggregate(x, mode={o.aggregation!r})"
    return (line + "\nmasked tokens (prompt, tool observations, padding) enter neither numerator nor denominator;\n"
            "with micro-batches or ranks the denominator is the global count, summed before backward (§13)")


def _detached(o: Objective) -> List[str]:
    out = [] if o.kind == "distill" else ["advantages", "rewards"] if o.kind == "token" else []
    out += list(o.term.detached_for(o))
    if o.kl_placement != "none":
        out.append("reference log-probs")
    if o.critic:
        out.append("value targets (GAE returns)")
    if o.kind == "token" and o.rollout_correction:
        out.append("rollout-correction weights and masks")
    return list(dict.fromkeys(out))


def sections(recipe: "str | Objective", **overrides: Any) -> Dict[str, str]:
    """The parts of :func:`explain`'s text by name, always the same keys (``explain_diff`` compares them)."""
    o = _resolve(recipe, **overrides)
    s: Dict[str, str] = {
        "advantage": o.estimator.text(o),
        "per-token term (to minimize)": o.term.text(o) + ("\n" + _dpo_variant_text(o) if o.kind == "pairwise" else ""),
        "aggregation": o.aggregation + "\n" + _aggregation_text(o),
        "KL to reference": _kl_text(o),
        "critic": "none",
        "entropy bonus": "off",
        "dynamic sampling": "off",
        "sampling": f"{o.group_size} rollout(s) per prompt",
        "rollout correction": o.rollout_correction.describe() if o.kind == "token" else "off",
    }
    if o.critic:
        vc = f"clipped to ±{o.value_clip:g} around the old value" if o.value_clip is not None else "unclipped"
        s["critic"] = (f"value loss ½ (V − sg[R̂])² ({vc}), token mean, own optimizer and backward pass; "
                       f"{o.critic_updates} critic update(s) per actor update")
    if o.entropy_coef and not o.adaptive_entropy:
        s["entropy bonus"] = (f"− {o.entropy_coef:g} · aggregate(H(π_θ)),  H = exact entropy of the full sampling "
                              "distribution (same aggregation and denominator)")
    if o.adaptive_entropy and o.kind == "token":
        s["entropy bonus"] = (f"− c · aggregate(H(π_θ)),  H = exact entropy of the full sampling distribution "
                              "(same aggregation and denominator);  c = " + f"{o.entropy_coef:g} now\n"
                              f"    c adapts after every step (adaptive entropy control, Skywork-OR1): "
                              f"c ← clip(c + {o.entropy_coef_lr:g} · ({o.entropy_target:g} − H̄), 0, "
                              f"{o.entropy_coef_max:g}),\n"
                              "    H̄ = token mean of H over the step's action tokens before the step (nats/token); "
                              "c is not differentiated")
    if o.dynamic_sampling:
        s["dynamic sampling"] = ("groups whose rewards have zero variance are resampled; each discarded group and the "
                                 "tokens it cost are logged (this changes which prompts enter the update, §11)")
    s["detached (stop-gradient)"] = ", ".join(_detached(o))
    return s


def _resolve(recipe: "str | Objective", **overrides: Any) -> Objective:
    if isinstance(recipe, str):
        return get_recipe(recipe, **overrides)
    if not isinstance(recipe, Objective):
        raise ValueError(f"recipe: expected a recipe name or an Objective, got {type(recipe).__name__}")
    return recipe.replace(**overrides) if overrides else recipe


def explain(recipe: "str | Objective", *, skip: Sequence[str] = (), **overrides: Any) -> str:
    """The exact estimator a recipe optimizes, as text generated from its registry entries and fields.

    ``skip``: titles of :func:`sections` left out (printed elsewhere, e.g. per environment)."""
    o = _resolve(recipe, **overrides)
    lines = [f"recipe: {o.name}    ({o.paper})" if o.paper else f"recipe: {o.name}"]
    changed = _changed_from_named(o)
    if changed:  # the header's note describes the named recipe; say what this one changes
        lines.append(f"changed from the named recipe {o.name!r}: " + ", ".join(changed))
    for title, body in sections(o).items():
        if title in skip:
            continue
        if title in ("critic", "entropy bonus", "dynamic sampling", "rollout correction") and body in ("none", "off"):
            continue
        if title == "aggregation":
            mode, rest = body.split("\n", 1)
            lines += ["", f"aggregation: {mode}", textwrap.indent(rest, "  ")]
        elif title in ("advantage", "per-token term (to minimize)"):
            lines += ["", title + ":", textwrap.indent(body, "  ")]
        else:
            lines += ["", f"{title}: {body}"]
    return "\n".join(lines)


def _changed_from_named(o: Objective) -> List[str]:
    """``field old → new`` for each field ``o`` reads that differs from the registered recipe of its name."""
    try:
        named = get_recipe(o.name)
    except ValueError:  # not a registered name: nothing to compare with
        return []
    fa, fb, read = named.to_dict(), o.to_dict(), set(o.read_fields()) | set(named.read_fields())
    return [f"{k} {_fmt(fa[k])} → {_fmt(fb[k])}" for k in fb
            if k not in ("name", "paper") and k in read and fa.get(k) != fb[k]]


def _fmt(v: Any) -> str:
    if isinstance(v, dict):  # a nested setting (rollout_correction)
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return f"{v:g}" if isinstance(v, float) else repr(v) if isinstance(v, str) else str(v)


def explain_diff(a: "str | Objective", b: "str | Objective") -> str:
    """Two recipes term by term: the fields that differ, then each part of ``explain`` that differs.

    The parts are the advantage estimator and its normalization, the per-token term (ratio,
    clipping), the aggregation, the KL placement and estimator, the critic, the entropy bonus,
    dynamic sampling and what is detached; for each one that differs both equations are printed.
    """
    oa, ob = _resolve(a), _resolve(b)
    na, nb = oa.name, ob.name
    if na == nb:
        na, nb = f"{na} (A)", f"{nb} (B)"
    lines = [f"explain --diff: {na}  vs  {nb}", ""]
    fa, fb = oa.to_dict(), ob.to_dict()
    ra, rb = set(oa.read_fields()), set(ob.read_fields())
    changed = [k for k in fa if k not in ("name", "paper") and fa[k] != fb[k] and (k in ra or k in rb)]

    def val(k, d, read):
        return _fmt(d[k]) if k in read else "(not read)"

    if changed:
        lines.append("fields that differ:")
        w = max(len(k) for k in changed)
        lines += [f"  {k:<{w}}  {val(k, fa, ra)}  →  {val(k, fb, rb)}" for k in changed]
    else:
        lines.append("fields that differ: none (the two recipes optimize the same objective)")
    sa, sb = sections(oa), sections(ob)
    keys = list(dict.fromkeys(list(sa) + list(sb)))
    same = []
    for k in keys:
        ta, tb = sa.get(k, "(absent)"), sb.get(k, "(absent)")
        if ta == tb:
            same.append(k)
            continue
        lines += ["", k + ":", f"  {na}:", textwrap.indent(ta, "    "), f"  {nb}:", textwrap.indent(tb, "    ")]
    if same:
        lines += ["", "identical: " + ", ".join(same)]
    return "\n".join(lines)


