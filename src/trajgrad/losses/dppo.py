r"""DPPO: a trust region on a divergence of the sampled token's probability, not on its ratio (§8).

Qi et al., 2026, "Rethinking the Trust Region in LLM Reinforcement Learning"
(arXiv:2602.04879). PPO's ratio test over-penalizes low-probability tokens (a tiny
absolute change is a large ratio) and under-constrains high-probability ones. DPPO masks
a token when a divergence between the old and the current policy *restricted to the
binary event "the sampled token / any other token"* leaves a trust region, and only when
the update moves further out (the same one-sidedness as PPO's clip, §8).

With :math:`p=\pi_\theta(a_t\mid h_t)` and :math:`q=\pi_{old}(a_t\mid h_t)` of the sampled
token (probabilities, i.e. :math:`e^{\ell}`):

* **binary total variation** :math:`\mathrm{TV}=|p-q|` (the TV of the two Bernoulli
  distributions :math:`(q,1-q)` and :math:`(p,1-p)`);
* **binary KL** :math:`\mathrm{KL}(q\Vert p)=q\log\frac qp+(1-q)\log\frac{1-q}{1-p}`.

Both losses use the policy-gradient form with a detached, optionally truncated ratio,

.. math::
    \mathcal L=-\operatorname{agg}_t\ M_t\,\mathrm{sg}[\min(r_t,C)]\,\hat A_t\,\ell^\theta_t,
    \qquad \nabla_\theta\mathcal L=-\operatorname{agg}_t\,M_t\min(r_t,C)\,\hat A_t\,
    \nabla_\theta\ell^\theta_t,

so an unmasked token gets exactly the importance-weighted gradient of the surrogate
:math:`rA` (:math:`\nabla r=r\nabla\ell`), and a masked token (:math:`M_t=0`) none.

The token sets are public: :func:`dppo_binary_divergence` (the TV or binary KL per token)
and :func:`dppo_trust_mask` (:math:`M_t`); the losses call the same code.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks
from ..registry import Param, finite_positive, policy_term
from ..types import LossResult
from ._common import aggregate_tokens, prepare, ratio_metrics, token_weights, weighted

# The binary KL needs log(1 - p); p is capped just below 1 there (documented below).
_P_MAX_LOG = -1e-7


def _check_delta(name: str, value: float) -> float:
    v = float(value)
    _checks.check_positive(name, v)
    if not math.isfinite(v):
        raise ValueError(f"{name}: must be finite, got {value}")
    return v


def _check_cap(cap: Optional[float]) -> Optional[float]:
    if cap is None:
        return None
    c = float(cap)
    if not (c > 0) or not math.isfinite(c):
        raise ValueError(f"ratio_cap: must be a finite positive number or None, got {cap}")
    return c


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """:math:`\\log(1-e^{x})` for :math:`x<0` (``expm1`` keeps it accurate near 0; for very
    negative x the absolute error is one rounding of 1, negligible against a KL threshold)."""
    return torch.expm1(x).neg_().log_()


KINDS = ("tv", "kl")


def _trust(x, kind: str, dl: float, dh: float):
    """``(masked_pos, masked_neg, divergence)`` of checked inputs: the tokens DPPO masks (by side) and
    the binary divergence, 0 at masked slots (:func:`dppo_trust_mask`, :func:`dppo_binary_divergence`)."""
    with torch.no_grad():
        lp = x.logp.detach()
        z = x.log_ratio().detach()  # 0 at masked slots
        pos = x.advantages > 0  # false at masked slots (A = 0)
        neg = x.advantages < 0
        if kind == "tv":
            div = torch.exp(lp).sub_(torch.exp(x.behaviour))  # signed p - q; 0 at masked slots
            masked_pos = pos & (div > dh)
            masked_neg = neg & (div < -dl)
            divergence = div.abs_()
        else:
            lq = x.behaviour.clamp(max=_P_MAX_LOG)
            lpc = lp.clamp(max=_P_MAX_LOG)
            q = torch.exp(lq)
            kl = (lq - lpc).mul_(q).add_((_log1mexp(lq) - _log1mexp(lpc)).mul_(1.0 - q))
            kl = kl.mul_(x.maskf)
            masked_pos = pos & (z > 0) & (kl > dh)  # the update raised p, moving away from q
            masked_neg = neg & (z < 0) & (kl > dl)
            divergence = kl
    return masked_pos, masked_neg, divergence


def _dppo(logp, old_logp, advantages, mask, kind, delta_low, delta_high, ratio_cap, weights, aggregation,
          constant, denominator) -> LossResult:
    dl = _check_delta("delta_low", delta_low)
    dh = _check_delta("delta_high", delta_high)
    cap = _check_cap(ratio_cap)
    x = prepare(logp, mask, advantages, aggregation=aggregation, behaviour=old_logp, behaviour_name="old_logp")
    w = token_weights(weights, x)
    masked_pos, masked_neg, divergence = _trust(x, kind, dl, dh)
    with torch.no_grad():
        z = x.log_ratio().detach()  # 0 at masked slots
        # Masked only when the step moves further out of the region in the advantage's direction.
        drop = masked_pos | masked_neg
        # The weight is never formed as inf (a masked token's 0 * inf would be NaN): without a
        # cap, z is clamped at the largest finite exponent of the dtype.
        zmax = math.log(cap) if cap is not None else math.log(torch.finfo(z.dtype).max) - 1.0
        coef = torch.clamp(z, max=zmax).exp_().mul_((~drop).to(z.dtype)).mul_(x.advantages)
    term = coef * x.logp_factor  # the negation is applied to the scalar
    loss = -aggregate_tokens(weighted(term, w), x, aggregation, constant=constant, denominator=denominator)
    metrics = ratio_metrics(z, x)
    with torch.no_grad():
        dt = metrics["tokens"].dtype
        n = metrics["tokens"].clamp_min(1)
        metrics["mask_frac/pos_high"] = torch.count_nonzero(masked_pos).to(dt) / n
        metrics["mask_frac/neg_low"] = torch.count_nonzero(masked_neg).to(dt) / n
        metrics["mask_frac"] = metrics["mask_frac/pos_high"] + metrics["mask_frac/neg_low"]
        name = "tv" if kind == "tv" else "binary_kl"
        metrics[f"{name}/mean"] = divergence.sum().to(dt) / n
        metrics[f"{name}/max"] = divergence.amax().to(dt) if divergence.numel() else torch.zeros((), dtype=dt)
        if cap is not None:
            metrics["ratio/truncated_frac"] = (z > math.log(cap)).sum().to(dt) / n
    return LossResult(loss, metrics)


_DELTA_DOC = "DPPO's trust region (probability units for binary TV, nats for binary KL)."
DELTA_LOW = Param("delta_low", 0.1, _DELTA_DOC, float, lambda v: finite_positive("delta_low", v))
DELTA_HIGH = Param("delta_high", 0.1, _DELTA_DOC, float, lambda v: finite_positive("delta_high", v))


def _check_ratio_cap_field(v) -> None:
    if v is not None:
        finite_positive("dppo_ratio_cap", v)


DPPO_RATIO_CAP = Param("dppo_ratio_cap", None, "DPPO's detached ratio weight truncated at this value (``None``: not "
                       "truncated; verl truncates at its ``clip_ratio_c``, 3 with its defaults).", Optional[float],
                       _check_ratio_cap_field)


def _dppo_text(kind):
    def text(o) -> str:
        if kind == "tv":
            d = "D_it = p_it − q_it  (p = π_θ(y_it), q = π_old(y_it): binary total variation, signed)"
            m = f"M_it = 0 if (A > 0 and D > {o.delta_high:g}) or (A < 0 and D < −{o.delta_low:g}), else 1"
        else:
            d = "D_it = q log(q/p) + (1−q) log((1−q)/(1−p))  (binary KL of the sampled token, p = π_θ, q = π_old)"
            m = (f"M_it = 0 if (A > 0, p > q, D > {o.delta_high:g}) or (A < 0, p < q, D > {o.delta_low:g}), else 1")
        r = "r_it" if o.dppo_ratio_cap is None else f"min(r_it, {o.dppo_ratio_cap:g})"
        return (d + "\n" + m + "   (trust region on the probability, one-sided like §8)\n"
                f"x_it = − M_it · sg[{r}] · A_it · log π_θ(y_it),  r_it = π_θ/π_old   (gradient M sg[{r}] A ∇log π_θ)")
    return text


def _dppo_entry(kind: str):
    """The registration of ``dppo_<kind>`` on its loss function."""
    def wrap(fn):
        return policy_term(
            f"dppo_{kind}", zero_without_advantage=True, fields=("delta_low", "delta_high", "dppo_ratio_cap"),
            ratio="old", detached=("old log-probs", "the ratio weight", "the trust-region mask"),
            aggregation="token_mean", text=_dppo_text(kind), verify_noise=0.6,
            params=(DELTA_LOW, DELTA_HIGH, DPPO_RATIO_CAP),
            call=lambda o, x: fn(x.logp, x.ratio_logp, x.advantages, x.mask, delta_low=o.delta_low,
                                 delta_high=o.delta_high, ratio_cap=o.dppo_ratio_cap, **x.agg),
        )(fn)
    return wrap


@_dppo_entry("tv")
def dppo_tv_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta_low: float = 0.1,
    delta_high: float = 0.1,
    ratio_cap: Optional[float] = None,
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""DPPO-Binary-TV: mask tokens whose sampled-token probability moved more than δ (Qi et al. 2026).

    .. math::
        M_t=\begin{cases}0,&\hat A_t>0\ \text{and}\ p_t-q_t>\delta_h\\
        0,&\hat A_t<0\ \text{and}\ p_t-q_t<-\delta_l\\1,&\text{otherwise}\end{cases}

    (see the module docstring for the loss and its gradient). The test is on the
    *absolute* probability change: a token at :math:`q=0.001` may move to
    :math:`p=0.1` (ratio 100, far outside PPO's range), a token at :math:`q=0.9` may not
    move to :math:`0.6` (ratio 0.67) when :math:`\delta=0.1`. A step that moves back
    toward :math:`q` is never masked. The boundary :math:`|p-q|=\delta` is inside.

    Args:
      logp, old_logp: ``[B, L]`` current (attached) and old (detached) log-probs of the
        sampled tokens.
      advantages: ``[B, L]`` or ``[B]`` (detached).
      mask: ``[B, L]`` action mask.
      delta_low, delta_high: :math:`\delta_l,\delta_h>0` (probability units). The paper
        tunes δ per setting; 0.1 is a value used in its public runs, not a universal one.
      ratio_cap: optional :math:`C` truncating the detached ratio weight (``None``: no
        truncation).
      weights: optional ``[B, L]`` detached per-token multiplier (e.g. a rollout
        correction); a weight-0 token keeps its place in the denominator.
      aggregation: default ``"token_mean"``.
      constant, denominator: see :func:`trajgrad.aggregate.aggregate`.

    Returns:
      ``LossResult``; metrics from :func:`trajgrad.diagnostics.policy_metrics` plus
      ``mask_frac`` (= ``mask_frac/pos_high`` + ``mask_frac/neg_low``, fractions of valid
      tokens), ``tv/mean``, ``tv/max`` (of :math:`|p-q|`) and, with a cap,
      ``ratio/truncated_frac``.
    """
    return _dppo(logp, old_logp, advantages, mask, "tv", delta_low, delta_high, ratio_cap, weights, aggregation,
                 constant, denominator)


