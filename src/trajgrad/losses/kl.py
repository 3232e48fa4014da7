r"""KL divergences to a reference policy: sampled estimators and the exact sum (spec §9, §14, §24).

Sampled estimators follow Schulman, "Approximating KL Divergence" (2020). For a token
:math:`y\sim\pi` with :math:`z=\log\pi(y)-\log\pi_{ref}(y)`:

* ``k1`` :math:`=z`: unbiased; can be negative; high variance.
* ``k2`` :math:`=\tfrac12 z^2`: biased (slightly, for close policies); :math:`\ge0`.
* ``k3`` :math:`=e^{-z}-1+z`: unbiased (:math:`\mathbb E_\pi[e^{-z}]=1`); :math:`\ge0`;
  low variance for close policies.

Used as a *loss term* (gradient through :math:`\log\pi_\theta`, reference detached), with
tokens sampled on-policy, their expected gradients differ, and only one is the gradient
of the reverse KL :math:`\nabla\mathrm{KL}(\pi_\theta\Vert\pi_{ref})
=\mathbb E_{\pi_\theta}[z\,\nabla\ell^\theta]`:

* ``k1``: :math:`\nabla z=\nabla\ell^\theta`, and :math:`\mathbb E_\pi[\nabla\ell^\theta]=0`:
  zero in expectation, **not** the KL gradient (only noise). Put k1 in the *reward*
  (KL-regularized reward, §9) instead.
* ``k2``: :math:`\nabla\tfrac12z^2=z\nabla\ell^\theta`, in expectation exactly the
  reverse-KL gradient.
* ``k3``: :math:`\nabla(e^{-z}-1+z)=(1-\pi_{ref}/\pi_\theta)\nabla\ell^\theta`, in
  expectation :math:`-\sum_y\pi_{ref}(y)\nabla\log\pi_\theta(y)=\nabla\mathrm{KL}
  (\pi_{ref}\Vert\pi_\theta)`: the *forward* KL gradient. This is the term GRPO adds to
  its loss (Shao et al., 2024); its value estimates the reverse KL, its gradient follows the
  forward one.

Peer conventions, each an explicit option of :func:`kl_estimate` (value and gradient):

=====================  ===================================  ================================
option                 value                                gradient w.r.t. ``logp``
=====================  ===================================  ================================
``kind="k3+"``         k3                                   :math:`z` (the k2 gradient):
                                                            :math:`k_2-\mathrm{sg}[k_2]+
                                                            \mathrm{sg}[k_3]`, verl ``k3+``
``kind="k1+"``         k1                                   :math:`z`, verl ``k1+``
``clamp=c``            :math:`\operatorname{clip}(k,-c,c)`  0 where clipped; verl clamps
                                                            its k3 (``low_var_kl``) to
                                                            :math:`[-10,10]`
``old_logp=``          :math:`\rho\,k`,                    :math:`\rho(k+\partial k/\partial
                       :math:`\rho=e^{\ell^\theta-         \ell)`; TRL's
                       \mathrm{sg}[\ell^{old}]}`            ``use_bias_correction_kl``
=====================  ===================================  ================================

The straight-through ``+`` kinds (verl PR 2953) report the k1/k3 value while following the
k2 gradient, whose expectation on-policy is the reverse-KL gradient. The bias correction
(TRL 1.16 ``use_bias_correction_kl``, DeepSeek-V3.2 report) weights the estimate by the
*attached* ratio to the sampling policy: for tokens sampled from :math:`\pi_{old}`,
:math:`\mathbb E_{old}[\nabla(\rho k_3)]=\nabla\,\mathbb E_{\pi_\theta}[k_3]=
\nabla\mathrm{KL}(\pi_\theta\Vert\pi_{ref})`, the unbiased reverse-KL gradient, and this
holds even on-policy where :math:`\rho=1` in value (its gradient is not 0).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _checks

KINDS = ("k1", "k2", "k3", "k1+", "k3+")


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask=None,
    *,
    kind: str = "k1",
    clamp: Optional[float] = None,
    old_logp: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""Per-token sampled estimate of :math:`\mathrm{KL}(\pi\Vert\pi_{ref})` (§9; see the module tables).

    With :math:`z=\ell^\theta-\mathrm{sg}[\ell^{ref}]`:

    .. math::
        k_1=z,\quad k_2=\tfrac12z^2,\quad k_3=e^{-z}-1+z,\quad
        k_{1+}=k_2-\mathrm{sg}[k_2]+\mathrm{sg}[k_1],\quad k_{3+}=k_2-\mathrm{sg}[k_2]+\mathrm{sg}[k_3].

    Then, in this order: ``clamp`` :math:`c` replaces the estimate by
    :math:`\operatorname{clip}(k,-c,c)` (for the ``+`` kinds the reported value is clipped,
    the k2 gradient is not: verl's form), and ``old_logp`` multiplies it by the attached
    ratio :math:`\rho=\exp(\ell^\theta-\mathrm{sg}[\ell^{old}])` (TRL's KL bias correction).

    verl 0.9.1 ``low_var_kl``/``k3`` is ``kind="k3", clamp=10`` exactly (its inner clamp of
    :math:`z` to :math:`[-20,20]` only acts where :math:`k_3>10` already). TRL 1.16's GRPO KL
    with ``use_bias_correction_kl=True`` is ``kind="k3", old_logp=old_logp``.

    Args:
      logp: ``[B, L]`` log-probs of tokens sampled from :math:`\pi` (attached).
      ref_logp: ``[B, L]`` reference log-probs of the same tokens (detached here).
      mask: optional ``[B, L]`` action mask (default: all valid).
      kind: one of :data:`KINDS`.
      clamp: optional :math:`c>0` (finite) bounding the estimate to :math:`[-c, c]`.
      old_logp: optional ``[B, L]`` log-probs under the sampling policy (detached here);
        when given, the estimate is weighted by the attached ratio :math:`\rho`.
    Returns:
      ``[B, L]`` estimates, exactly 0 at masked positions (no gradient there), float32 for
      16-bit inputs. Reduce with :func:`trajgrad.aggregate.aggregate` or put them in the
      reward (detached).
    """
    _checks.check_choice("kind", kind, KINDS)
    if clamp is not None:
        c = float(clamp)
        _checks.check_positive("clamp", c)
        if not math.isfinite(c):
            raise ValueError(f"clamp: must be finite, got {clamp}")
    logp = _checks.as_tensor("logp", logp)
    _checks.check_ndim("logp", logp, 2)
    _checks.check_floating("logp", logp)
    logp = _checks.at_least_float32(logp)  # e^{-z} and the ratio overflow float16 from |z| ~ 11.1
    if mask is None:
        m = torch.ones(logp.shape, dtype=torch.bool, device=logp.device)
    else:
        m = _checks.check_mask("mask", mask, logp.shape)
    lp = _checks.per_token("logp", logp, logp.shape, m)
    ref = _checks.per_token("ref_logp", _checks.as_tensor("ref_logp", ref_logp).detach(), logp.shape, m)
    z = lp - ref
    base = kind.rstrip("+")
    if base == "k1":
        out = z
    elif base == "k2":
        out = 0.5 * z.square()
    else:
        out = torch.expm1(-z) + z
    if clamp is not None:
        out = torch.clamp(out, -c, c)
    if kind.endswith("+"):
        k2 = 0.5 * z.square()
        out = k2 - k2.detach() + out.detach()
    if old_logp is not None:
        old = _checks.per_token("old_logp", _checks.as_tensor("old_logp", old_logp).detach(), logp.shape, m)
        out = out * torch.exp(lp - old)
    return _checks.fill_masked(out, m)


