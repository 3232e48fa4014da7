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

**The token sets are public** (check them against your own code): :func:`token_covariance`
(:math:`\operatorname{Cov}_t`), :func:`clip_cov_candidates` (Clip-Cov's :math:`C`) and
:func:`kl_cov_top_tokens` (KL-Cov's selection weights); the losses call the same functions.

**Conventions** (paper vs the authors' verl code), each an argument:

=======================  =============================================  ==========================
argument                 values (default first)                         what
=======================  =============================================  ==========================
``selected`` (Clip-Cov)  ``"detach"``: :math:`\mathrm{sg}[s_t]` (value      the selected terms
                         kept); ``"zero"``: :math:`0\cdot s_t` (verl)
``cov_band`` (Clip-Cov)  ``"open"`` :math:`(\omega_l,\omega_h)` (verl);     the candidate window
                         ``"closed"`` :math:`[\omega_l,\omega_h]` (paper)
``exclude_clipped``      ``True``: PPO-clipped tokens are no candidates  candidates
(Clip-Cov)               (verl); ``False``: they are
``selection_mask``       ``None`` (random draw) or a caller's ``[B, L]``  :math:`S` itself
(Clip-Cov)               mask
``positive_only``        ``True``: only :math:`\operatorname{Cov}_t>0`;   KL-Cov's top tokens
(KL-Cov)                 ``False``: top-k over all valid tokens (paper,
                         verl)
``base`` (KL-Cov)        ``"unclipped"`` :math:`-r_t\hat A_t`;           the surrogate
                         ``"ppo_clip"``: PPO's clipped surrogate
=======================  =============================================  ==========================
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks
from .._policy_stats import _valid_extrema
from ..registry import Param, PolicyTerm, finite_positive, flag, register_policy_term
from ..types import LossResult
from ._common import Inputs, aggregate_tokens, prepare, ratio_metrics, token_weights, weighted
from ._clip import EPS_HIGH, EPS_LOW, _clip_bounds, _clipped_surrogate, check_eps_low_below_one

CLIP_COV_HIGH = 5.0  # Clip-Cov's upper covariance bound (Cui et al. 2025): the function's default and the recipe's


BANDS = ("open", "closed")
SELECTED = ("detach", "zero")
BASES = ("unclipped", "ppo_clip")


def _covariance(x: Inputs) -> torch.Tensor:
    """``[B, L]`` detached covariance term; 0 at masked slots (:func:`token_covariance`)."""
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


def _select(keys: torch.Tensor, mass: float, dtype, candidates: torch.Tensor) -> torch.Tensor:
    r"""Selection weights ``[B, L]`` in [0, 1] of total ``mass`` among the ``candidates``.

    The ``floor(mass)`` candidates of largest key get 1, the next one ``mass - floor(mass)``:
    the selected mass is exactly :math:`rN`, continuous in the ratio (a hard
    :math:`\max(1,\lfloor rN\rfloor)` selects 1 token for every :math:`rN<2`). With fewer
    candidates, every candidate is selected fully.
    """
    keys = torch.where(candidates, keys, torch.full_like(keys, -math.inf))
    flat = keys.reshape(-1)
    out = torch.zeros(flat.shape, dtype=dtype, device=keys.device)
    k = int(math.floor(mass))
    frac = mass - k
    take = min(k + (1 if frac > 0 else 0), flat.numel())
    if take > 0:
        vals, idx = torch.topk(flat, take, sorted=True)
        ok = vals > -math.inf
        n_ok = int(ok.sum())
        out[idx[:n_ok]] = 1.0  # sorted: the candidates come first
        if n_ok == take and take == k + 1:
            out[idx[take - 1]] = frac
    return out.reshape(keys.shape)


def _candidates(x: Inputs, cov: torch.Tensor, z: torch.Tensor, lo_b: float, hi_b: float, lo_c: float, hi_c: float,
                cov_band: str, exclude_clipped: bool) -> torch.Tensor:
    """Clip-Cov's candidate set (:func:`clip_cov_candidates`), from checked inputs."""
    with torch.no_grad():
        inside = (cov > lo_c) & (cov < hi_c) if cov_band == "open" else (cov >= lo_c) & (cov <= hi_c)
        out = inside & (x.maskf > 0)
        if exclude_clipped:
            clipped = ((x.advantages > 0) & (z > hi_b)) | ((x.advantages < 0) & (z < lo_b))
            out = out & ~clipped
        return out


def _check_band(cov_low: float, cov_high: float, cov_band: str) -> tuple:
    lo_c, hi_c = float(cov_low), float(cov_high)
    if not (math.isfinite(lo_c) and math.isfinite(hi_c)) or not lo_c < hi_c:
        raise ValueError(f"cov_low: need finite cov_low < cov_high, got ({cov_low}, {cov_high})")
    _checks.check_choice("cov_band", cov_band, BANDS)
    return lo_c, hi_c


def _top(x: Inputs, cov: torch.Tensor, ratio: float, positive_only: bool, dtype) -> torch.Tensor:
    """KL-Cov's selection weights (:func:`kl_cov_top_tokens`), from checked inputs."""
    with torch.no_grad():
        cand = (x.maskf > 0) & (cov > 0) if positive_only else x.maskf > 0
        return _select(cov, _count(x, ratio), dtype, cand)


def token_covariance(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""The per-token covariance of Clip-Cov and KL-Cov (Cui et al. 2025, §8), detached.

    .. math:: \operatorname{Cov}_t=(\ell_t-\bar\ell)(\hat A_t-\bar A),\quad
        \bar\ell=\tfrac1N\textstyle\sum_{t\ \mathrm{valid}}\ell_t,\ \bar A\text{ likewise},

    over the ``N`` valid tokens of the batch; 0 at masked positions. Worked example:
    :math:`\ell=(-1,-3)`, :math:`\hat A=(2,0)`: :math:`\bar\ell=-2`, :math:`\bar A=1`,
    :math:`\operatorname{Cov}=(1\cdot1, -1\cdot-1)=(1, 1)`.

    Args:
      logp: ``[B, L]`` log-probs (the current policy's; detached here).
      advantages: ``[B, L]`` or ``[B]``.
      mask: ``[B, L]`` action mask.
    """
    x = prepare(logp, mask, advantages, aggregation="token_mean")
    return _covariance(x)


def clip_cov_candidates(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
    cov_low: float = 1.0,
    cov_high: float = CLIP_COV_HIGH,
    cov_band: str = "open",
    exclude_clipped: bool = True,
) -> torch.Tensor:
    r"""Clip-Cov's candidate tokens :math:`C` (``[B, L]`` bool), the set its random selection draws from.

    .. math:: C=\{t\ \mathrm{valid}:\ \omega_l<\operatorname{Cov}_t<\omega_h\ (\text{or }
        \le\text{ with }\texttt{cov\_band="closed"}),\ t\text{ not clipped by PPO (with
        }\texttt{exclude\_clipped})\},

    "clipped" meaning :math:`\hat A_t>0,\ r_t>1+\epsilon_h` or :math:`\hat A_t<0,\
    r_t<1-\epsilon_l` (:func:`token_covariance` for :math:`\operatorname{Cov}_t`). Worked
    example: :math:`\ell=\hat A=(0, 2, 4)` (:math:`\bar\ell=\bar A=2`,
    :math:`\operatorname{Cov}=(4, 0, 4)`), window :math:`\omega=(0, 4)`, nothing clipped:
    ``"open"`` gives :math:`(F, F, F)`, ``"closed"`` :math:`(T, T, T)`.

    Args: as :func:`clip_cov_loss`.
    """
    _eps_low, _eps_high, lo_b, hi_b = _clip_bounds(eps_low, eps_high)
    lo_c, hi_c = _check_band(cov_low, cov_high, cov_band)
    x = prepare(logp, mask, advantages, aggregation="token_mean", behaviour=old_logp, behaviour_name="old_logp")
    return _candidates(x, _covariance(x), x.log_ratio().detach(), lo_b, hi_b, lo_c, hi_c, cov_band,
                       bool(exclude_clipped))


def kl_cov_top_tokens(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_ratio: float = 2e-3,
    positive_only: bool = True,
) -> torch.Tensor:
    r"""KL-Cov's selection weights ``[B, L]`` in [0, 1]: the :math:`rN` tokens' worth of largest covariance.

    The :math:`\lfloor rN\rfloor` valid tokens of largest :func:`token_covariance` get 1, the
    next one :math:`rN-\lfloor rN\rfloor` (module docstring, "Selection mass"); with
    ``positive_only`` (default) only tokens with :math:`\operatorname{Cov}_t>0` can be
    selected, otherwise every valid token (the paper's top-k). Worked example:
    :math:`\operatorname{Cov}=(2, -1, -3)` (one row), :math:`r=0.5` (:math:`rN=1.5`):
    ``positive_only`` gives :math:`(1, 0, 0)`, ``False`` gives :math:`(1, 0.5, 0)`.

    Args:
      logp: ``[B, L]`` current log-probs (detached here). advantages: ``[B, L]`` or ``[B]``.
      mask: ``[B, L]`` action mask. kl_ratio: :math:`r\in(0, 1]`. positive_only: as above.
    """
    r = _check_ratio("kl_ratio", kl_ratio)
    x = prepare(logp, mask, advantages, aggregation="token_mean")
    return _top(x, _covariance(x), r, bool(positive_only), x.maskf.dtype)


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
    selected: str = "detach",
    cov_band: str = "open",
    exclude_clipped: bool = True,
    selection_mask: Optional[torch.Tensor] = None,
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
    selected terms by 0, which also drops their value; the gradient is the same:
    ``selected="zero"``.) The candidates are :func:`clip_cov_candidates`; ``cov_band``,
    ``exclude_clipped`` and ``selection_mask`` are in the module docstring's table.

    Worked example (one token, :math:`\hat A=1`, :math:`r=e^{0.1}=1.105171`, not clipped at
    :math:`\epsilon=0.2`, selected by ``selection_mask``, ``token_mean``): ``"detach"`` gives
    loss :math:`-1.105171` and gradient 0; ``"zero"`` gives loss 0 and gradient 0; not
    selected, loss :math:`-1.105171` and gradient :math:`-1.105171`.

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
      selected: ``"detach"`` (default) or ``"zero"``: what happens to a selected term.
      cov_band: ``"open"`` (default) or ``"closed"`` covariance window.
      exclude_clipped: PPO-clipped tokens are no candidates (default True).
      selection_mask: optional ``[B, L]`` bool/0-1 mask: the selected set itself (at valid
        positions), instead of the random draw; the candidates are then not used.
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
    lo_c, hi_c = _check_band(cov_low, cov_high, cov_band)
    _checks.check_choice("selected", selected, SELECTED)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    w = token_weights(weights, x)
    log_ratio = x.log_ratio()
    surrogate = _clipped_surrogate(log_ratio, x.advantages, eps_low, eps_high, lo_b, hi_b)
    cov = _covariance(x)
    z = log_ratio.detach()
    if selection_mask is not None:
        candidates = _checks.check_mask("selection_mask", selection_mask, tuple(cov.shape)) & (x.maskf > 0)
        sel_f = candidates.to(surrogate.dtype)
    else:
        candidates = _candidates(x, cov, z, lo_b, hi_b, lo_c, hi_c, cov_band, bool(exclude_clipped))
        with torch.no_grad():
            g = generator if generator is not None else torch.Generator().manual_seed(int(seed))
            keys = torch.rand(cov.shape, generator=g, dtype=cov.dtype).add_(1.0).to(cov.device)  # uniform in [1, 2)
            sel_f = _select(keys, _count(x, r), surrogate.dtype, candidates)
    kept = surrogate * (1.0 - sel_f)
    surrogate = kept if selected == "zero" else kept + surrogate.detach() * sel_f
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
    positive_only: bool = True,
    base: str = "unclipped",
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
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

    :math:`T` is :func:`kl_cov_top_tokens`: with ``positive_only=False`` the top-k runs over
    every valid token (the paper's and verl's), so a batch with few positive covariances
    still penalizes :math:`rN` tokens. ``base="ppo_clip"`` replaces :math:`-r_t\hat A_t` by
    PPO's clipped surrogate :math:`-\min(r_t\hat A_t,\operatorname{clip}(r_t,1-\epsilon_l,
    1+\epsilon_h)\hat A_t)` at every token (``eps_low``, ``eps_high``). Worked example (one
    token, selected, :math:`\hat A=1`, :math:`z=0.5`, :math:`\beta=1`, ``token_mean``):
    ``"unclipped"`` gives :math:`-e^{0.5}+0.5=-1.148721`, gradient :math:`-e^{0.5}+1=-0.648721`;
    ``"ppo_clip"`` (:math:`\epsilon=0.2`) gives :math:`-1.2+0.5=-0.7`, gradient :math:`1`.

    Args:
      logp, old_logp: ``[B, L]`` current (attached) and old (detached) log-probs.
      advantages: ``[B, L]`` or ``[B]`` (detached).
      mask: ``[B, L]`` action mask.
      kl_ratio: fraction :math:`\in(0,1]` of valid tokens penalized.
      kl_coef: :math:`\beta\ge0`.
      positive_only: only positive-covariance tokens can be penalized (default True).
      base: ``"unclipped"`` (default) or ``"ppo_clip"``; eps_low, eps_high: its clip range.
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
    _checks.check_choice("base", base, BASES)
    eps_low, eps_high, lo_b, hi_b = _clip_bounds(eps_low, eps_high)
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    w = token_weights(weights, x)
    log_ratio = x.log_ratio()
    cov = _covariance(x)
    sel_f = _top(x, cov, r, bool(positive_only), log_ratio.dtype)
    with torch.no_grad():
        zmax = math.log(torch.finfo(log_ratio.dtype).max) - 1.0
    # the ratio formed as 1 + expm1(z): the one transcendental pass also gives the metrics' expm1 (KL k3,
    # ratio mean); the clamp keeps e^z finite (the metrics then read the clamped value)
    em1 = torch.expm1(torch.clamp(log_ratio, max=zmax))
    ratio = em1 + 1.0
    penalty = beta * log_ratio.abs() * sel_f
    if base == "ppo_clip":
        term = -_clipped_surrogate(log_ratio, x.advantages, eps_low, eps_high, lo_b, hi_b) + penalty
    else:
        term = -(ratio * x.advantages) + penalty
    loss = aggregate_tokens(weighted(term, w), x, aggregation, constant=constant, denominator=denominator)
    z = log_ratio.detach()
    metrics = ratio_metrics(z, x, em1=em1.detach(), **({"lo_b": lo_b, "hi_b": hi_b} if base == "ppo_clip" else {}))
    _cov_metrics(metrics, cov, x, sel_f)
    with torch.no_grad():
        metrics["kl_cov/penalty"] = penalty.detach().sum().to(metrics["tokens"].dtype) / metrics["tokens"].clamp_min(1)
    return LossResult(loss, metrics)


__all__ = ["clip_cov_loss", "kl_cov_loss", "token_covariance", "clip_cov_candidates", "kl_cov_top_tokens", "BANDS",
           "SELECTED", "BASES"]


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


_SELECTED_DOC = ("Clip-Cov: what happens to a selected token's term: ``\"detach\"`` (sg[s_t], value kept, gradient "
                 "removed; the paper's) or ``\"zero\"`` (0 · s_t, value and gradient removed; the authors' verl code). "
                 "``trajgrad.losses.clip_cov_loss(selected=)``.")
COV_SELECTED = Param("cov_selected", "detach", _SELECTED_DOC, str, lambda v: _checks.check_choice("cov_selected", v, SELECTED))
COV_BAND = Param("cov_band", "open", "Clip-Cov's covariance window of the candidates: ``\"open\"`` cov_low < Cov < 5 "
                 "(verl) or ``\"closed\"`` cov_low ≤ Cov ≤ 5 (the paper's). ``clip_cov_loss(cov_band=)``.", str,
                 lambda v: _checks.check_choice("cov_band", v, BANDS))
COV_EXCLUDE_CLIPPED = Param("cov_exclude_clipped", True, "Clip-Cov: tokens clipped by PPO are no candidates (``True``, "
                            "verl) or are (``False``). ``clip_cov_loss(exclude_clipped=)``.", bool,
                            lambda v: flag("cov_exclude_clipped", v))
KL_COV_POSITIVE_ONLY = Param("kl_cov_positive_only", True, "KL-Cov: only tokens with a positive covariance can be "
                             "penalized (``True``) or the top-k runs over every valid token (``False``, the paper's and "
                             "verl's). ``kl_cov_loss(positive_only=)``.", bool, lambda v: flag("kl_cov_positive_only", v))
KL_COV_BASE = Param("kl_cov_base", "unclipped", "KL-Cov's surrogate: ``\"unclipped\"`` −ρ_t A_t (the paper's) or "
                    "``\"ppo_clip\"`` PPO's clipped surrogate with the recipe's ``eps_low`` / ``eps_high`` (read only "
                    "then). ``kl_cov_loss(base=)``.", str, lambda v: _checks.check_choice("kl_cov_base", v, BASES))


def _clip_cov_text(o) -> str:
    lt = "<" if o.cov_band == "open" else "≤"
    band = f"{o.cov_low:g} {lt} Cov {lt} {CLIP_COV_HIGH:g}" + ("" if o.cov_band == "open" else " (closed band)")
    cand = ", not clipped by PPO" if o.cov_exclude_clipped else ", PPO-clipped tokens included"
    sel = ("with sg[·] on the tokens of S   (their gradient is removed)" if o.cov_selected == "detach" else
           "times 0 on the tokens of S   (their value and gradient are removed, verl's form)")
    return (_COV + "\n"
            f"S = random (seeded by the batch) selection of {o.cov_ratio:g}·N tokens with {band}{cand}\n"
            f"x_it = − min(ρ A, clip(ρ, 1 − {o.eps_low:g}, 1 + {o.eps_high_:g}) A), {sel}")


def _kl_cov_text(o) -> str:
    top = "largest positive Cov" if o.kl_cov_positive_only else "largest Cov, over every valid token"
    if o.kl_cov_base == "unclipped":
        base, note = "− ρ_it A_it", "(no clipping)"
    else:
        base = f"− min(ρ_it A_it, clip(ρ_it, 1 − {o.eps_low:g}, 1 + {o.eps_high_:g}) A_it)"
        note = "(PPO-clipped surrogate)"
    return (_COV + "\n"
            f"T = the {o.cov_ratio:g}·N tokens of {top}\n"
            f"x_it = {base} + {o.cov_kl_coef:g} · 1[t ∈ T] · |log π_θ(y_it) − log π_old(y_it)|   {note}")


def _check_kl_cov(o) -> None:
    if o.kl_cov_base == "ppo_clip":
        check_eps_low_below_one(o)


register_policy_term(PolicyTerm(
    name="clip_cov", fn=clip_cov_loss,
    fields=("eps_low", "eps_high", "cov_ratio", "cov_low", "cov_selected", "cov_band", "cov_exclude_clipped"),
    ratio="old",
    detached=lambda o: ("old log-probs", "the covariance") + (("the selected tokens' terms",) if o.cov_selected == "detach"
                                                             else ()),
    aggregation="token_mean", text=_clip_cov_text, validate=check_eps_low_below_one,
    params=(EPS_LOW, EPS_HIGH, COV_RATIO, COV_LOW, COV_SELECTED, COV_BAND, COV_EXCLUDE_CLIPPED),
    call=lambda o, x: clip_cov_loss(x.logp, x.ratio_logp, x.advantages, x.mask, clip_ratio=o.cov_ratio,
                                    cov_low=o.cov_low, cov_high=CLIP_COV_HIGH, seed=_batch_seed(x), eps_low=o.eps_low,
                                    eps_high=o.eps_high_, selected=o.cov_selected, cov_band=o.cov_band,
                                    exclude_clipped=o.cov_exclude_clipped, **x.agg),
))
register_policy_term(PolicyTerm(
    name="kl_cov", fn=kl_cov_loss,
    fields=("cov_ratio", "cov_kl_coef", "kl_cov_positive_only", "kl_cov_base"), ratio="old",
    fields_when=lambda o: ("eps_low", "eps_high") if o.kl_cov_base == "ppo_clip" else (),
    detached=("old log-probs", "the covariance"), aggregation="token_mean", text=_kl_cov_text, validate=_check_kl_cov,
    params=(COV_RATIO, COV_KL_COEF, KL_COV_POSITIVE_ONLY, KL_COV_BASE),  # eps_low / eps_high: declared by _clip
    call=lambda o, x: kl_cov_loss(x.logp, x.ratio_logp, x.advantages, x.mask, kl_ratio=o.cov_ratio,
                                  kl_coef=o.cov_kl_coef, positive_only=o.kl_cov_positive_only, base=o.kl_cov_base,
                                  eps_low=o.eps_low, eps_high=o.eps_high_, **x.agg),
))
