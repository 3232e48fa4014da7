r"""Input preparation, aggregation and cheap metrics shared by the policy losses.

Speed without giving up the masking rule. On CPU, ``torch.where`` with a boolean
condition and ``torch.isfinite`` cost 10–25 elementwise multiplications each at
``[64, 4096]``, so a loss that selects every input and checks every value costs several
times the spec's four-line code. This module takes a *fast path* that is exact:

1. One sum per input over the *whole* tensor (valid and masked slots) tells whether
   every stored value is finite (a NaN or ±inf anywhere makes the sum non-finite; a sum
   that overflows from finite values only sends us to the slow path, never wrongly
   to the fast one). A loss whose metrics are means of its inputs asks for
   ``valid_sums``: the check is then one dot product per input with the 0/1 mask, which
   is non-finite under the same condition (IEEE: :math:`\mathrm{NaN}\cdot0=\pm\infty\cdot0
   =\mathrm{NaN}`) and *is* the sum over the valid tokens the metrics need.
2. If every value is finite, ``x * mask`` equals ``torch.where(mask, x, 0)`` exactly, in
   value and in gradient (the gradient of a product with a 0/1 constant is that 0/1
   constant), so inputs are zeroed at masked slots by multiplication. The masking rule of
   DESIGN.md ("never multiply a maybe-infinite value by 0") holds: the values are known to
   be finite.
3. Otherwise (NaN/inf somewhere) the inputs are validated position by position (a
   non-finite value at a *valid* position raises ``ValueError`` naming the argument) and
   zeroed by selection, as before.

A float mask is checked to be 0/1 in two passes: :math:`\sum_j t_j^2 = 0` with
:math:`t_j=m_j(1-m_j)`, a sum of non-negative terms, each 0 exactly when :math:`m_j\in\{0,1\}`
(no cancellation: a value :math:`\delta` away from 0 or 1 is found for any
:math:`\delta>10^{-19}` in float32; NaN and ±inf make the sum NaN or inf).

**Dtype.** 16-bit log-probs (float16, bfloat16) are cast to float32 (an attached cast, so
the gradient flows back in the input's dtype) before anything else: every loss forms
ratios :math:`e^{z}`, which overflow float16 from :math:`z\approx11.1`. The loss and its
metrics are then float32; float32 and float64 inputs keep their dtype.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from .. import _checks
from .._aggregation import MODES, check_denominator, normalizer, numerator, validate_mode
from .._policy_stats import _fast_policy_metrics


class Inputs:
    """Validated inputs of a policy loss (see the module docstring).

    ``logp`` and ``behaviour`` (exactly 0 at masked slots) and the bool ``mask`` are formed
    on first use; on the fast path the losses avoid them with :meth:`log_ratio` and
    :attr:`logp_factor`.
    """

    __slots__ = ("raw_logp", "maskf", "_advantages", "raw_behaviour", "lengths", "tokens", "adv_seq", "finite",
                 "_mask", "_logp", "_behaviour", "_z", "sums", "rows", "zd", "raw_advantages", "scratch")

    def __init__(self, raw_logp, mask, maskf, advantages, raw_behaviour, lengths, tokens, adv_seq, finite,
                 logp=None, behaviour=None, sums=None, rows=None, zd=None, raw_advantages=None, scratch=None):
        self.raw_logp = raw_logp  # [B, L] attached; finite everywhere when ``finite``
        self.maskf = maskf  # [B, L] 0/1 in logp's dtype
        # [B, L] detached, exactly 0 at masked slots (None: formed on first use from adv_seq or raw_advantages)
        self._advantages = advantages
        # [B, L] detached advantages as given, finite everywhere (the fast path), or None
        self.raw_advantages = raw_advantages
        # a [B, L] buffer of logp's dtype that nothing refers to (left by the mask check), or None
        self.scratch = scratch
        self.raw_behaviour = raw_behaviour  # [B, L] detached or None
        self.lengths = lengths  # [B] valid tokens per row
        self.tokens = tokens  # 0-D valid-token count
        self.adv_seq = adv_seq  # [B] when advantages were given per sequence
        self.finite = finite  # every stored value of every input is finite (the fast path)
        self._mask = mask
        self._logp = logp
        self._behaviour = behaviour
        self._z = None
        # detached 0-D sums over the valid tokens ("logp", "advantages", "behaviour"), by the
        # finiteness check on the fast path with valid_sums (None otherwise)
        self.sums = sums
        # detached [B] row sums of the log ratio over the valid tokens, by the finiteness check on the
        # fast path with row_ratio (None otherwise)
        self.rows = rows
        # detached [B, L] log ratio, exactly 0 at masked slots, formed by the check with log_ratio_sum
        # (its valid sum is ``sums["log_ratio"]``; None otherwise)
        self.zd = zd

    @property
    def advantages(self) -> torch.Tensor:
        """``[B, L]`` detached advantages, exactly 0 at masked slots."""
        if self._advantages is None:
            if self.raw_advantages is not None:
                self._advantages = torch.mul(self.raw_advantages, self.maskf, out=self.take_scratch())
            else:
                self._advantages = self.adv_seq[:, None] * self.maskf
        return self._advantages

    def take_scratch(self) -> Optional[torch.Tensor]:
        """The free ``[B, L]`` buffer (once; None afterwards or when there is none): writing a result
        into memory that was just read costs less than a fresh allocation."""
        buf, self.scratch = self.scratch, None
        return buf

    @property
    def mask(self) -> torch.Tensor:
        """``[B, L]`` bool action mask."""
        if self._mask is None:
            self._mask = self.maskf.bool()
        return self._mask

    @property
    def logp(self) -> torch.Tensor:
        """``[B, L]`` attached log-probs, exactly 0 at masked slots."""
        if self._logp is None:
            self._logp = self.raw_logp * self.maskf
        return self._logp

    @property
    def behaviour(self) -> Optional[torch.Tensor]:
        """``[B, L]`` detached ratio log-probs, exactly 0 at masked slots (or None)."""
        if self._behaviour is None and self.raw_behaviour is not None:
            self._behaviour = self.raw_behaviour * self.maskf
        return self._behaviour

    @property
    def logp_factor(self) -> torch.Tensor:
        """Log-probs to multiply by a coefficient that is exactly 0 at masked slots.

        On the fast path the raw (finite) log-probs: ``0 * finite`` is 0 in value and gradient.
        """
        return self.raw_logp if self.finite else self.logp

    def valid_total(self, key: str) -> torch.Tensor:
        """Detached sum over the valid tokens of ``"logp"``, ``"advantages"`` or ``"behaviour"``
        (formed by the check with ``prepare(..., valid_sums=True)``, else summed here)."""
        if self.sums is not None and key in self.sums:
            return self.sums[key]
        with torch.no_grad():
            t = {"logp": self.logp, "advantages": self.advantages, "behaviour": self.behaviour}[key]
            return t.detach().sum()

    def row_log_ratio(self) -> torch.Tensor:
        r"""``[B]`` attached :math:`\sum_t(\ell^\theta_t-\mathrm{sg}[\ell^{old}_t])` over each row's valid
        tokens (the difference is formed first: no cancellation between two large sums)."""
        if self.rows is not None:
            return _RowSum.apply(self.raw_logp, self.rows, self.maskf)
        if self.finite and self._z is None:
            return torch.linalg.vecdot(self.raw_logp - self.raw_behaviour, self.maskf)
        return self.log_ratio().sum(-1)

    def log_ratio(self) -> torch.Tensor:
        r"""``[B, L]`` attached :math:`\ell^\theta-\mathrm{sg}[\ell^{old}]`, exactly 0 at masked slots."""
        if self._z is None:
            if self.finite:
                self._z = (self.raw_logp - self.raw_behaviour).mul_(self.maskf)
            else:
                self._z = self.logp - self.behaviour
        return self._z


class _RowSum(torch.autograd.Function):
    r"""``[B]`` row sums over valid tokens formed by the caller (``rows``, detached), attached to ``logp``:
    the gradient of :math:`\sum_t m_t\ell_t` is :math:`g_i m_t`."""

    @staticmethod
    def forward(ctx, logp, rows, maskf):
        ctx.save_for_backward(maskf)
        return rows.clone()

    @staticmethod
    def backward(ctx, g):
        (maskf,) = ctx.saved_tensors
        return maskf * g[:, None], None, None


class SequenceTerm(torch.autograd.Function):
    r"""A scalar :math:`\mathcal L` whose gradient is :math:`c_i m_{i,t}` for a ``[B]`` coefficient ``coef``
    (one autograd node for a loss that depends on ``logp`` only through its valid row sums:
    :math:`c_i=\partial\mathcal L/\partial\sum_t m_{i,t}\ell_{i,t}`). ``value``, ``coef`` and ``maskf``
    are detached and computed by the caller."""

    @staticmethod
    def forward(ctx, logp, value, coef, maskf):
        ctx.save_for_backward(coef, maskf)
        return value.clone()

    @staticmethod
    def backward(ctx, g):
        coef, maskf = ctx.saved_tensors
        return maskf * (coef * g)[:, None], None, None, None


def _as_mask(mask, shape, dtype) -> tuple:
    """``(bool mask or None, float mask, [B] row counts, scratch)``; a non-bool mask is checked to be 0/1
    (see the module docstring); the row counts of the check are the lengths; ``scratch`` is the check's
    ``[B, L]`` buffer (free after it) or None."""
    mask = _checks.as_tensor("mask", mask)
    _checks.check_shape("mask", mask, shape)
    if mask.dtype == torch.bool:
        mf = mask.to(dtype)
        return mask, mf, mf.sum(-1), None
    mf = mask.to(dtype)
    lengths = mf.sum(-1)
    scratch = None
    if _checks.values_checked() and mf.numel():
        # sum_j t_j^2 with t_j = m_j - m_j^2 = m_j(1 - m_j): every term is >= 0 and 0 exactly for m_j in {0, 1},
        # so the sum is 0 iff the mask is 0/1 (no cancellation; NaN and inf make it NaN or inf)
        scratch = torch.addcmul(mf, mf, mf, value=-1.0)
        t = scratch.reshape(-1)
        if float(torch.dot(t, t)) != 0.0:
            _checks.check_mask("mask", mask)  # raises with the offending value
            raise ValueError("mask: must contain only 0 and 1")
    return None, mf, lengths, scratch


def prepare(
    logp,
    mask,
    advantages,
    *,
    aggregation: str,
    behaviour=None,
    behaviour_name: Optional[str] = None,
    advantages_name: str = "advantages",
    valid_sums: bool = False,
    row_ratio: bool = False,
    log_ratio_sum: bool = False,
) -> Inputs:
    r"""Validate and sanitize the inputs of a policy loss (see the module docstring).

    ``valid_sums``: make the finiteness check the valid-token sums (:meth:`Inputs.valid_total`).
    ``row_ratio`` (with a behaviour input): make the check of ``logp`` and the behaviour log-probs
    the row sums :math:`\sum_t m_t(\ell_t-\ell^{b}_t)` (:attr:`Inputs.rows`): a difference is finite
    only when both terms are, and a non-finite product with the 0/1 mask makes its row sum non-finite.
    ``log_ratio_sum`` (with a behaviour input): the difference is formed in the mask check's buffer and
    masked in place (a non-finite value anywhere stays non-finite: :math:`\mathrm{NaN}\cdot0=\infty\cdot0
    =\mathrm{NaN}`), so its sum is both the check and the valid sum of the log ratio
    (``sums["log_ratio"]``); it is kept as :attr:`Inputs.zd`.
    """
    _checks.check_choice("aggregation", aggregation, MODES)
    logp = _checks.as_tensor("logp", logp)
    _checks.check_ndim("logp", logp, 2)
    _checks.check_floating("logp", logp)
    logp = _checks.at_least_float32(logp)  # ratios e^z overflow float16 from z ~ 11.1
    shape = tuple(logp.shape)
    mb, mf, lengths, scratch = _as_mask(mask, shape, logp.dtype)
    adv = _checks.as_tensor(advantages_name, advantages).detach()
    _checks.check_ndim(advantages_name, adv, (1, 2))
    _checks.check_floating(advantages_name, adv)
    if adv.ndim == 1:
        _checks.check_shape(advantages_name, adv, shape[:1])
    else:
        _checks.check_shape(advantages_name, adv, shape, against="mask")
    beh = None
    if behaviour_name is not None:
        if behaviour is None:
            raise ValueError(f"{behaviour_name}: required, got None")
        beh = _checks.as_tensor(behaviour_name, behaviour).detach()
        _checks.check_floating(behaviour_name, beh)
        _checks.check_shape(behaviour_name, beh, shape, against="mask")
        beh = beh.to(logp.dtype)
    adv = adv.to(logp.dtype)
    with torch.no_grad():
        sums = rows = zd = None
        if log_ratio_sum and beh is not None:
            # into the mask check's buffer, when there is one; masked in place: a non-finite value anywhere
            # stays non-finite (NaN * 0 = inf * 0 = NaN), so the sum is the check and the valid sum at once
            zd = torch.sub(logp.detach(), beh, out=scratch).mul_(mf)
            scratch = None
            sums = {"log_ratio": zd.sum()}
            checks = [sums["log_ratio"], adv.sum()]
        elif row_ratio and beh is not None:
            rows = torch.linalg.vecdot(logp.detach() - beh, mf)
            checks = [rows.sum(), adv.sum()]
        elif valid_sums:
            # each product is non-finite iff a stored value is (valid or masked slot): the check and the valid sums
            flat_m = mf.reshape(-1)
            sums = {"logp": torch.dot(logp.detach().reshape(-1), flat_m),
                    "advantages": torch.dot(adv, lengths) if adv.ndim == 1 else torch.dot(adv.reshape(-1), flat_m)}
            if beh is not None:
                sums["behaviour"] = torch.dot(beh.reshape(-1), flat_m)
            checks = list(sums.values())
        else:
            checks = [logp.detach().sum(), adv.sum()] + ([beh.sum()] if beh is not None else [])
        # each sum read as a Python float (a read costs less than adding 0-D tensors)
        finite = all(math.isfinite(float(c)) for c in checks)
    if finite:
        tokens = lengths.sum()
        if adv.ndim == 1:
            return Inputs(logp, mb, mf, None, beh, lengths, tokens, adv, True, sums=sums, rows=rows, zd=zd)
        return Inputs(logp, mb, mf, None, beh, lengths, tokens, None, True, sums=sums, rows=rows, zd=zd,
                      raw_advantages=adv, scratch=scratch)
    mb = mf.bool() if mb is None else mb
    logp_s = _checks.per_token("logp", logp, shape, mb)
    adv_seq = None
    if adv.ndim == 1:
        _checks.check_finite(advantages_name, adv, mb.any(-1))
        adv_seq = _checks.fill_masked(adv, mb.any(-1))
        adv_s = _checks.fill_masked(adv_seq[:, None].expand(shape), mb)
    else:
        adv_s = _checks.per_token(advantages_name, adv, shape, mb)
    beh_s = None if beh is None else _checks.per_token(behaviour_name, beh, shape, mb)
    return Inputs(logp_s, mb, mf, adv_s, beh_s, lengths, lengths.sum(), adv_seq, False, logp=logp_s,
                  behaviour=beh_s)


def _denominator(denominator, dtype, device) -> Optional[torch.Tensor]:
    if denominator is None:
        return None
    return check_denominator(denominator, dtype, device)


def check_aggregation(mode: str, constant: Optional[float]) -> None:
    validate_mode(mode, constant)
    if constant is not None and not math.isfinite(float(constant)):
        raise ValueError(f"constant: must be finite, got {constant}")


def aggregate_tokens(
    term: torch.Tensor, x: Inputs, mode: str, *, constant=None, denominator=None
) -> torch.Tensor:
    """:func:`trajgrad.aggregate.aggregate` for a ``[B, L]`` term that is already 0 at masked slots."""
    check_aggregation(mode, constant)
    num = numerator(mode, row_means=lambda: (term.sum(-1) / x.lengths.clamp_min(1)).sum(), total=term.sum,
                    width=term.shape[-1], constant=constant)
    return num / _count(x, mode, denominator, term)


def aggregate_sequences(
    per_seq: torch.Tensor, x: Inputs, mode: str, *, constant=None, denominator=None
) -> torch.Tensor:
    """Aggregate of the ``[B, L]`` term equal to ``per_seq[i]`` at every valid token of row ``i``.

    ``per_seq`` must be 0 on rows with no valid token. Equal in value and gradient to
    :func:`aggregate_tokens` on ``per_seq[:, None] * mask``, without forming it.
    """
    check_aggregation(mode, constant)
    num = numerator(mode, row_means=per_seq.sum, total=lambda: (per_seq * x.lengths).sum(), width=x.mask.shape[-1],
                    constant=constant)
    return num / _count(x, mode, denominator, per_seq)


def _count(x: Inputs, mode: str, denominator, like: torch.Tensor) -> torch.Tensor:
    return normalizer(mode, denominator, like, tokens=lambda: x.tokens, rows=lambda: (x.lengths > 0).sum())


def linear_in_logp(coef: torch.Tensor, x: Inputs, mode: str, *, weights=None, constant=None,
                   denominator=None) -> torch.Tensor:
    r""":math:`-\operatorname{agg}(c\cdot\ell^\theta)` for a coefficient ``coef`` exactly 0 at
    masked slots, by dot products: no ``[B, L]`` term is formed, and the backward pass is
    the single product :math:`-c\,g/D`.

    Equal in value and gradient to ``-aggregate_tokens(coef * x.logp_factor, ...)``.
    ``weights`` (from :func:`token_weights`) multiply ``coef`` (a detached ``coef`` is
    scaled in place: pass one the caller owns).
    """
    check_aggregation(mode, constant)
    if weights is not None:
        coef = coef.mul_(weights) if not coef.requires_grad else coef * weights
    lp = x.logp_factor
    if mode == "seq_mean_token_mean":
        numerator = (torch.linalg.vecdot(coef, lp) / x.lengths.clamp_min(1)).sum()
    else:
        numerator = torch.dot(coef.reshape(-1), lp.reshape(-1))
        if mode == "seq_sum_constant":
            numerator = numerator / (float(constant) if constant is not None else float(lp.shape[-1]))
    return -(numerator / _count(x, mode, denominator, lp))


def sequence_advantages(x: Inputs, name: str = "advantages", loss: str = "GSPO") -> torch.Tensor:
    """``[B]`` advantage of each sequence (0 on empty rows); raises unless constant per sequence."""
    if x.adv_seq is not None:
        return x.adv_seq * (x.lengths > 0).to(x.adv_seq.dtype)
    adv = x.advantages
    first = x.mask.to(torch.int8).argmax(-1) if adv.shape[-1] else torch.zeros(adv.shape[0], dtype=torch.long)
    seq = adv.gather(1, first[:, None]).squeeze(1) if adv.shape[-1] else adv.new_zeros(adv.shape[0])
    if _checks.values_checked() and adv.shape[-1]:
        dev = ((adv - seq[:, None]) * x.maskf).abs().amax(-1)
        tol = 1e-6 * (1.0 + seq.abs())
        if bool((dev > tol).any()):
            raise ValueError(
                f"{name}: {loss} needs one advantage per sequence ([B], or [B, L] constant over "
                "each sequence's valid tokens); use a token-level loss for per-token advantages"
            )
    return seq


def ratio_metrics(
    z: torch.Tensor,
    x: Inputs,
    *,
    ratio: Optional[torch.Tensor] = None,
    lo_b: Optional[float] = None,
    hi_b: Optional[float] = None,
    prefix: str = "",
    sum_z: Optional[torch.Tensor] = None,
    em1: Optional[torch.Tensor] = None,
    sum_em1: Optional[torch.Tensor] = None,
    extrema: Optional[tuple] = None,
    means: Optional[Dict[str, object]] = None,
) -> Dict[str, torch.Tensor]:
    """The :func:`trajgrad.diagnostics.policy_metrics` keys for a sanitized log ratio.

    ``z`` is ``[B, L]``, detached, exactly 0 at masked positions. What the caller has formed saves a
    pass: ``ratio`` (its exponential), ``sum_z`` (its sum), ``em1`` (``expm1(z)``, not modified) or
    ``sum_em1`` (the sum of that), ``extrema`` (its min and max). Clip fractions are added when
    ``lo_b``/``hi_b`` are given; ``means`` adds keys given as valid-token sums, reported as means
    (see :func:`trajgrad._policy_stats._fast_policy_metrics`).
    """
    return _fast_policy_metrics(
        z, x.advantages if lo_b is not None else None, None, x.maskf, x.tokens, ratio=ratio, lo_b=lo_b, hi_b=hi_b,
        prefix=prefix, sum_z=sum_z, em1=em1, sum_em1=sum_em1, extrema=extrema, means=means,
    )




def token_weights(weights, x: Inputs, name: str = "weights") -> Optional[torch.Tensor]:
    """Validate optional per-token weights ``[B, L]`` (detached, finite at valid slots; 0 where masked)."""
    if weights is None:
        return None
    w = _checks.as_tensor(name, weights).detach()
    _checks.check_floating(name, w)
    _checks.check_shape(name, w, tuple(x.mask.shape), against="mask")
    w = w.to(x.logp.dtype)
    if bool(torch.isfinite(w.sum())):
        return w * x.maskf
    _checks.check_finite(name, w, x.mask)
    return _checks.fill_masked(w, x.mask)


def valid_sum(t: torch.Tensor, x: Inputs) -> torch.Tensor:
    """Sum of a detached ``[B, L]`` tensor over valid slots (``t`` finite on the fast path)."""
    if x.finite:
        return torch.dot(t.reshape(-1), x.maskf.reshape(-1).to(t.dtype))
    return _checks.fill_masked(t, x.mask).sum()


def weighted(term: torch.Tensor, w: Optional[torch.Tensor]) -> torch.Tensor:
    """``term * w`` (``w`` from :func:`token_weights`, finite), or ``term`` when ``w`` is None."""
    return term if w is None else term * w


WEIGHTS_DOC = """weights: optional ``[B, L]`` per-token multiplier of the per-token term before
        aggregation (detached; e.g. :attr:`trajgrad.logprobs.correction.Correction.weight`). A token
        with weight 0 leaves the numerator but keeps its place in the denominator."""

__all__ = ["Inputs", "SequenceTerm", "prepare", "aggregate_tokens", "aggregate_sequences", "sequence_advantages", "ratio_metrics",
           "token_weights", "weighted", "valid_sum", "linear_in_logp"]
