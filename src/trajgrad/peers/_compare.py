"""The comparisons behind the peer cases: policy losses (verify's battery), advantages, KL estimators."""
from __future__ import annotations

import math

import torch

from ..losses import clip_cov_loss
from ..verify import Check, VerifyReport, max_deviation, verify

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
            d = max_deviation(got, want)
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
        d = max(max_deviation(got.detach(), want.detach()), max_deviation(g_got, g_want))
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
        worst_a = max(worst_a, max_deviation(adv[mask], ours.advantages[mask]))
        worst_r = max(worst_r, max_deviation(ret[mask], ours.returns[mask]))
    return VerifyReport(recipe.name, [Check("value", worst_a <= 1e-9, worst_a, "advantages at action tokens"),
                                      Check("returns", worst_r <= 1e-9, worst_r, "value targets at action tokens")])


# ---------------------------------------------------------------------- Clip-Cov / KL-Cov
COV_RATIO = 2.0 ** -4  # with N a multiple of 16 valid tokens, r·N is an integer: verl's ⌊rN⌋ = trajgrad's rN


def _cov_batch(gen, B: int, L: int, N: int):
    """A batch with exactly ``N`` valid tokens at random slots, per-token advantages."""
    mask = torch.zeros(B * L, dtype=torch.bool)
    mask[torch.randperm(B * L, generator=gen)[:N]] = True
    logp = -torch.rand(B, L, generator=gen, dtype=F64) * 3
    old = logp + 0.3 * torch.randn(B, L, generator=gen, dtype=F64)
    adv = torch.randn(B, L, generator=gen, dtype=F64)
    return logp, old, adv, mask.view(B, L)


def _value_grad(f, logp):
    lp = logp.clone().requires_grad_(True)
    v = f(lp)
    (g,) = torch.autograd.grad(v, lp)
    return v.detach(), g


def cov_topk(fn, recipe, case, *, seed: int) -> VerifyReport:
    """KL-Cov: the top-covariance selection is deterministic, so value and gradient are compared outright at
    r = 1/16 on batches of 160 and 320 valid tokens (r·N integral); ``selection_count`` at N = 150 (r·N = 9.375)."""
    gen = torch.Generator().manual_seed(seed)
    o = recipe.replace(cov_ratio=COV_RATIO)
    checks, worst_v, worst_g = [], 0.0, 0.0
    for B, L, N in ((6, 40, 160), (8, 50, 320)):
        logp, old, adv, mask = _cov_batch(gen, B, L, N)
        v1, g1 = _value_grad(lambda lp: fn(lp, old, adv, mask, COV_RATIO), logp)
        v2, g2 = _value_grad(lambda lp: o.policy_loss(lp, adv, mask, old_logp=old).loss, logp)
        worst_v, worst_g = max(worst_v, max_deviation(v1, v2)), max(worst_g, max_deviation(g1[mask], g2[mask]))
    checks += [Check("value", worst_v <= 1e-12, worst_v, "loss at r·N integral (160 and 320 valid tokens)"),
               Check("gradient", worst_g <= 1e-12, worst_g, "gradient at every valid token")]
    logp, old, adv, mask = _cov_batch(gen, 6, 40, 150)
    _, g1 = _value_grad(lambda lp: fn(lp, old, adv, mask, COV_RATIO), logp)
    _, g2 = _value_grad(lambda lp: o.policy_loss(lp, adv, mask, old_logp=old).loss, logp)
    d = max_deviation(g1[mask], g2[mask])
    checks.append(Check("selection_count", d <= 1e-12, d, "gradient at r·N = 9.375 (150 valid tokens)"))
    return VerifyReport(recipe.name, checks)


def _candidates(logp, old, adv, mask, eps_low, eps_high, lo, hi):
    """Clip-Cov's candidates: valid, not clipped by PPO, covariance in (lo, hi) (means over valid tokens)."""
    m = mask.to(F64)
    n = m.sum()
    cov = (adv - (adv * m).sum() / n) * (logp - (logp * m).sum() / n)
    z = logp - old
    clipped = ((adv > 0) & (z > math.log1p(eps_high))) | ((adv < 0) & (z < math.log1p(-eps_low)))
    return mask & ~clipped & (cov > lo) & (cov < hi)


