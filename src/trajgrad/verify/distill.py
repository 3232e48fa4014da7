"""verify for distillation recipes (OPD, §14): value, gradient, masked NaN, zero KL at identity (§24)."""
from __future__ import annotations

import math

import torch

from ._common import Check, VerifyReport, max_deviation, _ragged_mask, _scalar

def verify_distill(loss_fn, recipe, *, seed, atol, rtol) -> VerifyReport:
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
            d = max_deviation(a, b)
            worst[name] = max(worst[name], d)
            ok[name] &= d <= atol + rtol * float(b.abs().max())
        mb = mask.bool()[..., None].expand_as(s)
        s3 = torch.where(mb, s, torch.tensor(float("nan"), dtype=s.dtype)).requires_grad_(True)
        t3 = torch.where(mb, t, torch.tensor(float("inf"), dtype=s.dtype))
        try:
            v3 = _scalar(loss_fn(s3, t3, mask))
            (g3,) = torch.autograd.grad(v3, s3)
            d = max(max_deviation(v3.detach(), v.detach()),
                    max_deviation(torch.where(mb, g3, 0.0), torch.where(mb, g, 0.0)))
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
