r"""verify for token log-probability functions under a sampling transform (§4, §7).

``fn(logits, targets, *, temperature=1.0, top_k=None, top_p=None) -> [B, L]`` is compared with
:func:`trajgrad.logprobs.token_logprobs` — the log-probability under the distribution that
actually samples: logits divided by the temperature, restricted to the top-k / top-p support
and *renormalized* over it — for several settings:

==============  ==============================================================================
``value``       equal log-probs (−inf at the same out-of-support targets)
``gradient``    d Σ logp / d logits equal (finite targets)
``normalized``  Σ_v exp(fn(·, v)) = 1 at every position (a top-p log-prob taken from the full
                softmax without renormalization fails here: its mass is the kept mass p' < 1)
==============  ==============================================================================
"""
from __future__ import annotations

import math
from typing import Callable, Dict

import torch

from ..logprobs import token_logprobs
from ._common import Check, VerifyReport

SETTINGS = ((1.0, None, None), (0.7, None, None), (1.0, 5, None), (1.0, None, 0.9), (0.8, 8, 0.75))


def _finite_maxdev(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        return math.inf
    d = (a[fa] - b[fb]).abs()
    return float(d.max()) if d.numel() else 0.0


def verify_logprobs(fn: Callable, *, seed: int = 0, atol: float = 1e-9, rtol: float = 1e-7) -> VerifyReport:
    gen = torch.Generator().manual_seed(seed)
    B, L, V = 3, 6, 17
    dev: Dict[str, float] = {"value": 0.0, "gradient": 0.0, "normalized": 0.0}
    ok = {k: True for k in dev}
    detail: Dict[str, str] = {}
    for T, k, p in SETTINGS:
        logits = torch.randn(B, L, V, generator=gen, dtype=torch.float64) * 2
        targets = torch.randint(0, V, (B, L), generator=gen)
        kw = dict(temperature=T, top_k=k, top_p=p)
        z1 = logits.clone().requires_grad_(True)
        try:
            got = fn(z1, targets, **kw)
        except Exception as exc:
            return VerifyReport("logprobs", [Check("value", False, math.inf, f"fn raised {type(exc).__name__}: {exc}")])
        want = token_logprobs(logits, targets, **kw)
        d = _finite_maxdev(got.detach(), want)
        dev["value"] = max(dev["value"], d)
        if not d <= atol + rtol * float(want[torch.isfinite(want)].abs().max()):
            ok["value"] = False
            detail.setdefault("value", f"T={T}, top_k={k}, top_p={p}")
        fin = torch.isfinite(want)
        z2 = logits.clone().requires_grad_(True)
        (g_want,) = torch.autograd.grad(torch.where(fin, token_logprobs(z2, targets, **kw), 0.0).sum(), z2)
        if torch.isfinite(got).any() and got.requires_grad:
            (g_got,) = torch.autograd.grad(torch.where(fin, got, 0.0).sum(), z1, allow_unused=True)
            g_got = torch.zeros_like(z1) if g_got is None else g_got
        else:
            g_got = torch.zeros_like(z1)
        d = float((g_got - g_want).abs().max())
        dev["gradient"] = max(dev["gradient"], d)
        ok["gradient"] &= d <= atol + rtol * float(g_want.abs().max())
        # Σ_v exp(logp(v)) over the vocabulary, at every position
        every = torch.arange(V).repeat(B * L)
        flat = logits.reshape(B * L, 1, V).expand(B * L, V, V).reshape(B * L * V, 1, V)
        with torch.no_grad():
            mass = fn(flat, every.reshape(-1, 1), **kw).reshape(B * L, V).exp().sum(-1)
        d = float((mass - 1).abs().max())
        dev["normalized"] = max(dev["normalized"], d)
        if not d <= 1e-9:
            ok["normalized"] = False
            detail.setdefault("normalized", f"mass {float(mass.min()):.4f} at T={T}, top_k={k}, top_p={p}")
    notes = {"value": "log-probs equal token_logprobs", "gradient": "d Σ logp / d logits",
             "normalized": "Σ_v exp(logp(v)) = 1 under the sampling transform"}
    report = VerifyReport("logprobs")
    for name in dev:
        extra = f" (first failure: {detail[name]})" if name in detail else ""
        report.checks.append(Check(name, ok[name], dev[name], notes[name] + extra))
    return report
