r"""Clip-Cov and KL-Cov: act on the few tokens whose covariance drives entropy collapse (§8).

Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models" (arXiv:2505.22617). For softmax policies the change of policy entropy under a
policy-gradient step is, to first order, minus the covariance between a token's
log-probability and its advantage. Few tokens carry a large positive covariance
(confident *and* rewarded); they collapse entropy. Over the valid tokens of the batch
(detached, means over valid tokens):

.. math::
    \operatorname{Cov}_t=(\ell_t-\bar\ell)\,(\hat A_t-\bar A).

* **Clip-Cov**: among the tokens not already clipped by PPO whose covariance lies in
  :math:`(\omega_{low},\omega_{high})`, pick :math:`rN` tokens' worth *at random*
  (``N`` valid tokens) and detach their gradient; the rest is the PPO clipped surrogate (§8).
* **KL-Cov**: the :math:`rN` tokens' worth of *largest positive* covariance get the
  unclipped surrogate plus a penalty :math:`\beta|\ell^\theta_t-\ell^{old}_t|`; all
  other tokens get the unclipped surrogate :math:`-r_t\hat A_t`.

**Selection mass.** :math:`rN` is rarely an integer: the :math:`\lfloor rN\rfloor`
chosen tokens are selected fully and one more by the fraction
:math:`rN-\lfloor rN\rfloor` (its gradient is detached / penalized by that fraction),
so the selected mass is exactly :math:`rN` and the loss is continuous in :math:`r`. The
paper's code rounds to an integer count; the two differ by less than one token.

**Batch dependence.** Both the covariance (means over the batch) and the count are
functions of the batch the loss sees: micro-batches select differently from the full
batch, so the sum of micro-batch losses with a global denominator is *not* the full-batch
loss (every other loss here has that property, §13).

Selection is a function of the detached inputs only (and, for Clip-Cov, the generator):
the same inputs and seed select the same tokens.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks
from .._policy_stats import _valid_extrema
from ..registry import Param, PolicyTerm, finite_positive, register_policy_term
from ..types import LossResult
from ._common import Inputs, aggregate_tokens, prepare, ratio_metrics, token_weights, weighted
from ._clip import EPS_HIGH, EPS_LOW, _clip_bounds, _clipped_surrogate, check_eps_low_below_one

CLIP_COV_HIGH = 5.0  # Clip-Cov's upper covariance bound (Cui et al. 2025): the function's default and the recipe's


def _covariance(x: Inputs) -> torch.Tensor:
    """``[B, L]`` detached covariance term; 0 at masked slots."""
    with torch.no_grad():
        n = x.tokens.clamp_min(1)
        lp = x.logp.detach()
        lbar = lp.sum() / n
        abar = x.advantages.sum() / n
        return (lp - lbar) * (x.advantages - abar) * x.maskf


def _count(x: Inputs, ratio: float) -> float:
    """The selected mass :math:`rN` (not rounded: see :func:`_select`)."""
    return ratio * float(x.tokens.item())


def _check_ratio(name: str, value: float) -> float:
    v = float(value)
    _checks.check_in_range(name, v, 0.0, 1.0, inclusive=(False, True))
    return v


def _select(keys: torch.Tensor, mass: float, dtype) -> torch.Tensor:
    r"""Selection weights ``[B, L]`` in [0, 1] of total ``mass`` among the entries with ``keys > 0``.

    ``keys`` is positive exactly at the candidates (0 or negative elsewhere). The
    ``floor(mass)`` candidates of largest key get 1, the next one ``mass - floor(mass)``:
    the selected mass is exactly :math:`rN`, continuous in the ratio (a hard
    :math:`\max(1,\lfloor rN\rfloor)` selects 1 token for every :math:`rN<2`). With fewer
    candidates, every candidate is selected fully.
    """
    flat = keys.reshape(-1)
    out = torch.zeros(flat.shape, dtype=dtype, device=keys.device)
    k = int(math.floor(mass))
    frac = mass - k
    take = min(k + (1 if frac > 0 else 0), flat.numel())
    if take > 0:
        vals, idx = torch.topk(flat, take, sorted=True)
        ok = vals > 0
        n_ok = int(ok.sum())
        out[idx[:n_ok]] = 1.0  # sorted: the candidates come first
        if n_ok == take and take == k + 1:
            out[idx[take - 1]] = frac
    return out.reshape(keys.shape)


def clip_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
    clip_ratio: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = CLIP_COV_HIGH,
    generator: Optional[torch.Generator] = None,
    seed: int = 0,
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""Clip-Cov: PPO with the gradient of a few random high-covariance tokens detached (Cui et al. 2025).

    .. math::
        \mathcal L=-\operatorname{agg}_t\begin{cases}\mathrm{sg}[s_t],&t\in S\\
        s_t,&\text{otherwise}\end{cases},\qquad
        s_t=\min\big(r_t\hat A_t,\operatorname{clip}(r_t,1-\epsilon_l,1+\epsilon_h)\hat A_t\big),

    where :math:`S` is a uniformly random selection of mass
    :math:`\min(rN,|C|)`, :math:`r=` ``clip_ratio`` (module docstring), of the
    candidates :math:`C=\{t:\ \omega_{low}<\operatorname{Cov}_t<\omega_{high},\ t\text{ not
    clipped by PPO}\}` (covariance in the module docstring). Tokens in :math:`S` keep
    their value in the loss and lose their gradient; every other token has the PPO
    gradient :math:`\hat A_tr_t\nabla\ell_t` where active (§8). (verl multiplies the
    selected terms by 0, which also drops their value; the gradient is the same.)

    Paper defaults: ``clip_ratio`` :math:`2\times10^{-4}`, :math:`(\omega_{low},
    \omega_{high})=(1,5)`, PPO :math:`\epsilon=0.2`.

    **Determinism.** The random subset is drawn with ``generator`` (a CPU
    ``torch.Generator``), or with a fresh generator seeded by ``seed`` when none is given:
    the same inputs and seed always select the same tokens. Pass a generator advanced
    across steps to draw different subsets each step.

    Args:
      logp, old_logp: ``[B, L]`` current (attached) and old (detached) log-probs.
      advantages: ``[B, L]`` or ``[B]`` (detached).
      mask: ``[B, L]`` action mask.
      eps_low, eps_high: PPO clip range (``eps_high`` defaults to ``eps_low``).
      clip_ratio: fraction :math:`r\in(0,1]` of valid tokens to detach.
      cov_low, cov_high: the covariance window :math:`\omega_{low}<\omega_{high}`.
      generator, seed: the random source of the selection.
      weights: optional ``[B, L]`` detached per-token multiplier.
      aggregation: default ``"token_mean"``.
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; PPO's metrics (:func:`trajgrad.diagnostics.policy_metrics`) plus
      ``cov/selected_frac`` (fraction of valid tokens detached), ``cov/candidates_frac``,
      ``cov/mean`` and ``cov/max`` (of :math:`\operatorname{Cov}_t` over valid tokens).
    """
    eps_low, eps_high, lo_b, hi_b = _clip_bounds(eps_low, eps_high)
    r = _check_ratio("clip_ratio", clip_ratio)
    lo_c, hi_c = float(cov_low), float(cov_high)
    if not (math.isfinite(lo_c) and math.isfinite(hi_c)) or not lo_c < hi_c:
        raise ValueError(f"cov_low: need finite cov_low < cov_high, got ({cov_low}, {cov_high})")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    w = token_weights(weights, x)
    log_ratio = x.log_ratio()
    surrogate = _clipped_surrogate(log_ratio, x.advantages, eps_low, eps_high, lo_b, hi_b)
    cov = _covariance(x)
    with torch.no_grad():
        z = log_ratio.detach()
        clipped = ((x.advantages > 0) & (z > hi_b)) | ((x.advantages < 0) & (z < lo_b))
        candidates = ~clipped & (cov > lo_c) & (cov < hi_c) & (x.maskf > 0)
        g = generator if generator is not None else torch.Generator().manual_seed(int(seed))
        # a uniform key in [1, 2) at each candidate, 0 elsewhere (a candidate's key is never 0)
        keys = torch.rand(cov.shape, generator=g, dtype=cov.dtype).add_(1.0).to(cov.device)
        keys = keys.mul_(candidates.to(keys.dtype))
        sel_f = _select(keys, _count(x, r), surrogate.dtype)
    surrogate = surrogate * (1.0 - sel_f) + surrogate.detach() * sel_f
    loss = aggregate_tokens(weighted(-surrogate, w), x, aggregation, constant=constant, denominator=denominator)
    metrics = ratio_metrics(z, x, lo_b=lo_b, hi_b=hi_b)
    _cov_metrics(metrics, cov, x, sel_f, candidates)
    return LossResult(loss, metrics)


