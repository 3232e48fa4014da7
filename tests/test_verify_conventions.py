"""``verify`` covers every published convention's non-default value: each recipe setting is checked against an
independent, hand-written float64 form of the paper's equation (never a call of the function under test), and
verify fails once the estimator is perturbed to ignore the option (the core function monkeypatched to its
default), so a passing report is evidence the option reaches the loss or the advantages."""
import math

import pytest
import torch

from trajgrad.objective import get_recipe
from trajgrad.verify import verify

F64 = torch.float64
_CORE = ("value", "gradient", "ratio_one", "masked_nan", "masked_grad", "padding", "zero_advantage", "off_policy",
         "long_sequence")
# the covariance terms select over the batch they see: micro-batches / ranks select differently (documented)
_BATCH_DEPENDENT = ("clip_cov", "kl_cov")


# ---------------------------------------------------------------------- hand-written pieces (§13 aggregation)
def _clean(x, m):
    return torch.where(m, x, torch.zeros((), dtype=x.dtype))


def _agg(term, m, mode, denominator):
    """§13 by hand: token_mean Σ x / N; seq_mean_token_mean (1/B') Σ_i (1/L_i) Σ_t x (B' rows with a token)."""
    lengths = m.sum(-1).to(term.dtype)
    if mode == "token_mean":
        num, den = term.sum(), lengths.sum()
    else:
        num, den = (term.sum(-1) / lengths.clamp_min(1)).sum(), (lengths > 0).sum()
    return num / (float(denominator) if denominator is not None else den)


def _inputs(logp, old_logp, advantages, mask):
    m = mask.bool()
    return m, _clean(logp, m), _clean(old_logp, m), _clean(advantages, m)


def _ppo_surrogate(r, A, eps_low, eps_high):
    return torch.minimum(r * A, torch.clamp(r, 1 - eps_low, 1 + eps_high) * A)


def _row_adv(A, m):
    return A.sum(-1) / m.sum(-1).clamp_min(1)


# ---------------------------------------------------------------------- policy terms
def gmpo_sequence_clip(logp, old_logp, advantages, mask, denominator=None, cl=0.4, ch=0.4):
    """GMPO §3, sequence level: J_i = A_i exp(z̃_i), z̄_i the mean log ratio, z̃ = min(z̄, c_h) (A > 0),
    max(z̄, −c_l) (A < 0); loss −(1/B) Σ J_i."""
    m, lp, old, A = _inputs(logp, old_logp, advantages, mask)
    n = m.sum(-1)
    zbar = (lp - old).sum(-1) / n.clamp_min(1)
    a = _row_adv(A, m)
    zt = torch.where(a > 0, torch.clamp(zbar, max=ch), torch.where(a < 0, torch.clamp(zbar, min=-cl), zbar))
    J = torch.where(n > 0, a * torch.exp(zt), torch.zeros((), dtype=F64))
    return -J.sum() / (float(denominator) if denominator is not None else (n > 0).sum())


def cispo_unified_mask(logp, old_logp, advantages, mask, denominator=None, eps_high=0.28, mlow=0.2, mhigh=0.28):
    """MiniMax-M1 §3.1: x = −M sg[min(r, 1 + ε_h)] A log π, M = 0 where (A > 0, r > 1 + ε_h^M) or (A < 0,
    r < 1 − ε_l^M); token mean."""
    m, lp, old, A = _inputs(logp, old_logp, advantages, mask)
    r = torch.exp(lp - old).detach()
    keep = ~(((A > 0) & (r > 1 + mhigh)) | ((A < 0) & (r < 1 - mlow)))
    x = -(keep.to(F64) * torch.clamp(r, max=1 + eps_high) * A * lp)
    return _agg(x, m, "token_mean", denominator)


def _covariance(lp, A, m):
    n = m.sum()
    ld = lp.detach()
    return _clean((ld - ld.sum() / n) * (A - A.sum() / n), m)