def cov_random(fn, recipe, case, *, seed: int, draws: int = 400) -> VerifyReport:
    """Clip-Cov, whose tokens are drawn at random, compared seeded.

    * every candidate selected (r = 1): both sides are deterministic; ``gradient`` (objective) and ``value``
      (verl multiplies the selected terms by 0, trajgrad keeps their value and detaches them);
    * r = 1/16 (160 valid tokens, 10 selected), torch's global RNG seeded (``torch.manual_seed``) before
      verl's call and trajgrad's generator seeded with the same number: ``selection_rule`` (verl's tokens
      are the first ⌊rN⌋ of ``torch.randperm`` over the candidates in row-major order, reproduced here
      from the same seed), ``selection_count``, ``gradient_unselected`` (equal gradients at every token
      neither side selected), ``same_tokens`` (the two draws pick the same tokens) and ``selection_law``
      (over ``draws`` seeds both select each candidate with frequency k/|C|, within 0.15).
    """
    gen = torch.Generator().manual_seed(seed)
    el, eh, lo, hi = recipe.eps_low, recipe.eps_high_, recipe.cov_low, 5.0
    checks = []
    every = recipe.replace(cov_ratio=1.0)
    worst_v = worst_g = 0.0
    for B, L, N in ((6, 40, 160), (8, 50, 320)):
        logp, old, adv, mask = _cov_batch(gen, B, L, N)
        v1, g1 = _value_grad(lambda lp: fn(lp, old, adv, mask, 1.0), logp)
        v2, g2 = _value_grad(lambda lp: every.policy_loss(lp, adv, mask, old_logp=old).loss, logp)
        worst_v, worst_g = max(worst_v, max_deviation(v1, v2)), max(worst_g, max_deviation(g1[mask], g2[mask]))
    checks += [Check("gradient", worst_g <= 1e-12, worst_g, "every candidate selected (r = 1)"),
               Check("value", worst_v <= 1e-12, worst_v, "every candidate selected (r = 1)")]

    logp, old, adv, mask = _cov_batch(gen, 6, 40, 160)
    cand = _candidates(logp, old, adv, mask, el, eh, lo, hi)
    k = min(int(COV_RATIO * 160), int(cand.sum()))
    ours = lambda lp, s: clip_cov_loss(lp, old, adv, mask, eps_low=el, eps_high=eh, clip_ratio=COV_RATIO,  # noqa: E731
                                       cov_low=lo, cov_high=hi, seed=s).loss

    def draw(s):
        torch.manual_seed(s)
        _, gv = _value_grad(lambda lp: fn(lp, old, adv, mask, COV_RATIO), logp)
        _, go = _value_grad(lambda lp: ours(lp, s), logp)
        return cand & (gv == 0), cand & (go == 0), gv, go

    state = torch.random.get_rng_state()
    try:
        s_verl, s_ours, gv, go = draw(seed)
        torch.manual_seed(seed)
        nz = torch.nonzero(cand)
        rep = nz[torch.randperm(len(nz))[:k]]
        s_rep = torch.zeros_like(cand)
        s_rep[rep[:, 0], rep[:, 1]] = True
        freq_v = torch.zeros(cand.shape, dtype=F64)
        freq_o = torch.zeros(cand.shape, dtype=F64)
        for s in range(draws):
            a, b, _, _ = draw(10_000 + s)
            freq_v += a
            freq_o += b
    finally:
        torch.random.set_rng_state(state)
    counts = (int(s_verl.sum()), int(s_ours.sum()))
    off = mask & ~s_verl & ~s_ours
    law = float(max((freq_v[cand] / draws - k / int(cand.sum())).abs().max(),
                    (freq_o[cand] / draws - k / int(cand.sum())).abs().max()))
    checks += [
        Check("selection_rule", bool(torch.equal(s_rep, s_verl)), float((s_rep != s_verl).sum()),
              "verl's tokens = torch.randperm(|C|)[:⌊rN⌋] of the candidates after torch.manual_seed"),
        Check("selection_count", counts == (k, k), float(abs(counts[0] - counts[1])),
              f"both select {k} of {int(cand.sum())} candidates (verl {counts[0]}, trajgrad {counts[1]})"),
        Check("gradient_unselected", max_deviation(gv[off], go[off]) <= 1e-12, max_deviation(gv[off], go[off]),
              "equal gradients at the tokens neither side selected"),
        Check("same_tokens", bool(torch.equal(s_verl, s_ours)), float((s_verl != s_ours).sum()),
              "the same seed selects the same tokens"),
        Check("selection_law", law <= 0.15, law, f"each candidate selected with frequency k/|C| ({draws} seeds)"),
    ]
    return VerifyReport(recipe.name, checks)


