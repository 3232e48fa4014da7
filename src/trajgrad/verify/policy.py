r"""The §24 battery for token-level policy losses, against a recipe's registry entry.

``loss_fn(logp, old_logp, advantages, mask[, denominator=...][, ref_logp=...])`` with ``[B, L]``
tensors (``old_logp`` is the log-prob the recipe's ratio is taken against: old, or behaviour
for SAO). A term that reads cost advantages (the Lagrangian, §22) gets ``cost_advantages=``; a
recipe with a decoupled rollout correction gets ``behaviour_logp=`` (the sampler's log-probs,
apart from ``old_logp``) when ``loss_fn`` accepts it, else the correction sees
``behaviour_logp = old_logp``. Each check runs in float64 on several shapes with ragged masks (prompt zeros, an
observation span, right padding):

==================  ==========================================================================
``value``           the loss equals the reference loss
``gradient``        d loss / d logp equals the reference gradient (§17)
``ratio_one``       at current == old (ratio one before the update, §24) value and gradient match
``masked_nan``      NaN/±inf in masked slots of every input leave loss and gradient unchanged
``masked_grad``     the gradient at masked positions is exactly zero (§24)
``padding``         extra all-padding rows and columns (and a row permutation) change nothing
``zero_advantage``  all-zero advantages give zero gradient (a uniform group, §24); with the KL
                    term included, only the KL term's gradient
``off_policy``      far off-policy batches (log-ratio std 1.5: ratios from ~0.01 to ~100), where
                    dual clips, trust-interval bounds and clamps act
``long_sequence``   4,096-token responses whose log-ratios sum past float64's exp range: loss
                    and gradient stay finite and equal to the reference (a sequence weight
                    formed as exp(Σ) overflows)
``zero_rows``       only for a recipe whose term declares ``zero_without_advantage`` (the trainer
                    then runs such rows forward only): rows with zero advantages get exactly zero
                    gradient, and with ``denominator=`` the other rows alone give the same loss
                    and gradient
``micro_batches``   with ``denominator=``: micro-batch losses with a global denominator sum to
                    the full-batch loss and gradient (§13)
``ranks_average``   without ``denominator=``: what data-parallel training computes, the mean
                    over two ranks with unequal shards of each rank's loss and gradient, equals
                    the full batch (fails for a loss normalized per rank, §13)
==================  ==========================================================================
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from ..aggregate import Normalizer
from ._common import Check, VerifyReport, _accepts, max_deviation, _poison, _ragged_mask, _scalar

F64 = torch.float64
NOTES = {
    "value": "loss equals the reference",
    "gradient": "d loss / d logp equals the reference (float64)",
    "ratio_one": "at current == old",
    "masked_nan": "NaN/inf in masked slots",
    "masked_grad": "gradient exactly 0 at masked positions",
    "padding": "extra padding rows/cols + row permutation",
    "zero_advantage": "all-zero advantages give zero gradient",
    "off_policy": "far off-policy batch (log-ratio std 1.5)",
    "long_sequence": "4,096-token responses, log-ratio sums beyond exp's range",
    "zero_rows": "rows with zero advantages: zero gradient; the other rows alone give the same loss and gradient",
    "micro_batches": "sum of micro-batch losses with a global denominator",
    "ranks_average": "mean over 2 unequal ranks of per-rank losses (no denominator=: normalized per rank)",
}


def _extras(recipe, loss_fn) -> Tuple[str, ...]:
    """The inputs beyond ``logp, old_logp, advantages, mask`` that the battery hands to ``loss_fn``."""
    out = tuple(recipe.term.inputs)
    rc = recipe.rollout_correction
    if rc and rc.mode == "decoupled" and _accepts(loss_fn, "behaviour_logp"):
        out += ("behaviour_logp",)
    return out


def _add_extras(gen: torch.Generator, out: Dict[str, torch.Tensor], extras) -> Dict[str, torch.Tensor]:
    shape = out["logp"].shape
    if "cost_advantages" in extras:
        out["cost_advantages"] = torch.rand(shape, generator=gen, dtype=F64)
    if "behaviour_logp" in extras:
        noise = 0.3 * torch.randn(shape, generator=gen, dtype=F64)
        out["behaviour_logp"] = (out["old_logp"] + noise).clamp(max=-1e-6)
    return out


def _batch(gen: torch.Generator, B: int, L: int, recipe, include_kl: bool, extras=()) -> Dict[str, torch.Tensor]:
    mask = _ragged_mask(gen, B, L)
    logp = -torch.rand(B, L, generator=gen, dtype=F64) * 3 - 0.01
    # log-probs stay log-probabilities (≤ 0): terms of the probabilities themselves (DPPO) need it
    old = (logp + recipe.term.verify_noise * torch.randn(B, L, generator=gen, dtype=F64)).clamp(max=-1e-6)
    adv = torch.randn(B, generator=gen, dtype=F64)[:, None].expand(B, L).clone()
    if not recipe.term.sequence_advantages and recipe.advantage_level == "token":
        adv = torch.randn(B, L, generator=gen, dtype=F64)
    out = {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask}
    if include_kl:
        out["ref_logp"] = logp + 0.3 * torch.randn(B, L, generator=gen, dtype=F64)
    return _add_extras(gen, out, extras)


def _long_batch(gen: torch.Generator, recipe, include_kl: bool, extras=()) -> Dict[str, torch.Tensor]:
    B, L = 3, 4096
    mask = torch.zeros(B, L, dtype=F64)
    mask[:, 16:] = 1
    mask[1, 2000:2100] = 0  # an observation span
    mask[2, 3500:] = 0      # a shorter response
    logp = -torch.rand(B, L, generator=gen, dtype=F64) * 2 - 0.5
    drift = 0.25 + 0.05 * torch.randn(B, L, generator=gen, dtype=F64)  # Σ over ~4,000 tokens ≈ 1,000 > 709
    out = {"logp": logp, "old_logp": logp - drift, "mask": mask,
           "advantages": torch.tensor([1.0, -0.5, 0.7], dtype=F64)[:, None].expand(B, L).clone()}
    if include_kl:
        out["ref_logp"] = logp - 0.1
    return _add_extras(gen, out, extras)


_KEYWORD_INPUTS = ("ref_logp", "cost_advantages", "behaviour_logp")


def _call(fn, batch, **kw) -> Tuple[torch.Tensor, torch.Tensor]:
    lp = batch["logp"].detach().clone().requires_grad_(True)
    kw.update({k: batch[k] for k in _KEYWORD_INPUTS if k in batch})
    loss = _scalar(fn(lp, batch["old_logp"], batch["advantages"], batch["mask"], **kw))
    (g,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return loss.detach(), torch.zeros_like(lp) if g is None else g


def verify_policy(
    loss_fn: Callable,
    recipe,
    *,
    shapes: Sequence[Tuple[int, int]] = ((4, 9), (8, 24), (3, 57)),
    seed: int = 0,
    atol: float = 1e-8,
    rtol: float = 1e-6,
    include_kl: bool = False,
    reference_fn: Optional[Callable] = None,
) -> VerifyReport:
    """The battery above; the reference is the recipe's policy term (plus its KL term with ``include_kl``).

    ``reference_fn`` (same signature as ``loss_fn``) replaces the recipe's loss as the reference:
    for comparing with trajgrad called with extra arguments (a peer's denominator convention).
    """
    ref_recipe = recipe if include_kl else recipe.replace(kl_coef=0.0, kl_placement="none")
    ref_recipe = ref_recipe.replace(entropy_coef=0.0)
    if include_kl and recipe.kl_placement != "loss":
        raise ValueError(f"include_kl: recipe {recipe.name!r} has no KL term in the loss (kl_placement="
                         f"{recipe.kl_placement!r}); give one, e.g. --set kl_placement=loss --set kl_coef=0.04")

    def ref_fn(logp, old_logp, advantages, mask, denominator=None, **inputs):
        if reference_fn is not None:
            kw = {} if denominator is None else {"denominator": denominator}
            return reference_fn(logp, old_logp, advantages, mask, **kw, **inputs)
        beh = inputs.pop("behaviour_logp", old_logp)
        return ref_recipe.policy_loss(logp, advantages, mask, old_logp=old_logp, behaviour_logp=beh,
                                      denominator=denominator, **inputs)

    gen = torch.Generator().manual_seed(seed)
    extras = _extras(recipe, loss_fn)
    has_den = _accepts(loss_fn, "denominator")
    dist_check = "micro_batches" if has_den else "ranks_average"
    names = ["value", "gradient", "ratio_one", "masked_nan", "masked_grad", "padding", "zero_advantage",
             "off_policy", "long_sequence", dist_check]
    if recipe.zero_without_advantage:
        names.append("zero_rows")
    dev: Dict[str, float] = {k: 0.0 for k in names}
    ok: Dict[str, bool] = {k: True for k in names}
    errors: Dict[str, str] = {}

    def tol(ref: torch.Tensor) -> float:
        return atol + rtol * (float(ref.abs().max()) if ref.numel() else 0.0)

    def record(name: str, d: float, limit: float) -> None:
        dev[name] = max(dev[name], d)
        ok[name] &= d <= limit

    def attempt(name: str, thunk):
        try:
            return thunk()
        except Exception as exc:  # the implementation failed on valid input
            errors[name] = f"raised {type(exc).__name__}: {exc}"
            record(name, math.inf, 0.0)
            return None

    for B, L in shapes:
        batch = _batch(gen, B, L, recipe, include_kl, extras)
        got = attempt("value", lambda: _call(loss_fn, batch))
        if got is None:
            return VerifyReport(recipe.name, [Check("value", False, math.inf, f"loss_fn {errors['value']}")])
        v, g = got
        rv, rg = _call(ref_fn, batch)
        record("value", max_deviation(v, rv), tol(rv))
        record("gradient", max_deviation(g, rg), tol(rg))
        on = dict(batch, old_logp=batch["logp"].clone())
        got = attempt("ratio_one", lambda: _call(loss_fn, on))
        if got is not None:
            rv1, rg1 = _call(ref_fn, on)
            record("ratio_one", max(max_deviation(got[0], rv1), max_deviation(got[1], rg1)), tol(rg1) + tol(rv1))
        m = batch["mask"].bool()
        poisoned = {k: (_poison(x, batch["mask"]) if k != "mask" else x) for k, x in batch.items()}
        got = attempt("masked_nan", lambda: _call(loss_fn, poisoned))
        if got is not None:
            vp, gp = got
            gp = torch.where(m, gp, 0.0) if torch.isfinite(gp).all() else gp
            record("masked_nan", max(max_deviation(vp, v), max_deviation(gp, torch.where(m, g, 0.0))), tol(g))
        record("masked_grad", float(g[~m].abs().max()) if (~m).any() else 0.0, 0.0)
        pad = {k: torch.nn.functional.pad(x, (0, 3, 0, 2), value=0.0) for k, x in batch.items()}
        perm = torch.randperm(B + 2, generator=gen)
        got = attempt("padding", lambda: _call(loss_fn, {k: x[perm] for k, x in pad.items()}))
        if got is not None:
            record("padding", max_deviation(got[0], v), tol(v))
        zero_adv = dict(batch, advantages=torch.zeros_like(batch["advantages"]))
        if "cost_advantages" in batch:
            zero_adv["cost_advantages"] = torch.zeros_like(batch["cost_advantages"])
        got = attempt("zero_advantage", lambda: _call(loss_fn, zero_adv))
        if got is not None:  # zero without a KL term; the KL term's gradient alone with it
            record("zero_advantage", max_deviation(got[1], _call(ref_fn, zero_adv)[1]), atol)
        if B >= 2:
            cut = max(1, B // 3)
            parts = [{k: x[:cut] for k, x in batch.items()}, {k: x[cut:] for k, x in batch.items()}]
            if has_den:
                den = Normalizer.from_masks([p["mask"] for p in parts], recipe.aggregation, constant=None).denominator()
                outs = attempt(dist_check, lambda: [_call(loss_fn, p, denominator=den) for p in parts])
                scale = 1.0
            else:
                outs = attempt(dist_check, lambda: [_call(loss_fn, p) for p in parts])
                scale = 1.0 / len(parts)  # data parallelism averages the ranks' losses and gradients
            if outs is not None:
                total = sum(o[0] for o in outs) * scale
                grads = torch.cat([o[1] for o in outs], 0) * scale
                record(dist_check, max(max_deviation(total, v), max_deviation(grads, g)), tol(g) + tol(v))
        if B >= 2 and "zero_rows" in names:
            _zero_rows_check(loss_fn, recipe, batch, has_den, attempt, record, tol)
    far = _batch(gen, 6, 40, recipe, include_kl, extras)
    far["old_logp"] = (far["logp"] + 1.5 * torch.randn(far["logp"].shape, generator=gen, dtype=F64)).clamp(max=-1e-6)
    got = attempt("off_policy", lambda: _call(loss_fn, far))
    if got is not None:
        rvf, rgf = _call(ref_fn, far)
        record("off_policy", max(max_deviation(got[0], rvf), max_deviation(got[1], rgf)), tol(rgf) + tol(rvf))
    long = _long_batch(gen, recipe, include_kl, extras)
    got = attempt("long_sequence", lambda: _call(loss_fn, long))
    if got is not None:
        rvl, rgl = _call(ref_fn, long)
        vl, gl = got
        finite = bool(torch.isfinite(vl)) and bool(torch.isfinite(gl).all())
        worst = max(max_deviation(vl, rvl), max_deviation(gl, rgl)) if finite else math.inf
        record("long_sequence", worst, tol(rgl) + tol(rvl))
        if not finite:
            errors["long_sequence"] = "non-finite loss or gradient"

    report = VerifyReport(reference=recipe.name)
    for name in names:
        detail = NOTES[name] + (f" ({errors[name]})" if name in errors else "")
        report.checks.append(Check(name, bool(ok[name]), dev[name], detail))
    return report


def _zero_rows_check(loss_fn, recipe, batch, has_den, attempt, record, tol) -> None:
    """Every other row's advantages set to zero (at least one row keeps its own)."""
    B = batch["mask"].shape[0]
    still = torch.arange(B) % 2 == 0
    adv = batch["advantages"].clone()
    adv[still] = 0.0
    zb = dict(batch, advantages=adv)
    kw = {}
    if has_den:
        kw["denominator"] = Normalizer.from_masks([batch["mask"]], recipe.aggregation, constant=None).denominator()
    full = attempt("zero_rows", lambda: _call(loss_fn, zb, **kw))
    if full is None:
        return
    v, g = full
    d = float(g[still].abs().max())
    if has_den:
        part = attempt("zero_rows", lambda: _call(loss_fn, {k: x[~still] for k, x in zb.items()}, **kw))
        if part is None:
            return
        d = max(d, max_deviation(part[0], v), max_deviation(part[1], g[~still]))
    record("zero_rows", d, tol(g) + tol(v))


def call_kwargs(include_kl: bool) -> Dict[str, Any]:  # pragma: no cover - documentation helper
    """The keywords a policy adapter receives."""
    return {"denominator": "optional", **({"ref_logp": "[B, L]"} if include_kl else {})}