def clip_cov_paper(selected, band, exclude_clipped, lo=-100.0, hi=5.0, eps=0.2):
    """Clip-Cov (Cui et al. 2025) with every candidate selected (ratio 1): S = {valid, Cov in the band, not
    PPO-clipped unless included}; x = −sg[s] (detach) or 0 (zero) on S, −s elsewhere; token mean."""
    def fn(logp, old_logp, advantages, mask, denominator=None):
        m, lp, old, A = _inputs(logp, old_logp, advantages, mask)
        cov = _covariance(lp, A, m)
        inside = (cov > lo) & (cov < hi) if band == "open" else (cov >= lo) & (cov <= hi)
        r = torch.exp(lp - old)
        clipped = ((A > 0) & (r > 1 + eps)) | ((A < 0) & (r < 1 - eps))
        S = m & inside & (~clipped if exclude_clipped else torch.ones_like(m))
        s = _ppo_surrogate(r, A, eps, eps)
        term = torch.where(S, s.detach() if selected == "detach" else torch.zeros_like(s), s)
        return -_agg(term, m, "token_mean", denominator)
    return fn


def kl_cov_paper(positive_only, base, ratio=0.3, beta=1.0, eps=0.2):
    """KL-Cov (Cui et al. 2025): T = the r·N tokens of largest Cov (positive ones only, or all), the last one
    by its fraction; x = base + β w |z| with base −ρA or PPO's clipped surrogate; token mean."""
    def fn(logp, old_logp, advantages, mask, denominator=None):
        m, lp, old, A = _inputs(logp, old_logp, advantages, mask)
        cov = _covariance(lp, A, m)
        cand = m & (cov > 0) if positive_only else m
        key = torch.where(cand, cov, torch.tensor(-math.inf, dtype=F64)).reshape(-1)
        mass = ratio * float(m.sum())
        k = math.floor(mass)
        take = min(k + (mass > k), key.numel())
        order = torch.topk(key, take, sorted=True).indices  # ties (all Cov = 0) broken as torch.topk does
        w = torch.zeros(key.numel(), dtype=F64)
        w[order[:k]] = 1.0
        if take > k:
            w[order[k]] = mass - k
        w = torch.where(cand.reshape(-1), w, torch.zeros((), dtype=F64)).reshape(m.shape)
        z = lp - old
        r = torch.exp(z)
        b = -r * A if base == "unclipped" else -_ppo_surrogate(r, A, eps, eps)
        return _agg(_clean(b + beta * w * z.abs(), m), m, "token_mean", denominator)
    return fn


def ppo_corrected(weight, mode, eps=0.2):
    """§8 PPO term times a hand-written rollout-correction weight w(current, old, behaviour, A, mask)."""
    def fn(logp, old_logp, advantages, mask, denominator=None, behaviour_logp=None):
        m, lp, old, A = _inputs(logp, old_logp, advantages, mask)
        beh = old if behaviour_logp is None else _clean(behaviour_logp, m)
        w = _clean(weight(lp.detach(), old, beh, A, m), m)
        r = torch.exp(lp - old)
        return -_agg(w * _ppo_surrogate(r, A, eps, eps), m, mode, denominator)
    return fn


def tis_two_sided(lp, old, beh, A, m):
    return torch.clamp(torch.exp(old - beh), 0.5, 2.0)


def tis_geometric(lp, old, beh, A, m):
    g = torch.exp((old - beh).sum(-1) / m.sum(-1).clamp_min(1))
    return torch.clamp(g, max=1.5)[:, None].expand_as(old)


def sequence_mask(level, policy, delta=0.0):
    """DeepSeek-V3.2: drop A < 0 (per token, or the row's mean A) in rows whose mean(log μ − log π) > δ, π the
    current (detached) or the proximal policy; TIS weight min(π_old/μ, 2) on the rest."""
    def weight(lp, old, beh, A, m):
        pi = lp if policy == "current" else old
        mismatch = (beh - pi).sum(-1) / m.sum(-1).clamp_min(1)
        neg = A < 0 if level == "token" else (_row_adv(A, m) < 0)[:, None].expand_as(A)
        drop = neg & (mismatch > delta)[:, None]
        return torch.where(drop, torch.zeros((), dtype=F64), torch.clamp(torch.exp(old - beh), max=2.0))
    return weight


def lagrangian_paper(lam, d, mode):
    """§22: −(J_R − λ (J_C − d)), J_X = agg(ρ A^X), d entering per token."""
    def fn(logp, old_logp, advantages, mask, denominator=None, cost_advantages=None):
        m, lp, old, A = _inputs(logp, old_logp, advantages, mask)
        C = _clean(cost_advantages, m)
        r = torch.exp(lp - old)
        one = _agg(m.to(F64), m, mode, denominator)
        return -(_agg(r * A, m, mode, denominator) - lam * (_agg(r * C, m, mode, denominator) - d * one))
    return fn