def _check_logits(name: str, x: torch.Tensor, m: torch.Tensor) -> None:
    """NaN or +inf at valid positions raise; -inf (a token outside top-k/top-p) is allowed."""
    if not _checks.values_checked():
        return
    with torch.no_grad():
        bad = (torch.isnan(x) | (x == math.inf)).any(-1) & m
        if bool(bad.any()):
            raise ValueError(f"{name}: contains NaN or +inf at a valid (mask=1) position")
        dead = torch.isneginf(x).all(-1) & m
        if bool(dead.any()):
            raise ValueError(f"{name}: every logit is -inf at a valid (mask=1) position")


def exact_kl(logits_p: torch.Tensor, logits_q: torch.Tensor, mask=None, *, temperature: float = 1.0) -> torch.Tensor:
    r"""Exact per-position :math:`\mathrm{KL}(p\Vert q)=\sum_v p_v(\log p_v-\log q_v)` over the vocabulary (§9, §14).

    :math:`p=\mathrm{softmax}(\text{logits\_p}/T)`, :math:`q=\mathrm{softmax}(\text{logits\_q}/T)`.
    With :math:`p=\pi_\theta` (student) and :math:`q` a teacher or reference this is the
    reverse KL of on-policy distillation (§14), the quantity that the sampled
    :func:`kl_estimate` approximates from one token.

    A plain function of *both* arguments: nothing is detached here. A caller that treats
    one side as a constant (a teacher, a frozen reference) passes it detached.

    Entries with :math:`p_v=0` (logit ``-inf``, e.g. outside a top-k/top-p support)
    contribute 0 by selection; :math:`q_v=0` where :math:`p_v>0` gives ``+inf`` (the KL is
    infinite). Non-negative up to rounding (§24); 0 for equal logits. Cost: a few
    ``[B, L, V]`` temporaries.

    Args:
      logits_p, logits_q: ``[B, L, V]`` logits (same shape).
      mask: optional ``[B, L]``; masked positions give 0 and their logits may be NaN/inf.
      temperature: :math:`T>0` dividing both logits.
    Returns:
      ``[B, L]``.
    """
    logits_p = _checks.as_tensor("logits_p", logits_p)
    _checks.check_ndim("logits_p", logits_p, 3)
    _checks.check_floating("logits_p", logits_p)
    logits_q = _checks.as_tensor("logits_q", logits_q)
    _checks.check_floating("logits_q", logits_q)
    _checks.check_shape("logits_q", logits_q, logits_p.shape, against="logits_p")
    t = float(temperature)
    _checks.check_positive("temperature", t)
    if not math.isfinite(t):
        raise ValueError(f"temperature: must be finite, got {temperature}")
    bl = tuple(logits_p.shape[:2])
    if mask is None:
        m = torch.ones(bl, dtype=torch.bool, device=logits_p.device)
    else:
        m = _checks.check_mask("mask", mask, bl)
    _check_logits("logits_p", logits_p, m)
    _check_logits("logits_q", logits_q, m)
    m3 = m[..., None]
    lp = torch.where(m3, logits_p, torch.zeros((), dtype=logits_p.dtype, device=logits_p.device))
    lq = torch.where(m3, logits_q, torch.zeros((), dtype=logits_q.dtype, device=logits_q.device))
    if t != 1.0:
        lp = lp / t
        lq = lq / t
    log_p = torch.log_softmax(lp, dim=-1)
    log_q = torch.log_softmax(lq, dim=-1)
    p = log_p.exp()
    support = p > 0
    # Outside p's support the difference may be (-inf) - (finite or -inf); select it away.
    diff = torch.where(support, log_p - log_q, torch.zeros_like(log_p))
    kl = (p * diff).sum(-1)
    return _checks.fill_masked(kl, m)


__all__ = ["kl_estimate", "exact_kl", "KINDS"]
