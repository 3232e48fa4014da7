"""verify for distillation recipes (OPD, §14; several teachers, §15): value, gradient, masked NaN, zero KL at identity (§24).

A single-teacher recipe calls ``loss_fn(student_logits, teacher_logits, mask)``; a recipe on a term
that reads several teachers (``multi_teacher``) calls ``loss_fn(student_logits, teachers, mask,
weights)`` with ``teachers`` a list of three ``[B, L, V]`` logits and ``weights`` their ``[M, B, L]``
per-position weights (with ``teacher_zero_sum="zero"`` some valid positions' weights sum to 0).
"""
from __future__ import annotations

import math

import torch

from ._common import Check, VerifyReport, max_deviation, _ragged_mask, _scalar

NOTES = {"value": "loss equals the reference", "gradient": "d loss / d student logits",
         "masked_nan": "NaN/inf in masked slots", "zero_identical": "KL = 0 for identical distributions (§24)"}


def _inputs(gen, recipe, B, L, V, mask):
    """``(args of loss_fn without the student, the reference's keywords)`` for one random batch."""
    if "teachers" not in recipe.term.inputs:
        t = torch.randn(B, L, V, generator=gen, dtype=torch.float64)
        return (t,), {"teacher_logits": t}
    teachers = [torch.randn(B, L, V, generator=gen, dtype=torch.float64) for _ in range(3)]
    w = torch.rand(3, B, L, generator=gen, dtype=torch.float64)
    w[1] = torch.where(torch.rand(B, L, generator=gen) < 0.4, 0.0, w[1])  # a teacher off at some positions
    if recipe.teacher_zero_sum == "zero":
        w[:, torch.rand(B, L, generator=gen) < 0.3] = 0.0  # positions whose weights sum to 0
    return (teachers, w), {"teachers": teachers, "weights": w}


def _poisoned(args, mask):
    mb = mask.bool()
    if len(args) == 1:
        return (torch.where(mb[..., None], args[0], math.inf),)
    teachers, w = args
    return [torch.where(mb[..., None], t, v) for t, v in zip(teachers, (math.inf, -math.inf, math.nan))], \
        torch.where(mb, w, math.nan)


def _identical(args, s):
    return (s.clone(),) if len(args) == 1 else ([s.clone() for _ in args[0]], args[1])


def verify_distill(loss_fn, recipe, *, seed, atol, rtol) -> VerifyReport:
    gen = torch.Generator().manual_seed(seed)
    report = VerifyReport(reference=recipe.name)
    worst = {k: 0.0 for k in NOTES}
    ok = {k: True for k in NOTES}
    for B, L, V in ((2, 5, 7), (3, 11, 31)):
        mask = _ragged_mask(gen, B, L)
        s = torch.randn(B, L, V, generator=gen, dtype=torch.float64)
        args, ref_kw = _inputs(gen, recipe, B, L, V, mask)
        s1 = s.clone().requires_grad_(True)
        try:
            v = _scalar(loss_fn(s1, args[0], mask, *args[1:]))
            (g,) = torch.autograd.grad(v, s1)
        except Exception as exc:  # the implementation failed on valid input
            return VerifyReport(recipe.name, [Check("value", False, math.inf, f"loss_fn raised {type(exc).__name__}: {exc}")])
        s2 = s.clone().requires_grad_(True)
        rv = recipe.distill_loss(student_logits=s2, mask=mask, **ref_kw).loss
        (rg,) = torch.autograd.grad(rv, s2)
        for name, a, b in (("value", v.detach(), rv.detach()), ("gradient", g, rg)):
            d = max_deviation(a, b)
            worst[name] = max(worst[name], d)
            ok[name] &= d <= atol + rtol * float(b.abs().max())
        mb = mask.bool()[..., None].expand_as(s)
        s3 = torch.where(mb, s, torch.tensor(float("nan"), dtype=s.dtype)).requires_grad_(True)
        bad = _poisoned(args, mask)
        try:
            v3 = _scalar(loss_fn(s3, bad[0], mask, *bad[1:]))
            (g3,) = torch.autograd.grad(v3, s3)
            d = max(max_deviation(v3.detach(), v.detach()),
                    max_deviation(torch.where(mb, g3, 0.0), torch.where(mb, g, 0.0)))
        except Exception:
            d = math.inf
        worst["masked_nan"] = max(worst["masked_nan"], d)
        ok["masked_nan"] &= d <= atol + rtol * float(g.abs().max())
        same = _identical(args, s)
        z = float(_scalar(loss_fn(s, same[0], mask, *same[1:])).abs())
        worst["zero_identical"] = max(worst["zero_identical"], z)
        ok["zero_identical"] &= z <= 1e-10
    for k in worst:
        report.checks.append(Check(k, ok[k], worst[k], NOTES[k]))
    return report