def multi_teacher_paper(direction):
    """§15: Σ_n ω_n Σ_i w̃_i KL_i(n), w̃ = w / Σ_j w_j (0 where the sum is 0), reverse or forward KL; token mean."""
    def fn(student_logits, teachers, mask, weights):
        m = mask.bool()
        logp = torch.log_softmax(torch.where(m[..., None], student_logits, 0.0), -1)
        w = torch.where(m, weights, 0.0)
        tot = w.sum(0)
        wn = torch.where(tot > 0, w / torch.where(tot > 0, tot, 1.0), 0.0)
        D = torch.zeros(m.shape, dtype=F64)
        for i, t in enumerate(teachers):
            logq = torch.log_softmax(torch.where(m[..., None], t, 0.0), -1)
            kl = (logp.exp() * (logp - logq)).sum(-1) if direction == "reverse" else (logq.exp() * (logq - logp)).sum(-1)
            D = D + wn[i] * kl
        return torch.where(m, D, 0.0).sum() / m.sum()
    return fn


def _opsm(level, policy, ignored):
    """A PPO recipe (per-token GAE advantages) with the sequence mask at ``level`` against ``policy``."""
    rc = {"kind": "tis", "cap": 2.0, "seq_mask_delta": 0.0, "advantage_level": level, "mismatch_policy": policy}
    return ("ppo", dict(rollout_correction=rc), ppo_corrected(sequence_mask(level, policy), "token_mean"),
            ("trajgrad.logprobs.correction", "rollout_correction") + ignored)


# (recipe, overrides, hand form, (module, core function, keyword, value that ignores the option))
POLICY = {
    "gmpo_clip_level": ("gmpo", dict(gmpo_clip_level="sequence"), gmpo_sequence_clip,
                        ("trajgrad.losses.gmpo", "gmpo_loss", "clip_level", "token")),
    "mask_eps_low/high": ("cispo", dict(mask_eps_low=0.2, mask_eps_high=0.28), cispo_unified_mask,
                          ("trajgrad.losses.cispo", "cispo_loss", "mask_eps_high", None)),
    "cov_selected": ("clip_cov", dict(cov_low=-100.0, cov_ratio=1.0, cov_selected="zero"),
                     clip_cov_paper("zero", "open", True), ("trajgrad.losses.cov", "clip_cov_loss", "selected", "detach")),
    "cov_band": ("clip_cov", dict(cov_low=-100.0, cov_ratio=1.0, cov_band="closed", cov_selected="zero"),
                 clip_cov_paper("zero", "closed", True), None),
    "cov_exclude_clipped": ("clip_cov", dict(cov_low=-100.0, cov_ratio=1.0, cov_exclude_clipped=False,
                                             cov_selected="zero"),
                            clip_cov_paper("zero", "open", False),
                            ("trajgrad.losses.cov", "clip_cov_loss", "exclude_clipped", True)),
    "kl_cov_positive_only": ("kl_cov", dict(cov_ratio=0.3, kl_cov_positive_only=False), kl_cov_paper(False, "unclipped"),
                             ("trajgrad.losses.cov", "kl_cov_loss", "positive_only", True)),
    "kl_cov_base": ("kl_cov", dict(cov_ratio=0.3, kl_cov_base="ppo_clip"), kl_cov_paper(True, "ppo_clip"),
                    ("trajgrad.losses.cov", "kl_cov_loss", "base", "unclipped")),
    "rollout_correction.cap_low": (
        "grpo", dict(rollout_correction={"kind": "tis", "cap": 2.0, "cap_low": 0.5}),
        ppo_corrected(tis_two_sided, "seq_mean_token_mean"),
        ("trajgrad.logprobs.correction", "rollout_correction", "cap_low", None)),
    "rollout_correction.level geometric": (
        "grpo", dict(rollout_correction={"kind": "tis", "cap": 1.5, "level": "geometric"}),
        ppo_corrected(tis_geometric, "seq_mean_token_mean"),
        ("trajgrad.logprobs.correction", "rollout_correction", "level", "token")),
    **{f"rollout_correction.{name}": _opsm(level, policy, ignored) for name, level, policy, ignored in (
        ("advantage_level token", "token", "current", ("advantage_level", "sequence")),
        ("advantage_level sequence", "sequence", "current", ("advantage_level", "token")),
        ("mismatch_policy proximal", "token", "proximal", ("mismatch_policy", "current")))},
    "lagrangian": ("grpo", dict(loss="lagrangian", lagrangian_lambda=1.5, lagrangian_budget=0.2),
                   lagrangian_paper(1.5, 0.2, "seq_mean_token_mean"),
                   ("trajgrad.losses.lagrangian", "lagrangian_policy_loss", "budget", -0.2)),
}


