"""verify for preference-pair recipes (DPO, §10): value, gradient, log 2 at equal margins (§24)."""
from __future__ import annotations

import math

import torch

from ._common import Check, VerifyReport, max_deviation, _scalar

def verify_pairwise(loss_fn, recipe, *, seed, atol, rtol) -> VerifyReport:
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
        dv, dg = max_deviation(v.detach(), rv.detach()), max(max_deviation(ga[0], gb[0]), max_deviation(ga[1], gb[1]))
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