@_dppo_entry("kl")
def dppo_kl_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta_low: float = 0.05,
    delta_high: float = 0.05,
    ratio_cap: Optional[float] = None,
    weights: Optional[torch.Tensor] = None,
    aggregation: str = "token_mean",
    constant: Optional[float] = None,
    denominator=None,
) -> LossResult:
    r"""DPPO-Binary-KL: mask tokens whose binary KL left the region, moving outward (Qi et al. 2026).

    .. math::
        D_t=q_t\log\frac{q_t}{p_t}+(1-q_t)\log\frac{1-q_t}{1-p_t},\qquad
        M_t=\begin{cases}0,&\hat A_t>0,\ p_t>q_t,\ D_t>\delta_h\\
        0,&\hat A_t<0,\ p_t<q_t,\ D_t>\delta_l\\1,&\text{otherwise}\end{cases}

    (see the module docstring for the loss and its gradient). :math:`D_t` is the KL
    between the Bernoulli distributions "sampled token vs the rest" under the old and the
    current policy, computed in log space (:math:`\log(1-e^{\ell})` by ``expm1``/``log1p``).
    Probabilities are capped at :math:`e^{-10^{-7}}` inside :math:`D` only, so a token
    with :math:`q=1` gives a finite divergence. :math:`D=\delta` is inside.

    Args:
      logp, old_logp, advantages, mask, ratio_cap, weights, aggregation, constant,
        denominator: as in :func:`dppo_tv_loss`.
      delta_low, delta_high: :math:`\delta_l,\delta_h>0` (nats). The default 0.05 is not
        from the paper's tables; tune it.

    Returns:
      ``LossResult``; as :func:`dppo_tv_loss` with ``binary_kl/mean`` and
      ``binary_kl/max`` in place of the TV statistics.
    """
    return _dppo(logp, old_logp, advantages, mask, "kl", delta_low, delta_high, ratio_cap, weights, aggregation,
                 constant, denominator)