def _checks(report, recipe):
    names = _CORE if recipe in _BATCH_DEPENDENT else [c.name for c in report.checks]
    return {c.name: c for c in report.checks if c.name in names}


def _ignoring(monkeypatch, perturb):
    """The core function made to ignore the option: called with its default (or another) value instead."""
    import importlib

    module, name, key, value = perturb
    mod = importlib.import_module(module)
    orig = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, **k: orig(*a, **{**k, key: value}))


@pytest.mark.parametrize("convention", list(POLICY))
def test_verify_passes_the_papers_equation_for_each_policy_option(convention):
    recipe, overrides, hand, _ = POLICY[convention]
    o = get_recipe(recipe, **overrides)
    rep = verify(hand, o)
    bad = [c for c in _checks(rep, recipe).values() if not c.passed]
    assert not bad, rep.table()


@pytest.mark.parametrize("convention", [k for k, v in POLICY.items() if v[3] is not None])
def test_verify_fails_once_the_estimator_ignores_the_option(convention, monkeypatch):
    recipe, overrides, hand, perturb = POLICY[convention]
    o = get_recipe(recipe, **overrides)
    _ignoring(monkeypatch, perturb)
    rep = verify(hand, o)
    assert not all(c.passed for c in _checks(rep, recipe).values()), rep.table()


def test_the_rollout_correction_reaches_verify_only_through_behaviour_logp():
    """A decoupled correction is exercised with behaviour log-probs apart from old_logp when the function takes
    them; the hand form without the correction then fails."""
    o = get_recipe("grpo", rollout_correction={"kind": "tis", "cap": 2.0, "cap_low": 0.5})
    plain = ppo_corrected(lambda lp, old, beh, A, m: torch.ones_like(old), "seq_mean_token_mean")
    assert not verify(plain, o).passed
    assert verify(plain, get_recipe("grpo")).passed


# ---------------------------------------------------------------------- multi-teacher distillation (§15)
MT = {"forward": dict(teacher_direction="forward"), "zero_sum": dict(teacher_zero_sum="zero"),
      "forward+zero_sum": dict(teacher_direction="forward", teacher_zero_sum="zero")}


@pytest.mark.parametrize("setting", list(MT))
def test_verify_multi_teacher_options(setting, monkeypatch):
    o = get_recipe("opd", loss="multi_teacher", **MT[setting])
    hand = multi_teacher_paper(o.teacher_direction)
    rep = verify(hand, o)
    assert rep.passed, rep.table()
    assert not verify(multi_teacher_paper("reverse" if o.teacher_direction == "forward" else "forward"), o).passed
    key, value = ("direction", "reverse") if "forward" in setting else ("zero_sum", "error")
    _ignoring(monkeypatch, ("trajgrad.losses.multi_teacher", "multi_teacher_distill_loss", key, value))
    try:
        assert not verify(hand, o).passed
    except ValueError as exc:  # the perturbed estimator refuses the zero-sum positions outright
        assert key == "zero_sum" and str(exc).startswith("weights: the weights of the teachers sum to 0")


# ---------------------------------------------------------------------- advantage estimators
def maxrl_paper(eps, mode, centred):
    def fn(rewards):
        mean = rewards.mean(-1, keepdim=True)
        den = torch.clamp(mean, min=eps) if mode == "max" else mean + eps
        num = rewards - mean if centred else rewards
        return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)
    return fn


def batch_whitening(eps, placement, empty, group_baseline=False):
    """REINFORCE++: Ã = R (− the group mean), A = (Ã − μ)/(σ + ε) or /sqrt(σ² + ε) over the batch, Bessel σ."""
    def fn(rewards):
        x = rewards - rewards.mean(-1, keepdim=True) if group_baseline else rewards.clone()
        n = x.numel()
        if n < 2:
            if empty == "error":
                raise ValueError("rewards: one response")
            return torch.zeros_like(x)
        mu = x.sum() / n
        var = ((x - mu) ** 2).sum() / (n - 1)
        scale = var.sqrt() + eps if placement == "std" else (var + eps).sqrt()
        return (x - mu) / scale
    return fn


