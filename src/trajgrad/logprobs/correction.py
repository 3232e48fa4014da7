r"""Rollout correction: importance weights and masks for the sampler–learner mismatch (spec §7, §16).

Three log-probabilities of each sampled token meet in an update:

* **behaviour** :math:`\mu` — recorded by the engine that sampled, under its own sampling
  transform (``behaviour_logp``);
* **proximal / old** :math:`\pi_{old}` — recomputed by the trainer before the update, with
  the same weights but the learner's kernels, precision and routing (``old_logp``);
* **current** :math:`\pi_\theta` — the log-probs being differentiated (``logp``).

§7: "If MoE routing differs between rollout and learner, the numerator is not the
probability of the same computation." Even with identical weights,
:math:`\pi_{old}\ne\mu`. A correction weight :math:`w` re-weights (or drops) each token so
that the update estimates the gradient under the learner's policy.

**Two modes.**

* ``"decoupled"`` (Hilton et al. 2021, "Batch size-invariance for policy optimization";
  verl's rollout correction): the recipe's ratio is taken against the *proximal* policy,
  :math:`\pi_\theta/\pi_{old}` (clipped as the recipe says), and each token's term is
  multiplied by the detached correction weight computed from
  :math:`\rho=\pi_{old}/\mu`:

  .. math:: \mathcal L=-\operatorname{agg}_t\ \mathrm{sg}[w_t]\;s_t\big(\pi_\theta/\pi_{old}\big).

  Pass ``target_logp = old_logp``.
* ``"bypass"``: no proximal recompute; the recipe's ratio is taken directly against the
  behaviour log-probs, :math:`\pi_\theta/\mu`, so the ratio already carries the
  correction. Only masks apply (MIS bounds, rejection, sequence masking), computed from
  :math:`\rho=\mathrm{sg}[\pi_\theta]/\mu`; the weight is the 0/1 keep mask. Truncated IS
  (``kind="tis"``) is refused in this mode (its weight would count
  :math:`\pi_\theta/\mu` twice). Pass ``target_logp = logp`` (detached here).

**Weights** (``kind``, ``level``), with :math:`z_t=\log\rho_t` at valid tokens:

=========  ===========  ======================================================================
kind       level        weight of token :math:`t` of sequence :math:`i`
=========  ===========  ======================================================================
``tis``    token        :math:`\min(\rho_t, C)` (truncated IS; Ionides 2008; Yao et al. 2025,
                        "Your efficient RL framework secretly brings you off-policy RL")
``tis``    sequence     :math:`\min(\prod_t\rho_t, C)`, the same for every token of :math:`i`
``tis``    geometric    :math:`\min(\bar\rho_i, C)`, :math:`\bar\rho_i` as below (the
                        geometric-mean ratio, truncated)
``mis``    token        :math:`\rho_t\,\mathbb 1[a\le\rho_t\le b]` (masked IS; IcePop, Ling
                        team 2025, bounds :math:`[0.5, 5]`)
``mis``    sequence     :math:`\rho_i\,\mathbb 1[a\le\rho_i\le b]`, :math:`\rho_i=\prod_t\rho_t`
``mis``    geometric    :math:`\bar\rho_i\,\mathbb 1[a\le\bar\rho_i\le b]`,
                        :math:`\bar\rho_i=\exp(\frac1{L_i}\sum_tz_t)` (GSPO's geometric mean,
                        §17: a length-normalized weight, not an unbiased IS weight)
``none``   —            1 (only the masks below)
=========  ===========  ======================================================================

Two-sided TIS (``cap_low`` :math:`c>0`, :math:`c<C`): the tested ratio is clamped to
:math:`[c, C]` instead of :math:`(0, C]`, i.e. :math:`\min(\max(\rho, c), C)` at the
chosen level. MIS takes equal bounds :math:`a=b` (only a ratio exactly :math:`a` is kept).
Worked examples (:math:`z` at one token, log space): ``tis`` with :math:`C=2`,
:math:`c=0.5` maps :math:`\rho=(4, 1, 0.25)` to :math:`(2, 1, 0.5)`; ``tis`` at
``geometric`` level on a row with :math:`z=(\log 4, 0)` gives :math:`\bar\rho=e^{\log 4/2}=2`,
so with :math:`C=1.5` every token's weight is 1.5; ``mis`` with bounds :math:`(1, 1)` on
:math:`\rho=(1, 2)` gives weights :math:`(1, 0)`.

Sequence products are formed in log space (:math:`\min(\rho,C)=e^{\min(z,\log C)}`), so
long responses neither overflow nor underflow to NaN. In bypass mode every weight is
replaced by its keep indicator.

**Rejection** (``reject`` = ``"k1"``/``"k2"``/``"k3"``, ``reject_threshold`` :math:`\kappa`):
the per-token sampled estimate of :math:`\mathrm{KL}(\mu\Vert\pi)` —
:math:`k_1=-z`, :math:`k_2=\frac12z^2`, :math:`k_3=e^{z}-1-z` (Schulman, "Approximating KL
divergence") — is compared with :math:`\kappa`: per token (``reject_level="token"``), or
its mean over the sequence (``"sequence"``, default: the whole response is dropped).

**Off-policy sequence masking** (DeepSeek-V3.2, ``seq_mask_delta`` :math:`\delta`): the
paper's mask is :math:`M_{i,t}=0` where :math:`\hat A_{i,t}<0` and the response's mismatch
:math:`\frac1{L_i}\sum_t(\log\mu_t-\log\pi_t)>\delta`, else 1 (negative updates on
samples the learner would not have produced are the destabilizing ones). Which advantage
is tested is ``advantage_level``:

* ``"token"``: each token's own :math:`\hat A_{i,t}` (token-level advantages, e.g. GAE:
  only the negative tokens of a mismatched row are dropped);
* ``"sequence"``: the row's mean advantage over its valid tokens, :math:`\bar A_i`
  (the whole row is dropped or kept);
* ``"first"``: the advantage at the row's first valid token (the convention of earlier
  releases, kept to reproduce their runs);
* ``None`` (default): ``[B]`` advantages, or ``[B, L]`` ones constant over each row's valid
  tokens, are the sequence's advantage (all four levels agree then); ``[B, L]`` advantages
  that vary within a row are refused (say which level is meant).

Which :math:`\pi` the mismatch is measured against is ``mismatch_policy``: ``"current"``
(the paper: :math:`\mathrm{sg}[\pi_\theta]`; in bypass mode that is ``target_logp``, in
decoupled mode pass ``current_logp``), ``"proximal"`` (:math:`\pi_{old}`, decoupled mode's
``target_logp``), or ``None`` (default): ``target_logp`` as given, i.e. proximal in decoupled
mode and current in bypass mode. Worked example (:math:`\delta=0.1`, one row, two tokens,
:math:`\log\mu-\log\pi=(0.3, 0.1)`, mismatch 0.2 > 0.1, :math:`\hat A=(+1,-1)`):
``"token"`` keeps token 0 and drops token 1; ``"sequence"`` (:math:`\bar A=0`) keeps both;
``"first"`` (:math:`+1`) keeps both; ``None`` refuses the row-varying advantages.

**Numerator and denominator.** A masked or rejected token has weight 0: it leaves the
*numerator*. It stays in the *denominator* when the caller aggregates with the original
action mask (the verl/IcePop convention: the average is still over every sampled token,
the dropped ones contribute 0). To remove dropped tokens from the denominator as well,
aggregate over ``correction.keep`` instead of ``mask`` (:meth:`Correction.denominator_mask`).

All outputs are detached: the correction is evidence, not a parameter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from .. import _checks
from ..turn_stats import group_stats

KINDS = ("tis", "mis", "none")
LEVELS = ("token", "sequence", "geometric")
MODES = ("decoupled", "bypass")
REJECT = ("k1", "k2", "k3")
REJECT_LEVELS = ("token", "sequence")
SEQ_MASK_LEVELS = ("token", "sequence", "first")
MISMATCH_POLICIES = ("current", "proximal")


class Correction(NamedTuple):
    """Result of :func:`rollout_correction`.

    Attributes:
      weight: ``[B, L]`` detached weight; 0 at masked, masked-IS and rejected positions.
      keep: ``[B, L]`` bool, ``mask`` and not dropped.
      metrics: dict of detached 0-D tensors (prefix ``correction/``).
      drops: ``[B, L]`` bool per reason — ``truncated`` (TIS weight at a cap), ``masked``
        (outside the MIS bounds), ``rejected`` (divergence threshold), ``seq_masked``
        (DeepSeek-V3.2) — the sets the ``*_frac`` metrics count (:func:`turn_metrics`).
    """

    weight: torch.Tensor
    keep: torch.Tensor
    metrics: Dict[str, torch.Tensor]
    drops: Optional[Dict[str, torch.Tensor]] = None  # [B, L] bool: truncated, masked, rejected, seq_masked

    def apply(self, per_token: torch.Tensor) -> torch.Tensor:
        """``per_token * weight`` by selection: dropped and masked slots become exactly 0."""
        return torch.where(self.keep, per_token * self.weight.to(per_token.dtype), torch.zeros_like(per_token))

    def denominator_mask(self) -> torch.Tensor:
        """The mask to aggregate with if dropped tokens should leave the denominator too."""
        return self.keep


@dataclass(frozen=True)
class RolloutCorrection:
    """A rollout-correction setting (see the module docstring); ``None`` fields are off.

    Attributes:
      kind: ``"tis"`` | ``"mis"`` | ``"none"``.
      level: ``"token"`` | ``"sequence"`` | ``"geometric"`` (the mean log ratio of the row, TIS and MIS).
      cap: TIS cap :math:`C>0` (default 2, Yao et al.).
      cap_low: TIS lower cap :math:`0<c<C` (two-sided TIS) or ``None`` (one-sided, default).
      bounds: MIS bounds :math:`0\\le a\\le b` (default IcePop's ``(0.5, 5.0)``).
      reject: ``"k1"`` | ``"k2"`` | ``"k3"`` or ``None``; ``reject_threshold`` :math:`\\kappa`.
      reject_level: ``"sequence"`` (default) or ``"token"``.
      seq_mask_delta: DeepSeek-V3.2 :math:`\\delta` or ``None``.
      mode: ``"decoupled"`` (default) or ``"bypass"``.
      advantage_level: ``"token"`` | ``"sequence"`` | ``"first"`` | ``None``: which advantage the
        sequence mask tests (module docstring).
      mismatch_policy: ``"current"`` | ``"proximal"`` | ``None``: which policy the sequence
        mask's mismatch is measured against (module docstring).
    """

    kind: str = "tis"
    level: str = "token"
    cap: float = 2.0
    bounds: Tuple[float, float] = (0.5, 5.0)
    reject: Optional[str] = None
    reject_threshold: Optional[float] = None
    reject_level: str = "sequence"
    seq_mask_delta: Optional[float] = None
    mode: str = "decoupled"
    cap_low: Optional[float] = None
    advantage_level: Optional[str] = None
    mismatch_policy: Optional[str] = None

    def __post_init__(self):
        validate(self)

    def __bool__(self) -> bool:
        """False for the no-op setting (no weight, no mask, decoupled): the correction is off."""
        return not (self.kind == "none" and self.mode == "decoupled" and self.reject is None
                    and self.seq_mask_delta is None)

    @classmethod
    def coerce(cls, value) -> "RolloutCorrection":
        """``None`` (off), a :class:`RolloutCorrection`, or a dict of its fields (a config's
        ``recipe.overrides.rollout_correction``)."""
        if value is None:
            return OFF
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            names = {f for f in cls.__dataclass_fields__}
            unknown = sorted(set(value) - names)
            if unknown:
                raise ValueError(f"rollout_correction: unknown key {unknown[0]!r} (keys: {', '.join(sorted(names))})")
            v = dict(value)
            if "bounds" in v and isinstance(v["bounds"], list):
                v["bounds"] = tuple(v["bounds"])
            return cls(**v)
        raise ValueError(f"rollout_correction: must be None, a RolloutCorrection or a dict of its fields, "
                         f"got {value!r}")

    def __call__(self, behaviour_logp, target_logp, mask, *, advantages=None, current_logp=None) -> Correction:
        return rollout_correction(
            behaviour_logp, target_logp, mask, advantages=advantages, kind=self.kind, level=self.level,
            cap=self.cap, bounds=self.bounds, reject=self.reject, reject_threshold=self.reject_threshold,
            reject_level=self.reject_level, seq_mask_delta=self.seq_mask_delta, mode=self.mode,
            cap_low=self.cap_low, advantage_level=self.advantage_level, mismatch_policy=self.mismatch_policy,
            current_logp=current_logp,
        )

    def describe(self) -> str:
        """One line for ``explain``."""
        if not self:
            return "off"
        if self.kind == "tis" and self.cap_low is not None:
            w = f"two-sided truncated IS min(max(rho, {self.cap_low:g}), {self.cap:g}) at {self.level} level"
        elif self.kind == "tis":
            w = f"truncated IS min(rho, {self.cap:g}) at {self.level} level"
        elif self.kind == "mis":
            a, b = self.bounds
            w = f"masked IS rho*1[{a:g} <= rho <= {b:g}] at {self.level} level"
        else:
            w = "no weight"
        rho = "rho = pi_old/mu" if self.mode == "decoupled" else "rho = sg(pi_theta)/mu, weight = keep mask"
        parts = [f"{self.mode}: {w}; {rho}"]
        if self.reject is not None:
            parts.append(f"reject {self.reject_level}s with {self.reject} > {self.reject_threshold:g}")
        if self.seq_mask_delta is not None:
            parts.append(f"drop A<0 sequences with mean(log mu - log pi) > {self.seq_mask_delta:g}")
            level = {None: "one per sequence ([B, L] must be constant per row)", "token": "per token",
                     "sequence": "the row's mean", "first": "the row's first valid token"}[self.advantage_level]
            policy = self.mismatch_policy or ("proximal" if self.mode == "decoupled" else "current")
            parts.append(f"sequence mask: A {level}, pi = the {policy} policy")
        return "; ".join(parts) + "; dropped tokens stay in the denominator"


def _finite_number(name: str, value) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name}: must be finite, got {value}")
    return v


def validate(c: "RolloutCorrection") -> None:
    _checks.check_choice("kind", c.kind, KINDS)
    _checks.check_choice("level", c.level, LEVELS)
    _checks.check_choice("mode", c.mode, MODES)
    _checks.check_choice("reject_level", c.reject_level, REJECT_LEVELS)
    if c.kind == "tis":
        cap = _finite_number("cap", c.cap)
        _checks.check_positive("cap", cap)
        if c.cap_low is not None:
            low = _finite_number("cap_low", c.cap_low)
            _checks.check_positive("cap_low", low)
            if not low < cap:
                raise ValueError(f"cap_low: must be below cap ({cap:g}), got {low:g}")
        if c.mode == "bypass":
            raise ValueError("mode: truncated IS needs 'decoupled' (in bypass mode the ratio already carries pi/mu)")
    if c.kind == "mis":
        try:
            a, b = c.bounds
        except (TypeError, ValueError):
            raise ValueError(f"bounds: expected (low, high), got {c.bounds!r}") from None
        a, b = _finite_number("bounds", a), _finite_number("bounds", b)
        if not (0.0 <= a <= b) or b == 0.0:
            raise ValueError(f"bounds: need 0 <= low <= high, high > 0, got ({a}, {b})")
    if c.reject is not None:
        _checks.check_choice("reject", c.reject, REJECT)
        if c.reject_threshold is None:
            raise ValueError("reject_threshold: required when reject is set")
        _checks.check_positive("reject_threshold", _finite_number("reject_threshold", c.reject_threshold))
    elif c.reject_threshold is not None:
        raise ValueError("reject_threshold: given without reject ('k1', 'k2' or 'k3')")
    if c.cap_low is not None and c.kind != "tis":
        raise ValueError(f"cap_low: a lower cap of truncated IS (kind 'tis'), given with kind {c.kind!r}")
    if c.seq_mask_delta is not None:
        _checks.check_positive("seq_mask_delta", _finite_number("seq_mask_delta", c.seq_mask_delta), allow_zero=True)
    for name, value, choices in (("advantage_level", c.advantage_level, SEQ_MASK_LEVELS),
                                 ("mismatch_policy", c.mismatch_policy, MISMATCH_POLICIES)):
        if value is not None:
            _checks.check_choice(name, value, choices)
            if c.seq_mask_delta is None:
                raise ValueError(f"{name}: a setting of the sequence mask, given without seq_mask_delta")
    if c.mismatch_policy == "proximal" and c.mode == "bypass":
        raise ValueError("mismatch_policy: 'proximal' needs mode 'decoupled' (bypass mode has no proximal policy)")


def rollout_correction(
    behaviour_logp: torch.Tensor,
    target_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    advantages: Optional[torch.Tensor] = None,
    kind: str = "tis",
    level: str = "token",
    cap: float = 2.0,
    bounds: Tuple[float, float] = (0.5, 5.0),
    reject: Optional[str] = None,
    reject_threshold: Optional[float] = None,
    reject_level: str = "sequence",
    seq_mask_delta: Optional[float] = None,
    mode: str = "decoupled",
    cap_low: Optional[float] = None,
    advantage_level: Optional[str] = None,
    mismatch_policy: Optional[str] = None,
    current_logp: Optional[torch.Tensor] = None,
) -> Correction:
    r"""Detached rollout-correction weights and keep mask (see the module docstring for the formulas).

    Args:
      behaviour_logp: ``[B, L]`` log-probs recorded at sampling, :math:`\log\mu`.
      target_logp: ``[B, L]`` :math:`\log\pi_{old}` (decoupled) or the current
        :math:`\log\pi_\theta` (bypass); detached here.
      mask: ``[B, L]`` action mask.
      advantages: ``[B]`` or ``[B, L]``, tested at ``advantage_level`` (module docstring);
        required with ``seq_mask_delta``.
      current_logp: ``[B, L]`` current :math:`\log\pi_\theta` (detached here), required with
        ``mismatch_policy="current"`` in decoupled mode.
      kind, level, cap, cap_low, bounds, reject, reject_threshold, reject_level, seq_mask_delta,
        mode, advantage_level, mismatch_policy: see :class:`RolloutCorrection`.

    Returns:
      :class:`Correction` ``(weight, keep, metrics)``. Metrics (``correction/`` prefix):
      ``weight/mean|min|max`` (over valid tokens, dropped ones at 0), ``ess`` (Kish
      effective sample size of the weights divided by the number of valid tokens, in
      :math:`(0, 1]`), ``truncated_frac`` (TIS: :math:`\rho>C`), ``masked_frac`` (MIS bounds),
      ``rejected_frac`` (divergence threshold), ``seq_masked_frac`` (DeepSeek-V3.2), all
      fractions of valid tokens, ``kept_frac``, and the mismatch ``kl/k1``
      :math:`=\overline{-z}` and ``kl/k3`` :math:`=\overline{e^z-1-z}` of
      :math:`\mathrm{KL}(\mu\Vert\pi)` over valid tokens.
    """
    cfg = RolloutCorrection(kind, level, cap, bounds, reject, reject_threshold, reject_level, seq_mask_delta, mode,
                            cap_low, advantage_level, mismatch_policy)
    beh = _checks.as_tensor("behaviour_logp", behaviour_logp).detach()
    _checks.check_ndim("behaviour_logp", beh, 2)
    _checks.check_floating("behaviour_logp", beh)
    mb = _checks.check_mask("mask", mask, beh.shape)
    beh = _checks.per_token("behaviour_logp", beh, beh.shape, mb)
    tgt = _checks.as_tensor("target_logp", target_logp).detach()
    tgt = _checks.per_token("target_logp", tgt, beh.shape, mb)
    dt = torch.promote_types(beh.dtype, tgt.dtype)
    if dt not in (torch.float32, torch.float64):
        dt = torch.float32
    z = (tgt.to(dt) - beh.to(dt))  # 0 at masked positions
    with torch.no_grad():
        mf = mb.to(dt)
        lengths = mf.sum(-1)
        nonempty = lengths > 0
        n = lengths.sum()
        d = n.clamp_min(1.0)
        zero_b = torch.zeros(beh.shape, dtype=torch.bool, device=beh.device)
        seq_z = z.sum(-1)  # log prod rho
        geo_z = seq_z / lengths.clamp_min(1.0)
        truncated = masked = rejected = seq_masked = zero_b

        # weights (decoupled) -------------------------------------------------------
        if cfg.kind == "tis":
            log_c = math.log(cfg.cap)
            zz = {"token": z, "sequence": seq_z[:, None].expand_as(z), "geometric": geo_z[:, None].expand_as(z)}[
                cfg.level
            ]
            log_low = None if cfg.cap_low is None else math.log(cfg.cap_low)
            truncated = ((zz > log_c) | ((zz < log_low) if log_low is not None else False)) & mb
            weight = torch.exp(torch.clamp(zz, min=log_low, max=log_c))
        elif cfg.kind == "mis":
            a, b = (float(v) for v in cfg.bounds)
            log_a = math.log(a) if a > 0 else -math.inf
            log_b = math.log(b)
            test = {"token": z, "sequence": seq_z[:, None].expand_as(z), "geometric": geo_z[:, None].expand_as(z)}[
                cfg.level
            ]
            inside = (test >= log_a) & (test <= log_b)
            masked = ~inside & mb
            # the weight is the tested ratio itself; inside the bounds it is at most b, and
            # the clamp only keeps e^z finite where the token is dropped anyway
            weight = torch.exp(torch.clamp(test, max=log_b))
            weight = torch.where(inside, weight, torch.zeros_like(weight))
        else:
            weight = torch.ones_like(z)

        # rejection on a divergence estimate ---------------------------------------
        if cfg.reject is not None:
            if cfg.reject == "k1":
                k = -z
            elif cfg.reject == "k2":
                k = 0.5 * z * z
            else:
                k = torch.expm1(z) - z
            if cfg.reject_level == "token":
                rejected = (k > float(cfg.reject_threshold)) & mb
            else:
                seq_k = (k * mf).sum(-1) / lengths.clamp_min(1.0)
                rejected = (seq_k > float(cfg.reject_threshold))[:, None] & mb

        # DeepSeek-V3.2 off-policy sequence masking ----------------------------------
        if cfg.seq_mask_delta is not None:
            if advantages is None:
                raise ValueError("advantages: required with seq_mask_delta (only A < 0 sequences are masked)")
            negative = _negative_advantage(advantages, mb, cfg.advantage_level)
            if cfg.mismatch_policy == "current" and cfg.mode == "decoupled":
                if current_logp is None:
                    raise ValueError("current_logp: required with mismatch_policy 'current' in decoupled mode")
                cur = _checks.as_tensor("current_logp", current_logp).detach()
                cur = _checks.per_token("current_logp", cur, beh.shape, mb).to(dt)
                mismatch = -(cur - beh.to(dt)).sum(-1) / lengths.clamp_min(1.0)
            else:
                mismatch = -geo_z  # mean(log mu - log pi), pi = target_logp
            seq_masked = negative & ((mismatch > float(cfg.seq_mask_delta)) & nonempty)[:, None] & mb

        keep = mb & ~masked & ~rejected & ~seq_masked
        if cfg.mode == "bypass":
            weight = keep.to(dt)
        else:
            weight = torch.where(keep, weight, torch.zeros_like(weight))

        def frac(sel: torch.Tensor) -> torch.Tensor:
            return sel.sum().to(dt) / d

        has = n > 0
        one = torch.ones((), dtype=dt, device=z.device)
        big = torch.full_like(weight, math.inf)
        wmin = torch.where(mb, weight, big).amin() if weight.numel() else one
        wmax = torch.where(mb, weight, -big).amax() if weight.numel() else one
        w_sum = weight.sum()
        w_sq = (weight * weight).sum()
        ess = torch.where(w_sq > 0, w_sum * w_sum / w_sq.clamp_min(torch.finfo(dt).tiny) / d, torch.zeros((), dtype=dt))
        metrics = {
            "correction/weight/mean": torch.where(has, w_sum / d, one),
            "correction/weight/min": torch.where(has, wmin, one),
            "correction/weight/max": torch.where(has, wmax, one),
            "correction/ess": torch.where(has, ess, one),
            "correction/truncated_frac": frac(truncated),
            "correction/masked_frac": frac(masked),
            "correction/rejected_frac": frac(rejected),
            "correction/seq_masked_frac": frac(seq_masked),
            "correction/kept_frac": torch.where(has, frac(keep), one),
            "correction/kl/k1": -z.sum() / d,
            "correction/kl/k3": (torch.expm1(z) - z).sum() / d,
        }
    drops = {"truncated": truncated, "masked": masked, "rejected": rejected, "seq_masked": seq_masked}
    return Correction(weight.detach(), keep, metrics, drops)


def _negative_advantage(advantages, mb: torch.Tensor, level: Optional[str]) -> torch.Tensor:
    """``[B, L]`` bool: where the sequence mask's advantage is negative, at ``level`` (module docstring)."""
    adv = _checks.as_tensor("advantages", advantages).detach()
    _checks.check_ndim("advantages", adv, (1, 2))
    per_row = adv.ndim == 1
    adv = _checks.per_token("advantages", adv, mb.shape, mb, allow_per_sequence=True)
    if level == "token":
        return adv < 0
    if mb.shape[-1] == 0:
        return torch.zeros(mb.shape, dtype=torch.bool, device=mb.device)
    first = mb.to(torch.int8).argmax(-1)
    first_adv = adv.gather(1, first[:, None])  # [B, 1]
    if level is None and not per_row and bool(((adv != first_adv) & mb).any()):
        raise ValueError("advantages: [B, L] advantages vary within a row; give advantage_level 'token' or "
                         "'sequence' for the off-policy sequence mask")
    if level == "sequence":
        row = adv.sum(-1, keepdim=True) / mb.sum(-1, keepdim=True).clamp_min(1).to(adv.dtype)
    else:  # "first", or None with one advantage per row
        row = first_adv
    return (row < 0).expand(mb.shape)


def turn_metrics(corr: Correction, behaviour_logp: torch.Tensor, target_logp: torch.Tensor, mask: torch.Tensor,
                 turn_ids: torch.Tensor, *, prefix: str = "correction/") -> Dict[str, float]:
    r"""The correction's metrics restricted to each turn's action tokens (§16).

    For each turn index :math:`k` present at a valid token, over the tokens :math:`T_k` of
    that turn: ``{prefix}turn{k}/weight/mean|min|max``; ``ess`` :math:`=(\sum w)^2/\sum w^2/|T_k|`
    (Kish); ``kept_frac`` and ``dropped_frac``; each reason separately — ``truncated_frac``
    (TIS, :math:`\rho>C`), ``masked_frac`` (MIS bounds), ``rejected_frac`` (divergence
    threshold), ``seq_masked_frac`` (DeepSeek-V3.2), as fractions of :math:`|T_k|` (0 where
    the setting does not use that reason); and ``kl/k1`` :math:`=\overline{-z}`,
    ``kl/k3`` :math:`=\overline{e^z-1-z}`, :math:`z=\log\pi_{target}-\log\mu`. Computed
    in one scatter pass per quantity (:func:`trajgrad.turn_stats.group_stats`); detached.

    Args:
      corr: the :class:`Correction` of ``(behaviour_logp, target_logp, mask)``.
      behaviour_logp, target_logp: ``[B, L]`` as given to :func:`rollout_correction`.
      mask: ``[B, L]`` action mask; turn_ids: ``[B, L]`` integer turn index of each token.
    """

    mb = _checks.check_mask("mask", mask)
    if corr.drops is None:
        raise ValueError("corr: has no per-reason drop masks (build it with rollout_correction)")
    with torch.no_grad():
        beh = torch.where(mb, _checks.as_tensor("behaviour_logp", behaviour_logp).detach().double(), 0.0)
        tgt = torch.where(mb, _checks.as_tensor("target_logp", target_logp).detach().double(), 0.0)
        z = tgt - beh
        w = corr.weight.detach().double()
        vals = {"w": w, "w2": w * w, "keep": corr.keep.double(), "k1": -z, "k3": torch.expm1(z) - z}
        vals.update({r: corr.drops[r].double() for r in ("truncated", "masked", "rejected", "seq_masked")})
        ids, n, sums, mins, maxs = group_stats(vals, mb, turn_ids, extrema=("w",))
    out: Dict[str, float] = {}
    for j, k in enumerate(ids):
        p, nj = f"{prefix}turn{k}/", float(n[j])
        sw, sq = float(sums["w"][j]), float(sums["w2"][j])
        kept = float(sums["keep"][j]) / nj
        out.update({p + "weight/mean": sw / nj, p + "weight/min": float(mins["w"][j]),
                    p + "weight/max": float(maxs["w"][j]), p + "ess": sw * sw / sq / nj if sq > 0 else 0.0,
                    p + "kept_frac": kept, p + "dropped_frac": 1.0 - kept,
                    p + "kl/k1": float(sums["k1"][j]) / nj, p + "kl/k3": float(sums["k3"][j]) / nj})
        for r in ("truncated", "masked", "rejected", "seq_masked"):
            out[p + r + "_frac"] = float(sums[r][j]) / nj
    return out


OFF = RolloutCorrection(kind="none")  # the no-op setting: Objective's default ("None = off")

__all__ = ["OFF", "Correction", "RolloutCorrection", "rollout_correction", "turn_metrics", "KINDS", "LEVELS", "MODES",
           "REJECT", "SEQ_MASK_LEVELS", "MISMATCH_POLICIES"]