def dppo_binary_divergence(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, *,
                           kind: str = "tv") -> torch.Tensor:
    r"""DPPO's per-token divergence of the binary event "the sampled token / any other", ``[B, L]``, detached.

    ``kind="tv"``: :math:`|p_t-q_t|`; ``kind="kl"``: :math:`q\log\frac qp+(1-q)\log\frac{1-q}{1-p}`
    (probabilities capped at :math:`e^{-10^{-7}}` as in :func:`dppo_kl_loss`), with
    :math:`p=e^{\ell^\theta}`, :math:`q=e^{\ell^{old}}` of the sampled token; 0 at masked
    positions. Worked example: :math:`q=0.5`, :math:`p=0.25`: TV :math:`0.25`; binary KL
    :math:`0.5\log2+0.5\log\frac{0.5}{0.75}=0.143841`.

    Args:
      logp, old_logp: ``[B, L]`` current and old log-probs of the sampled tokens.
      mask: ``[B, L]`` action mask. kind: ``"tv"`` or ``"kl"``.
    """
    _checks.check_choice("kind", kind, KINDS)
    lp = _checks.as_tensor("logp", logp)
    no_adv = torch.zeros(lp.shape[:1], dtype=lp.dtype if lp.is_floating_point() else torch.float32)
    x = prepare(lp, mask, no_adv, aggregation="token_mean", behaviour=old_logp, behaviour_name="old_logp")
    return _trust(x, kind, math.inf, math.inf)[2]