def pairwise(fn, recipe, *, seed: int) -> VerifyReport:
    """Preference losses on sequence log-probs: value and gradient w.r.t. the chosen and rejected log-probs on
    random pairs with responses of 1 to 12 tokens (``fn(c, r, ref_c, ref_r, len_c, len_r)``), and the value
    at equal implicit margins."""
    gen = torch.Generator().manual_seed(seed)
    worst_v = worst_g = 0.0
    for B in (3, 8, 17):
        xs = [-torch.rand(B, generator=gen, dtype=F64) * 20 for _ in range(4)]
        lens = [torch.randint(1, 13, (B,), generator=gen).to(F64) for _ in range(2)]
        a = [x.clone().requires_grad_(True) for x in xs[:2]]
        b = [x.clone().requires_grad_(True) for x in xs[:2]]
        v = fn(a[0], a[1], xs[2], xs[3], lens[0], lens[1])
        ga = torch.autograd.grad(v, a)
        w = recipe.dpo_loss(b[0], b[1], xs[2], xs[3], chosen_length=lens[0], rejected_length=lens[1]).loss
        gb = torch.autograd.grad(w, b)
        worst_v = max(worst_v, max_deviation(v.detach(), w.detach()))
        worst_g = max(worst_g, max_deviation(ga[0], gb[0]), max_deviation(ga[1], gb[1]))
    x = -torch.rand(5, generator=gen, dtype=F64)
    n = torch.full((5,), 3.0, dtype=F64)
    eq = max_deviation(fn(x, x, x, x, n, n).detach(),
                       recipe.dpo_loss(x, x, x, x, chosen_length=n, rejected_length=n).loss)
    return VerifyReport(recipe.name, [
        Check("value", worst_v <= 1e-9, worst_v, "loss equals the recipe's (responses of 1 to 12 tokens)"),
        Check("gradient", worst_g <= 1e-9, worst_g, "gradients w.r.t. chosen / rejected log-probs"),
        Check("zero_advantage", eq <= 1e-12, eq, "equal implicit margins: the same value"),
    ])


def token_baseline(fn, recipe, case, *, seed: int) -> VerifyReport:
    """Per-token baselines without a critic (``case.ours`` with the same arguments): random groups of
    right-padded responses (G = 2, 4, one group of one; with ``case.observations`` a 2-token observation
    inside each response longer than 5), outcome rewards at the last token plus a few intermediate ones,
    the rollout policy's sampled-token log-probs and Σ_v π(v)² of random softmaxes."""
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for G, N, L in ((2, 3, 10), (4, 4, 16)):
        B = G * N + 1
        gids = torch.cat([torch.arange(N).repeat_interleave(G), torch.tensor([N])])
        lengths = torch.randint(1, L + 1, (B,), generator=gen)
        mask = torch.arange(L)[None, :] < lengths[:, None]
        if case.observations:  # a tool observation of 2 tokens inside every response longer than 5
            mask[:, 2:4] &= ~(lengths[:, None] > 5)
        rewards = torch.zeros(B, L, dtype=F64)
        rewards[torch.arange(B), lengths - 1] = torch.randn(B, generator=gen, dtype=F64)
        rewards = torch.where(mask & (torch.rand(B, L, generator=gen) > 0.8),
                              rewards + 0.3 * torch.randn(B, L, generator=gen, dtype=F64), rewards)
        probs = torch.softmax(2 * torch.randn(B, L, 7, generator=gen, dtype=F64), -1)
        tok = torch.randint(0, 7, (B, L), generator=gen)
        lp = torch.log(probs.gather(-1, tok[..., None])[..., 0])
        s2 = probs.square().sum(-1)
        got = fn(rewards, mask, gids, lp, s2)
        want = case.ours(rewards, mask, gids, lp, s2)
        worst = max(worst, max_deviation(got[mask], want[mask]))
    return VerifyReport(recipe.name, [Check("value", worst <= 1e-9, worst, "advantages at every action token")])


def critic(fn, recipe, case, *, seed: int) -> VerifyReport:
    """The critic's loss: value and gradient w.r.t. the predicted values, ragged masks, predictions on both
    sides of the clip range around the old values."""
    gen = torch.Generator().manual_seed(seed)
    worst_v = worst_g = 0.0
    for B, L in ((4, 12), (6, 30)):
        mask = torch.arange(L)[None, :] < torch.randint(1, L + 1, (B,), generator=gen)[:, None]
        old = torch.randn(B, L, generator=gen, dtype=F64)
        values = old + torch.randn(B, L, generator=gen, dtype=F64)
        targets = torch.randn(B, L, generator=gen, dtype=F64)
        v1, g1 = _value_grad(lambda v: fn(v, targets, mask, old), values)
        v2, g2 = _value_grad(lambda v: recipe.value_loss(v, targets, mask, old_values=old).loss, values)
        worst_v, worst_g = max(worst_v, max_deviation(v1, v2)), max(worst_g, max_deviation(g1[mask], g2[mask]))
    return VerifyReport(recipe.name, [Check("value", worst_v <= 1e-12, worst_v, "critic loss"),
                                      Check("gradient", worst_g <= 1e-12, worst_g, "d loss / d values")])
