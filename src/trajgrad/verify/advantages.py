r"""verify for advantage functions against a recipe's advantage estimator (§5, §6, §11, §12).

``verify(fn, reference, part="advantages")``. A per-response estimator (GRPO's, MaxRL's,
REINFORCE++'s, ...) calls ``fn(rewards)`` with ``[N, G]`` float64 rewards (``N`` groups of the
recipe's ``group_size``); a per-token one (GAE with its whitening) calls ``fn(values, rewards,
mask)`` with ``[B, L]`` tensors (the end of each row is the end of its episode). ``fn`` returns
the advantages or an object with ``.advantages``. Tolerance ``1e-12 + 1e-10 · max|A|`` (an
:math:`\epsilon` of ``1e-8`` under the square root or beside the std tells apart). Compared with the recipe's
:meth:`~trajgrad.objective.Objective.sequence_advantages` / ``token_advantages``:

==================  ==============================================================================
``value``           random batches (0/1 rewards with a one-success group, and rewards in [0, 1]: pass rates)
``uniform_groups``  groups whose rewards are all equal (zero variance; all zero, all one)
``single``          one response (per token: a batch with no valid token); where the estimator
                    refuses it (``ValueError``), ``fn`` must raise too
``permutation``     per response: permuting the groups permutes the advantages; per token:
                    NaN/inf in masked slots change no valid advantage
==================  ==============================================================================
"""
from __future__ import annotations

import math
from typing import Callable, Dict

import torch

from ._common import Check, VerifyReport, _poison, _ragged_mask, max_deviation

F64 = torch.float64
NOTES = {"value": "advantages equal the recipe's estimator", "uniform_groups": "zero-variance groups",
         "single": "one response / no valid token (an error where the estimator refuses it)",
         "permutation": "groups permuted: advantages permuted (per token: masked NaN/inf change nothing)"}


def _adv(out) -> torch.Tensor:
    t = getattr(out, "advantages", out)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"fn: must return the advantages (a tensor or an object with .advantages), got "
                         f"{type(out).__name__}")
    return t


def verify_advantages(fn: Callable, recipe, *, seed: int = 0, atol: float = 1e-12, rtol: float = 1e-10) -> VerifyReport:
    """The battery above; ``ValueError`` naming ``reference`` for a recipe without an advantage estimator."""
    level = recipe.advantage_level
    if level == "none":
        raise ValueError(f"reference: recipe {recipe.name!r} has no advantage estimator (advantage 'none')")
    gen = torch.Generator().manual_seed(seed)
    dev: Dict[str, float] = {k: 0.0 for k in NOTES}
    ok: Dict[str, bool] = {k: True for k in NOTES}
    detail: Dict[str, str] = {}

    def compare(name, got_thunk, ref_thunk, where=None):
        try:
            want = ref_thunk()
        except ValueError as exc:  # the estimator refuses this input: so must fn
            try:
                got_thunk()
            except Exception:
                return
            ok[name] = False
            dev[name] = math.inf
            detail.setdefault(name, f"the estimator refuses it ({exc}); fn returned a value")
            return
        try:
            got = got_thunk()
        except Exception as exc:
            ok[name], dev[name] = False, math.inf
            detail.setdefault(name, f"fn raised {type(exc).__name__}: {exc}")
            return
        if where is not None:
            got, want = torch.where(where, got, 0.0), torch.where(where, want, 0.0)
        d = max_deviation(got.to(F64), want.to(F64))
        dev[name] = max(dev[name], d)
        ok[name] &= d <= atol + rtol * (float(want.abs().max()) if want.numel() else 0.0)

    if level == "sequence":
        G = recipe.group_size
        ref = lambda r: recipe.sequence_advantages(r).advantages  # noqa: E731
        for N in (6, 5):
            r = (torch.rand(N, G, generator=gen) < 0.4).to(F64) if N == 6 else torch.rand(N, G, generator=gen, dtype=F64)
            if N == 6 and G > 1:  # a group with one success: the smallest positive mean, 1/G
                r[0] = 0.0
                r[0, 0] = 1.0
            compare("value", lambda: _adv(fn(r.clone())), lambda: ref(r))
            perm = torch.randperm(N, generator=gen)
            compare("permutation", lambda: _adv(fn(r[perm].clone())), lambda: _adv(fn(r.clone()))[perm])
        for fill in (0.0, 1.0):
            u = torch.full((4, G), fill, dtype=F64)
            u[0] = 1.0 - fill
            compare("uniform_groups", lambda: _adv(fn(u.clone())), lambda: ref(u))
        one = torch.ones(1, G, dtype=F64)
        compare("single", lambda: _adv(fn(one.clone())), lambda: ref(one))
    else:
        ref = lambda v, r, m: recipe.token_advantages(v, r, m, bootstrap_value=0.0).advantages  # noqa: E731
        for B, L in ((4, 9), (3, 17)):
            m = _ragged_mask(gen, B, L).bool()
            v = torch.randn(B, L, generator=gen, dtype=F64)
            r = torch.where(torch.rand(B, L, generator=gen) < 0.3, torch.randn(B, L, generator=gen, dtype=F64), 0.0)
            compare("value", lambda: _adv(fn(v, r, m)), lambda: ref(v, r, m), m)
            compare("permutation", lambda: _adv(fn(_poison(v, m), _poison(r, m), m)), lambda: ref(v, r, m), m)
            u = torch.where(m, 1.0, 0.0).to(F64)
            compare("uniform_groups", lambda: _adv(fn(u, u, m)), lambda: ref(u, u, m), m)
        empty = torch.zeros(2, 5, dtype=torch.bool)
        z = torch.zeros(2, 5, dtype=F64)
        compare("single", lambda: _adv(fn(z, z, empty)), lambda: ref(z, z, empty))
    report = VerifyReport(reference=recipe.name)
    for k in NOTES:
        report.checks.append(Check(k, ok[k], dev[k], NOTES[k] + (f" ({detail[k]})" if k in detail else "")))
    return report
