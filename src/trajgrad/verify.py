r"""Check any loss implementation against trajgrad's reference for a recipe (spec §17, §24).

``verify(loss_fn, reference="grpo")`` runs, in float64 on several shapes with ragged masks:

==================  ==========================================================================
``value``           the loss equals the reference loss
``gradient``        d loss / d logp equals the reference gradient (§17: "matching forward values
                    is insufficient")
``ratio_one``       at current == old (ratio one before the update, §24) value and gradient match
``masked_nan``      NaN/±inf written into masked slots of every input leave loss and gradient
                    finite and unchanged
``masked_grad``     the gradient at masked positions is exactly zero (§24)
``padding``         extra all-padding rows and columns leave the loss unchanged (§24)
``zero_advantage``  all-zero advantages (a uniform group, §24) give zero gradient
``micro_batches``   summing the losses of micro-batches with a global ``denominator=`` equals the
                    full-batch loss and gradient (§13, §24); skipped when ``loss_fn`` takes no
                    ``denominator`` argument
==================  ==========================================================================

Adapter signatures (what ``loss_fn`` must accept; it may return a tensor, a ``LossResult``
or a tuple whose first element is the loss):

* policy recipes: ``loss_fn(logp, old_logp, advantages, mask[, denominator=...])`` with
  ``[B, L]`` tensors (advantages per token; constant within a response for group recipes).
  The reference is the recipe's policy term without KL (pass ``include_kl=True`` together
  with ``ref_logp`` support to include it: ``loss_fn(..., ref_logp=...)``).
* ``dpo``: ``loss_fn(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp)`` with ``[B]``.
* ``opd``: ``loss_fn(student_logits, teacher_logits, mask)`` with ``[B, L, V]`` logits.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .aggregate import Normalizer
from .objective import Objective, get_recipe


@dataclass
class Check:
    name: str
    passed: Optional[bool]  # None = skipped
    max_deviation: float = 0.0
    detail: str = ""


@dataclass
class VerifyReport:
    reference: str
    checks: List[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    def table(self) -> str:
        rows = [f"{'check':<16} {'result':<8} {'max deviation':>14}  detail"]
        for c in self.checks:
            res = "skip" if c.passed is None else ("PASS" if c.passed else "FAIL")
            rows.append(f"{c.name:<16} {res:<8} {c.max_deviation:>14.3e}  {c.detail}")
        rows.append(f"overall: {'PASS' if self.passed else 'FAIL'} (reference: {self.reference})")
        return "\n".join(rows)


def _scalar(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        t = out
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        t = out[0]
    elif hasattr(out, "loss"):
        t = out.loss
    else:
        raise ValueError(f"loss_fn: must return a tensor, a LossResult or a tuple, got {type(out).__name__}")
    if t.ndim != 0:
        raise ValueError(f"loss_fn: must return a scalar loss, got shape {tuple(t.shape)}")
    return t


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _ragged_mask(gen: torch.Generator, B: int, L: int) -> torch.Tensor:
    """Prompt zeros, one or two action turns separated by an observation span, right padding."""
    mask = torch.zeros(B, L, dtype=torch.float64)
    for b in range(B):
        start = int(torch.randint(0, max(1, L // 4), (1,), generator=gen))
        end = int(torch.randint(start + 1, L + 1, (1,), generator=gen))
        mask[b, start:end] = 1
        if end - start >= 4:
            o0 = start + (end - start) // 3
            mask[b, o0 : o0 + max(1, (end - start) // 4)] = 0
    return mask


def _policy_batch(gen: torch.Generator, B: int, L: int, recipe: Objective) -> Dict[str, torch.Tensor]:
    mask = _ragged_mask(gen, B, L)
    logp = -torch.rand(B, L, generator=gen, dtype=torch.float64) * 3 - 0.01
    term = recipe.term
    old = logp + term.verify_noise * torch.randn(B, L, generator=gen, dtype=torch.float64)
    seq_adv = torch.randn(B, generator=gen, dtype=torch.float64)
    adv = seq_adv[:, None].expand(B, L).clone()
    if not term.sequence_advantages and recipe.advantage_level == "token":
        adv = torch.randn(B, L, generator=gen, dtype=torch.float64)
    return {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask}


def _poison(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    vals = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=x.dtype)
    fill = vals[torch.arange(x.numel()).reshape(x.shape) % 3]
    return torch.where(mask.bool(), x, fill)


def _maxdev(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    d = (a - b).abs()
    if not torch.isfinite(d).all():
        return float("inf")
    return float(d.max()) if d.numel() else 0.0


def _call_policy(fn, batch, logp, **kw) -> Tuple[torch.Tensor, torch.Tensor]:
    lp = logp.detach().clone().requires_grad_(True)
    loss = _scalar(fn(lp, batch["old_logp"], batch["advantages"], batch["mask"], **kw))
    (g,) = torch.autograd.grad(loss, lp, allow_unused=True)
    if g is None:
        g = torch.zeros_like(lp)
    return loss.detach(), g


def verify(
    loss_fn: Callable,
    reference: "str | Objective" = "grpo",
    *,
    shapes: Sequence[Tuple[int, int]] = ((4, 9), (8, 24), (3, 57)),
    seed: int = 0,
    atol: float = 1e-8,
    rtol: float = 1e-6,
    **recipe_overrides: Any,
) -> VerifyReport:
    """Run the §24 battery and a randomized comparison of ``loss_fn`` against a recipe.

    Args:
      loss_fn: the implementation under test (see the module docstring for its signature).
      reference: a recipe name from :data:`trajgrad.objective.RECIPES`, or an ``Objective``
        (for example one built on a user-registered policy term).
      shapes: ``(B, L)`` shapes to test; each gets a fresh random batch with ragged masks.
      atol, rtol: tolerance of the comparisons (float64).
      recipe_overrides: fields of the reference recipe to change so that it matches the
        implementation's settings (e.g. ``eps_low=0.1``).
    Returns:
      A :class:`VerifyReport`; ``report.passed`` and ``print(report.table())``.
    """
    if isinstance(reference, Objective):
        recipe = reference.replace(**recipe_overrides) if recipe_overrides else reference
    else:
        recipe = get_recipe(reference, **recipe_overrides)
    reference = recipe.name
    if recipe.kind == "pairwise":
        return _verify_dpo(loss_fn, recipe, seed=seed, atol=atol, rtol=rtol)
    if recipe.kind == "distill":
        return _verify_opd(loss_fn, recipe, seed=seed, atol=atol, rtol=rtol)
    ref_recipe = recipe.replace(kl_coef=0.0, kl_placement="none", entropy_coef=0.0)

    def ref_fn(logp, old_logp, advantages, mask, denominator=None):
        # the adapter's second argument is the log-prob the term's ratio is taken against
        return ref_recipe.policy_loss(logp, advantages, mask, old_logp=old_logp, behaviour_logp=old_logp,
                                      denominator=denominator)

    gen = torch.Generator().manual_seed(seed)
    report = VerifyReport(reference=reference)
    devs: Dict[str, float] = {k: 0.0 for k in ("value", "gradient", "ratio_one", "masked_nan", "masked_grad", "padding",
                                                "zero_advantage", "micro_batches")}
    errors: Dict[str, str] = {}

    def tol(ref: torch.Tensor) -> float:
        return atol + rtol * (float(ref.abs().max()) if ref.numel() else 0.0)

    ok = {k: True for k in devs}
    supports_denominator = _accepts(loss_fn, "denominator")
    for B, L in shapes:
        batch = _policy_batch(gen, B, L, recipe)
        try:
            v, g = _call_policy(loss_fn, batch, batch["logp"])
        except Exception as exc:  # the implementation failed on valid input
            return VerifyReport(reference, [Check("value", False, math.inf, f"loss_fn raised {type(exc).__name__}: {exc}")])
        rv, rg = _call_policy(ref_fn, batch, batch["logp"])
        for name, a, b in (("value", v, rv), ("gradient", g, rg)):
            d = _maxdev(a, b)
            devs[name] = max(devs[name], d)
            ok[name] &= d <= tol(b)
        # ratio one
        on = dict(batch, old_logp=batch["logp"].clone())
        v1, g1 = _call_policy(loss_fn, on, on["logp"])
        rv1, rg1 = _call_policy(ref_fn, on, on["logp"])
        d = max(_maxdev(v1, rv1), _maxdev(g1, rg1))
        devs["ratio_one"] = max(devs["ratio_one"], d)
        ok["ratio_one"] &= d <= tol(rg1) + tol(rv1)
        # NaN/inf in masked slots
        m = batch["mask"]
        poisoned = {k: (_poison(x, m) if k != "mask" else x) for k, x in batch.items()}
        try:
            vp, gp = _call_policy(loss_fn, poisoned, poisoned["logp"])
            gp = torch.where(m.bool(), gp, torch.zeros_like(gp)) if torch.isfinite(gp).all() else gp
            d = max(_maxdev(vp, v), _maxdev(gp, torch.where(m.bool(), g, torch.zeros_like(g))))
        except Exception as exc:
            d, errors["masked_nan"] = math.inf, f"raised {type(exc).__name__}"
        devs["masked_nan"] = max(devs["masked_nan"], d)
        ok["masked_nan"] &= d <= tol(g)
        # masked gradient exactly zero
        d = float(g[~m.bool()].abs().max()) if (~m.bool()).any() else 0.0
        devs["masked_grad"] = max(devs["masked_grad"], d)
        ok["masked_grad"] &= d == 0.0
        # padding / repacking
        pad = {k: torch.nn.functional.pad(x, (0, 3, 0, 2), value=0.0) for k, x in batch.items()}
        perm = torch.randperm(B + 2, generator=gen)
        pad = {k: x[perm] for k, x in pad.items()}
        vpad, _ = _call_policy(loss_fn, pad, pad["logp"])
        d = _maxdev(vpad, v)
        devs["padding"] = max(devs["padding"], d)
        ok["padding"] &= d <= tol(v)
        # zero advantage
        za = dict(batch, advantages=torch.zeros_like(batch["advantages"]))
        _, gz = _call_policy(loss_fn, za, za["logp"])
        d = float(gz.abs().max())
        devs["zero_advantage"] = max(devs["zero_advantage"], d)
        ok["zero_advantage"] &= d <= atol
        # micro-batches with a global denominator
        if supports_denominator and B >= 2:
            cut = B // 2
            parts = [{k: x[:cut] for k, x in batch.items()}, {k: x[cut:] for k, x in batch.items()}]
            norm = Normalizer.from_masks([p["mask"] for p in parts], recipe.aggregation, constant=None)
            den = norm.denominator()
            c = recipe.constant if recipe.constant is not None else None
            total_v = torch.zeros((), dtype=torch.float64)
            grads = []
            for p in parts:
                kw = {"denominator": den}
                vv, gg = _call_policy(loss_fn, p, p["logp"], **kw)
                total_v = total_v + vv
                grads.append(gg)
            d = max(_maxdev(total_v, v), _maxdev(torch.cat(grads, 0), g))
            if recipe.aggregation == "seq_sum_constant" and c is None:
                # the constant defaults to the padded length, identical across the split
                pass
            devs["micro_batches"] = max(devs["micro_batches"], d)
            ok["micro_batches"] &= d <= tol(g) + tol(v)

    notes = {
        "value": "loss equals the reference",
        "gradient": "d loss / d logp equals the reference (float64)",
        "ratio_one": "at current == old",
        "masked_nan": "NaN/inf in masked slots",
        "masked_grad": "gradient exactly 0 at masked positions",
        "padding": "extra padding rows/cols + row permutation",
        "zero_advantage": "all-zero advantages give zero gradient",
        "micro_batches": "sum of micro-batch losses with a global denominator",
    }
    for name in devs:
        if name == "micro_batches" and not supports_denominator:
            report.checks.append(Check(name, None, 0.0, "skipped: loss_fn takes no denominator= argument"))
            continue
        detail = notes[name] + (f" ({errors[name]})" if name in errors else "")
        report.checks.append(Check(name, bool(ok[name]), devs[name], detail))
    return report


def _verify_dpo(loss_fn, recipe: Objective, *, seed, atol, rtol) -> VerifyReport:
    gen = torch.Generator().manual_seed(seed)
    report = VerifyReport(reference=recipe.name)
    worst_v = worst_g = 0.0
    ok_v = ok_g = True
    for B in (3, 8, 17):
        xs = [-torch.rand(B, generator=gen, dtype=torch.float64) * 20 for _ in range(4)]
        a = [x.clone().requires_grad_(True) for x in xs[:2]]
        b = [x.clone().requires_grad_(True) for x in xs[:2]]
        try:
            v = _scalar(loss_fn(a[0], a[1], xs[2], xs[3]))
            ga = torch.autograd.grad(v, a)
        except Exception as exc:
            return VerifyReport(recipe.name, [Check("value", False, math.inf, f"loss_fn raised {type(exc).__name__}: {exc}")])
        rv = recipe.dpo_loss(b[0], b[1], xs[2], xs[3]).loss
        gb = torch.autograd.grad(rv, b)
        dv, dg = _maxdev(v.detach(), rv.detach()), max(_maxdev(ga[0], gb[0]), _maxdev(ga[1], gb[1]))
        worst_v, worst_g = max(worst_v, dv), max(worst_g, dg)
        ok_v &= dv <= atol + rtol * abs(float(rv.detach()))
        ok_g &= dg <= atol + rtol * float(max(gb[0].abs().max(), gb[1].abs().max()))
    report.checks.append(Check("value", ok_v, worst_v, "loss equals the reference"))
    report.checks.append(Check("gradient", ok_g, worst_g, "gradients w.r.t. chosen/rejected log-probs"))
    x = -torch.rand(5, generator=gen, dtype=torch.float64)
    v = float(_scalar(loss_fn(x, x, x, x)))
    report.checks.append(Check("log2_at_equal", abs(v - math.log(2)) <= 1e-9, abs(v - math.log(2)),
                               "loss = log 2 when implicit margins are equal (§24)"))
    return report


def _verify_opd(loss_fn, recipe: Objective, *, seed, atol, rtol) -> VerifyReport:
    gen = torch.Generator().manual_seed(seed)
    report = VerifyReport(reference=recipe.name)
    worst = {"value": 0.0, "gradient": 0.0, "masked_nan": 0.0, "zero_identical": 0.0}
    ok = {k: True for k in worst}
    for B, L, V in ((2, 5, 7), (3, 11, 31)):
        mask = _ragged_mask(gen, B, L)
        s = torch.randn(B, L, V, generator=gen, dtype=torch.float64)
        t = torch.randn(B, L, V, generator=gen, dtype=torch.float64)
        s1 = s.clone().requires_grad_(True)
        try:
            v = _scalar(loss_fn(s1, t, mask))
            (g,) = torch.autograd.grad(v, s1)
        except Exception as exc:  # the implementation failed on valid input
            return VerifyReport(recipe.name, [Check("value", False, math.inf, f"loss_fn raised {type(exc).__name__}: {exc}")])
        s2 = s.clone().requires_grad_(True)
        rv = recipe.distill_loss(student_logits=s2, teacher_logits=t, mask=mask).loss
        (rg,) = torch.autograd.grad(rv, s2)
        for name, a, b in (("value", v.detach(), rv.detach()), ("gradient", g, rg)):
            d = _maxdev(a, b)
            worst[name] = max(worst[name], d)
            ok[name] &= d <= atol + rtol * float(b.abs().max())
        mb = mask.bool()[..., None].expand_as(s)
        s3 = torch.where(mb, s, torch.tensor(float("nan"), dtype=s.dtype)).requires_grad_(True)
        t3 = torch.where(mb, t, torch.tensor(float("inf"), dtype=s.dtype))
        try:
            v3 = _scalar(loss_fn(s3, t3, mask))
            (g3,) = torch.autograd.grad(v3, s3)
            d = max(_maxdev(v3.detach(), v.detach()), _maxdev(torch.where(mb, g3, 0.0), torch.where(mb, g, 0.0)))
        except Exception:
            d = math.inf
        worst["masked_nan"] = max(worst["masked_nan"], d)
        ok["masked_nan"] &= d <= atol + rtol * float(g.abs().max())
        z = float(_scalar(loss_fn(s, s.clone(), mask)).abs())
        worst["zero_identical"] = max(worst["zero_identical"], z)
        ok["zero_identical"] &= z <= 1e-10
    notes = {"value": "loss equals the exact reverse KL", "gradient": "d loss / d student logits",
             "masked_nan": "NaN/inf in masked slots", "zero_identical": "KL = 0 for identical distributions (§24)"}
    for k in worst:
        report.checks.append(Check(k, ok[k], worst[k], notes[k]))
    return report


def load_callable(spec: str) -> Callable:
    """Import ``"package.module:function"`` (or a file path ``path/to/file.py:function``)."""
    import importlib
    import importlib.util
    import os

    if ":" not in spec:
        raise ValueError(f"target: expected MODULE:FUNCTION, got {spec!r}")
    mod_name, attr = spec.rsplit(":", 1)
    if mod_name.endswith(".py") or os.path.sep in mod_name:
        path = os.path.abspath(mod_name)
        if not os.path.exists(path):
            raise ValueError(f"target: no such file {mod_name!r}")
        module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
    else:
        module = importlib.import_module(mod_name)
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"target: {mod_name} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"target: {spec} is not callable")
    return fn