def _cov_metrics(metrics, cov, x, selected, candidates=None) -> None:
    with torch.no_grad():
        dt = metrics["tokens"].dtype
        n = metrics["tokens"].clamp_min(1)
        metrics["cov/selected_frac"] = selected.sum().to(dt) / n  # selected mass / N
        if candidates is not None:
            metrics["cov/candidates_frac"] = candidates.sum().to(dt) / n
        metrics["cov/mean"] = cov.sum().to(dt) / n
        metrics["cov/max"] = _valid_extrema(cov, x.maskf, x.tokens)[1].to(dt)


def kl_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_ratio: float = 2e-3,
    kl_coef: float = 1.0,
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""KL-Cov: a KL penalty on the top-covariance tokens, no clipping (Cui et al. 2025).

    .. math::
        \mathcal L=\operatorname{agg}_t\begin{cases}-r_t\hat A_t+\beta\,|z_t|,&t\in T\\
        -r_t\hat A_t,&\text{otherwise}\end{cases},\qquad z_t=\ell^\theta_t-\ell^{old}_t,

    :math:`T` the :math:`rN` tokens' worth (:math:`r=` ``kl_ratio``; module docstring) of
    largest positive :math:`\operatorname{Cov}_t` (ties broken by ``torch.topk``,
    deterministic for given inputs; a token with :math:`\operatorname{Cov}_t\le0` is never
    penalized, so all-zero advantages give no penalty). With selection weight
    :math:`w_t\in[0,1]` (1 inside :math:`T`, the fraction for the partial token) the
    penalty is :math:`w_t\beta|z_t|`. Gradient per token:

    .. math::
        \nabla_\theta\mathcal L_t=\big(-r_t\hat A_t+\beta\,w_t\,
        \operatorname{sign}(z_t)\big)\nabla_\theta\ell^\theta_t

    (:math:`\operatorname{sign}(0)=0`). The penalty :math:`|z|` is the absolute sampled
    log ratio, the paper's choice (a symmetric, always non-negative per-token KL proxy).
    Paper defaults: ``kl_ratio`` :math:`2\times10^{-3}` (7B; :math:`2\times10^{-4}` for
    32B), :math:`\beta=1`.

    Args:
      logp, old_logp: ``[B, L]`` current (attached) and old (detached) log-probs.
      advantages: ``[B, L]`` or ``[B]`` (detached).
      mask: ``[B, L]`` action mask.
      kl_ratio: fraction :math:`\in(0,1]` of valid tokens penalized.
      kl_coef: :math:`\beta\ge0`.
      weights: optional ``[B, L]`` detached per-token multiplier.
      aggregation: default ``"token_mean"``.
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; :func:`trajgrad.diagnostics.policy_metrics` (no clip fractions)
      plus ``cov/selected_frac``, ``cov/mean``, ``cov/max`` and ``kl_cov/penalty`` (the
      valid-token mean of :math:`\beta|z_t|` over :math:`T`).
    """
    r = _check_ratio("kl_ratio", kl_ratio)
    beta = float(kl_coef)
    _checks.check_positive("kl_coef", beta, allow_zero=True)
    if not math.isfinite(beta):
        raise ValueError(f"kl_coef: must be finite, got {kl_coef}")
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    w = token_weights(weights, x)
    log_ratio = x.log_ratio()
    cov = _covariance(x)
    with torch.no_grad():
        sel_f = _select(cov, _count(x, r), log_ratio.dtype)  # cov = 0 at masked slots: never selected
        zmax = math.log(torch.finfo(log_ratio.dtype).max) - 1.0
    # the ratio formed as 1 + expm1(z): the one transcendental pass also gives the metrics' expm1 (KL k3,
    # ratio mean); the clamp keeps e^z finite (the metrics then read the clamped value)
    em1 = torch.expm1(torch.clamp(log_ratio, max=zmax))
    ratio = em1 + 1.0
    penalty = beta * log_ratio.abs() * sel_f
    term = -(ratio * x.advantages) + penalty
    loss = aggregate_tokens(weighted(term, w), x, aggregation, constant=constant, denominator=denominator)
    z = log_ratio.detach()
    metrics = ratio_metrics(z, x, em1=em1.detach())
    _cov_metrics(metrics, cov, x, sel_f)
    with torch.no_grad():
        metrics["kl_cov/penalty"] = penalty.detach().sum().to(metrics["tokens"].dtype) / metrics["tokens"].clamp_min(1)
    return LossResult(loss, metrics)


__all__ = ["clip_cov_loss", "kl_cov_loss"]


# ---------------------------------------------------------------------- the recipes' fields and registry entries
def _check_cov_ratio(v) -> None:
    finite_positive("cov_ratio", v)
    _checks.check_in_range("cov_ratio", v, 0.0, 1.0, inclusive=(False, True))


def _check_cov_low(v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v < CLIP_COV_HIGH:
        raise ValueError(f"cov_low: must be a finite number below {CLIP_COV_HIGH:g}, got {v!r}")


_COV_DOC = ("Clip-Cov / KL-Cov: fraction of valid tokens selected, and Clip-Cov's lower covariance bound (the upper "
            f"one is the paper's {CLIP_COV_HIGH:g}, a constant of the recipe; ``trajgrad.losses.clip_cov_loss`` takes "
            "both). Clip-Cov's random selection is seeded by the batch content (the same batch selects the same "
            "tokens).")
COV_RATIO = Param("cov_ratio", 2e-4, _COV_DOC, float, _check_cov_ratio)
COV_LOW = Param("cov_low", 1.0, _COV_DOC, float, _check_cov_low)
COV_KL_COEF = Param("cov_kl_coef", 1.0, "KL-Cov's penalty coefficient β.", float,
                    lambda v: finite_positive("cov_kl_coef", v, allow_zero=True))
_COV = "Cov_it = (log π_θ(y_it) − mean log π) (A_it − mean A)   (detached, means over the batch's valid tokens)"


def _batch_seed(x) -> int:
    """A selection seed that is a function of the batch content (same batch, same tokens)."""
    with torch.no_grad():
        m = torch.as_tensor(x.mask).to(torch.float64)
        lp = torch.where(m > 0, x.logp.detach().to(torch.float64), torch.zeros((), dtype=torch.float64))
        adv = torch.as_tensor(x.advantages).detach().to(torch.float64)
        valid = m > 0 if adv.ndim == 2 else (m > 0).any(-1)
        adv = torch.where(valid, adv, torch.zeros((), dtype=torch.float64))
        key = (float(lp.sum()), float((lp * lp).sum()), float(adv.sum()), int(m.sum()))
    return hash(key) & 0x7FFFFFFF


def _clip_cov_text(o) -> str:
    return (_COV + "\n"
            f"S = random (seeded by the batch) selection of {o.cov_ratio:g}·N tokens with {o.cov_low:g} < Cov < "
            f"{CLIP_COV_HIGH:g}, not clipped by PPO\n"
            f"x_it = − min(ρ A, clip(ρ, 1 − {o.eps_low:g}, 1 + {o.eps_high_:g}) A), with sg[·] on the tokens of S   "
            "(their gradient is removed)")


def _kl_cov_text(o) -> str:
    return (_COV + "\n"
            f"T = the {o.cov_ratio:g}·N tokens of largest positive Cov\n"
            f"x_it = − ρ_it A_it + {o.cov_kl_coef:g} · 1[t ∈ T] · |log π_θ(y_it) − log π_old(y_it)|   (no clipping)")


register_policy_term(PolicyTerm(
    name="clip_cov", fn=clip_cov_loss, fields=("eps_low", "eps_high", "cov_ratio", "cov_low"), ratio="old",
    detached=("old log-probs", "the covariance", "the selected tokens' terms"), aggregation="token_mean",
    text=_clip_cov_text, validate=check_eps_low_below_one, params=(EPS_LOW, EPS_HIGH, COV_RATIO, COV_LOW),
    call=lambda o, x: clip_cov_loss(x.logp, x.ratio_logp, x.advantages, x.mask, clip_ratio=o.cov_ratio,
                                    cov_low=o.cov_low, cov_high=CLIP_COV_HIGH, seed=_batch_seed(x), eps_low=o.eps_low,
                                    eps_high=o.eps_high_, **x.agg),
))
register_policy_term(PolicyTerm(
    name="kl_cov", fn=kl_cov_loss, fields=("cov_ratio", "cov_kl_coef"), ratio="old",
    detached=("old log-probs", "the covariance"), aggregation="token_mean", text=_kl_cov_text,
    params=(COV_RATIO, COV_KL_COEF),
    call=lambda o, x: kl_cov_loss(x.logp, x.ratio_logp, x.advantages, x.mask, kl_ratio=o.cov_ratio,
                                  kl_coef=o.cov_kl_coef, **x.agg),
))