def dppo_trust_mask(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                    kind: str = "tv", delta_low: float = 0.1, delta_high: float = 0.1) -> torch.Tensor:
    r"""DPPO's trust mask :math:`M_t` (``[B, L]`` bool): True where the token keeps its gradient.

    False at masked positions and where the update leaves the trust region in the
    advantage's direction (:func:`dppo_tv_loss`, :func:`dppo_kl_loss` for :math:`M_t`; the
    KL loss's default δ is 0.05, pass it). Worked example (``"tv"``, :math:`\delta=0.1`):
    :math:`q=0.5`; :math:`p=0.65`, :math:`\hat A>0`: dropped; the same with :math:`\hat A<0`:
    kept (a step down would be tested against :math:`-\delta_l`); :math:`p=0.35`,
    :math:`\hat A<0`: dropped.

    Args:
      logp, old_logp: ``[B, L]`` current and old log-probs. advantages: ``[B, L]`` or ``[B]``.
      mask: ``[B, L]`` action mask. kind: ``"tv"`` or ``"kl"``. delta_low, delta_high: the region.
    """
    _checks.check_choice("kind", kind, KINDS)
    dl = _check_delta("delta_low", delta_low)
    dh = _check_delta("delta_high", delta_high)
    x = prepare(logp, mask, advantages, aggregation="token_mean", behaviour=old_logp, behaviour_name="old_logp")
    masked_pos, masked_neg, _ = _trust(x, kind, dl, dh)
    return x.mask & ~(masked_pos | masked_neg)


__all__ = ["dppo_tv_loss", "dppo_kl_loss", "dppo_binary_divergence", "dppo_trust_mask", "KINDS"]
