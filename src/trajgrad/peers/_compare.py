"""The comparisons behind the peer cases: policy losses (verify's battery), advantages, KL estimators."""
from __future__ import annotations

import math

import torch

from ..verify import VerifyReport, verify
from ..verify._common import Check, _maxdev

F64 = torch.float64


def policy(fn, recipe, case, *, seed: int) -> VerifyReport:
    reference_fn = None
    if case.denominator == "rows":
        def reference_fn(logp, old_logp, advantages, mask, ref_logp=None):
            """trajgrad's loss averaged over every row, empty rows included (denominator = B)."""
            rows = torch.tensor(float(logp.shape[0]), dtype=logp.dtype)
            return recipe.policy_loss(logp, advantages, mask, old_logp=old_logp, behaviour_logp=old_logp,
                                      ref_logp=ref_logp, denominator=rows)
    return verify(fn, recipe, seed=seed, include_kl=case.include_kl, reference_fn=reference_fn)


def _groups(gen, G: int, N: int):
    rewards = torch.randint(0, 3, (N, G), generator=gen).to(F64) + 0.25 * torch.randn(N, G, generator=gen, dtype=F64)
    rewards[0] = 1.0  # a zero-variance group
    gids = torch.arange(N)[:, None].expand(N, G).reshape(-1)
    return rewards.reshape(-1), gids


def _lengths(gen, shape, ragged: bool) -> torch.Tensor:
    return torch.randint(1, 9, shape, generator=gen) if ragged else torch.full(shape, 4, dtype=torch.long)


def advantage(fn, recipe, case, *, seed: int) -> VerifyReport:
    """Per-response advantages on random groups (G = 2, 4, 8, a zero-variance group in each): equal values
    when every response has 4 tokens (``value``) and when lengths are ragged, 1 to 8 tokens
    (``ragged_lengths``: a peer that normalizes over tokens weighs each response by its length).
    ``fn(rewards, group_ids, lengths)``; trajgrad's side is the recipe's estimator, or ``case.ours``."""
    gen = torch.Generator().manual_seed(seed)

    def ours(r, gids, lengths):
        if case.ours is not None:
            return torch.as_tensor(case.ours(r, gids, lengths), dtype=F64)
        return recipe.sequence_advantages(r, group_ids=gids).advantages.to(F64)

    worst = ragged = zv = zv_ours = 0.0
    for G in (2, 4, 8):
        r, gids = _groups(gen, G, 5)
        for is_ragged in (False, True):
            lengths = _lengths(gen, r.shape, is_ragged)
            got = torch.as_tensor(fn(r, gids, lengths), dtype=F64)
            want = ours(r, gids, lengths)
            d = _maxdev(got, want)
            if is_ragged:
                ragged = max(ragged, d)
            else:
                worst = max(worst, d)
                zv, zv_ours = max(zv, float(got[:G].abs().max())), max(zv_ours, float(want[:G].abs().max()))
    if not (math.isfinite(worst) and math.isfinite(ragged)):
        return VerifyReport(recipe.name, [Check("value", False, math.inf, "non-finite")])
    return VerifyReport(recipe.name, [
        Check("value", worst <= case.tol, worst, "advantages equal trajgrad's estimator (G = 2, 4, 8; equal lengths)"),
        Check("ragged_lengths", ragged <= case.tol, ragged, "also with responses of 1 to 8 tokens"),
        Check("zero_variance", zv <= case.tol or zv_ours > case.tol, zv,
              "a zero-variance group gets advantage 0 (where trajgrad's estimator gives it 0)"),
    ])


def kl(fn, recipe, *, seed: int) -> VerifyReport:
    """Per-token KL estimate: value and gradient on moderate gaps, and on gaps of ±15 nats where clamps act."""
    gen = torch.Generator().manual_seed(seed)
    checks = []
    for name, scale in (("value", 0.5), ("off_policy", 15.0)):
        logp = (-torch.rand(6, 20, generator=gen, dtype=F64) * 3).requires_grad_(True)
        ref = logp.detach() + scale * torch.randn(6, 20, generator=gen, dtype=F64)
        mask = torch.ones(6, 20, dtype=torch.bool)
        got = fn(logp, ref)
        (g_got,) = torch.autograd.grad(got.sum(), logp)
        lp2 = logp.detach().clone().requires_grad_(True)
        want = recipe.kl_per_token(lp2, ref, mask)
        (g_want,) = torch.autograd.grad(want.sum(), lp2)
        d = max(_maxdev(got.detach(), want.detach()), _maxdev(g_got, g_want))
        checks.append(Check(name, d <= 1e-9 * max(1.0, float(want.detach().abs().max())), d,
                            f"value and gradient, log-ratio std {scale:g}"))
    return VerifyReport(recipe.name, checks)


def gae(fn, recipe, *, seed: int) -> VerifyReport:
    """Token-level advantages and returns from a critic: equal at every action token (observation spans
    inside the response, rows of different lengths; terminated rows bootstrap 0)."""
    gen = torch.Generator().manual_seed(seed)
    worst_a = worst_r = 0.0
    for B, L in ((4, 12), (6, 30)):
        mask = torch.zeros(B, L, dtype=torch.bool)
        for b in range(B):
            end = int(torch.randint(L // 2, L + 1, (1,), generator=gen))
            mask[b, :end] = True
            if end > 6:
                mask[b, 2:4] = False  # a tool observation
        values = torch.randn(B, L, generator=gen, dtype=F64)
        rewards = torch.where(mask & (torch.rand(B, L, generator=gen) > 0.7), torch.randn(B, L, generator=gen, dtype=F64), 0.0)
        adv, ret = fn(values, rewards, mask)
        ours = recipe.token_advantages(values, rewards, mask, bootstrap_value=0.0)
        worst_a = max(worst_a, _maxdev(adv[mask], ours.advantages[mask]))
        worst_r = max(worst_r, _maxdev(ret[mask], ours.returns[mask]))
    return VerifyReport(recipe.name, [Check("value", worst_a <= 1e-9, worst_a, "advantages at action tokens"),
                                      Check("returns", worst_r <= 1e-9, worst_r, "value targets at action tokens")])