def gae_whitened(gamma, lam, eps, placement, empty):
    """Skip-observation GAE (§20.4) by a loop over each row's action tokens, bootstrap 0, then whitened over the
    batch's valid tokens."""
    def fn(values, rewards, mask):
        A = torch.zeros(values.shape, dtype=F64)
        for b in range(values.shape[0]):
            idx = [int(t) for t in mask[b].nonzero().flatten()]
            nxt_v, nxt_a = 0.0, 0.0
            for t in reversed(idx):
                delta = float(rewards[b, t]) + gamma * nxt_v - float(values[b, t])
                A[b, t] = nxt_a = delta + gamma * lam * nxt_a
                nxt_v = float(values[b, t])
        vals = A[mask]
        if vals.numel() < 2:
            if empty == "error":
                raise ValueError("mask: no valid token")
            return torch.zeros_like(A)
        mu = vals.mean()
        var = ((vals - mu) ** 2).sum() / (vals.numel() - 1)
        scale = var.sqrt() + eps if placement == "std" else (var + eps).sqrt()
        return torch.where(mask, (A - mu) / scale, 0.0)
    return fn


ADV = {
    "maxrl_eps": ("maxrl", dict(maxrl_eps=0.3), maxrl_paper(0.3, "max", True),
                  ("trajgrad.advantages.normalized", "maxrl_advantages", "eps", 0.0)),
    "maxrl_eps_mode": ("maxrl", dict(maxrl_eps=0.3, maxrl_eps_mode="add"), maxrl_paper(0.3, "add", True),
                       ("trajgrad.advantages.normalized", "maxrl_advantages", "eps_mode", "max")),
    "maxrl_centred": ("maxrl", dict(maxrl_centred=False), maxrl_paper(0.0, "max", False),
                      ("trajgrad.advantages.normalized", "maxrl_advantages", "centred", True)),
    "whiten_eps_placement (REINFORCE++)": (
        "reinforce_pp", dict(whiten_eps_placement="std", std_eps=0.5), batch_whitening(0.5, "std", "error"),
        ("trajgrad.advantages.normalized", "reinforce_pp_advantages", "eps_placement", "variance")),
    "whiten_empty (REINFORCE++)": (
        "reinforce_pp", dict(whiten_empty="zeros"), batch_whitening(1e-8, "variance", "zeros"),
        ("trajgrad.advantages.normalized", "reinforce_pp_advantages", "empty", "error")),
    "whiten_eps_placement (REINFORCE++-baseline)": (
        "reinforce_pp_baseline", dict(whiten_eps_placement="std", std_eps=0.5),
        batch_whitening(0.5, "std", "error", group_baseline=True),
        ("trajgrad.advantages.normalized", "reinforce_pp_advantages", "eps_placement", "variance")),
    "whiten_eps_placement (GAE)": (
        "ppo", dict(whiten_advantages=True, whiten_eps_placement="std"), gae_whitened(1.0, 0.95, 1e-8, "std", "error"),
        ("trajgrad.advantages.td", "whiten", "eps_placement", "variance")),
    "whiten_empty (GAE)": (
        "ppo", dict(whiten_advantages=True, whiten_empty="zeros"), gae_whitened(1.0, 0.95, 1e-8, "variance", "zeros"),
        ("trajgrad.advantages.td", "whiten", "empty", "error")),
}


@pytest.mark.parametrize("convention", list(ADV))
def test_verify_passes_the_papers_advantages_for_each_option(convention, monkeypatch):
    recipe, overrides, hand, perturb = ADV[convention]
    o = get_recipe(recipe, **overrides)
    rep = verify(hand, o, part="advantages")
    assert rep.passed, rep.table()
    _ignoring(monkeypatch, perturb)
    assert not verify(hand, o, part="advantages").passed


def test_verify_advantages_refuses_a_recipe_without_an_estimator():
    with pytest.raises(ValueError, match="^reference: recipe 'opd' has no advantage estimator"):
        verify(lambda r: r, "opd", part="advantages")
    with pytest.raises(ValueError, match="^part: must be 'loss' or 'advantages'"):
        verify(lambda r: r, "grpo", part="advantage")
