r"""Token log-probabilities under the distribution that actually sampled (spec §4, §7).

A sampler rarely draws from :math:`\mathrm{softmax}(z)`. It draws from the *sampling
distribution*

.. math::

   q_{T,k,p}(v \mid h) = \frac{\mathbb 1[v\in S]\,\exp(z_v/T)}{\sum_{u\in S}\exp(z_u/T)},

where :math:`T` is the temperature and :math:`S` the support kept by top-k and then top-p
truncation. An importance ratio :math:`\pi_\theta/\mu` (§7) is only correct when the
behaviour log-prob in its denominator and the learner's recomputed log-prob are both taken
under this same :math:`q` ("If old_logprobs came from unmasked logits but sampling used
top-p, the denominator is wrong"). This module computes :math:`q` with exactly the
semantics of Hugging Face ``generate()`` (``TemperatureLogitsWarper``, then
``TopKLogitsWarper``, then ``TopPLogitsWarper`` with ``min_tokens_to_keep=1``), and the
project's samplers call the same :func:`sampling_logits`, so rollout and learner agree.

Alignment (§4): ``logits[:, j]`` predicts ``input_ids[:, j + 1]``; per-token results are
``[B, L]`` with ``L = T - 1``, aligned with ``targets = input_ids[:, 1:]``
(:func:`shift_logits_and_targets`, :func:`shift_mask`).

Precision: ``float16``/``bfloat16`` logits are promoted to ``float32`` before anything
else, as ``generate()`` does before its warpers; ``float32``/``float64`` are kept.

Truncation semantics (identical to ``generate()``):

* temperature: :math:`z/T`, skipped when :math:`T=1`.
* top-k: keep every token whose scaled logit is :math:`\ge` the k-th largest (ties at the
  boundary are all kept, so the support may exceed k); ``top_k >= V`` keeps everything.
* top-p: sort ascending, cumulative softmax mass :math:`c`; drop tokens with
  :math:`c \le 1-p`, never the most probable one. Among tied logits the order of
  ``torch.sort`` decides which are dropped, as in ``generate()``. ``top_p=1`` is a no-op
  (``generate()`` does not install the warper then).
* ``None`` disables a truncation; ``top_k=0`` is rejected (use ``None``).

Nothing here is evidence: every output is differentiable w.r.t. ``logits``; only the
choice of the support is computed under ``no_grad`` (piecewise constant).

References: Fan et al., "Hierarchical Neural Story Generation", 2018 (top-k);
Holtzman et al., "The Curious Case of Neural Text Degeneration", 2020 (top-p / nucleus).
"""
from __future__ import annotations

import math
import operator
from typing import Optional, Tuple, Union

import torch

from .. import _checks

__all__ = [
    "shift_logits_and_targets",
    "shift_mask",
    "sampling_logits",
    "token_logprobs",
    "entropy",
]

# Upper bound on the number of elements of one row-chunk while the top-k/top-p support is
# computed (the sort alone holds values plus int64 indices: ~12 bytes per element).
_SUPPORT_CHUNK_ELEMENTS = 1 << 24


# --------------------------------------------------------------------------- alignment


def shift_logits_and_targets(logits: torch.Tensor, input_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Align next-token logits with the tokens they predict (§4).

    ``logits[:, j]`` is the model's distribution for ``input_ids[:, j + 1]``, so the last
    logit row predicts nothing and the first token is never predicted:

    .. code-block:: text

        logits  [B, T, V]  ->  logits[:, :-1]    [B, T-1, V]
        input_ids  [B, T]  ->  input_ids[:, 1:]  [B, T-1]   (the targets)

    Returns views (no copy). Pass the action mask through :func:`shift_mask`.
    """
    logits = _checks.as_tensor("logits", logits)
    _checks.check_ndim("logits", logits, 3)
    _checks.check_floating("logits", logits)
    input_ids = _checks.as_tensor("input_ids", input_ids, dtype=None if isinstance(input_ids, torch.Tensor) else torch.long)
    _checks.check_ndim("input_ids", input_ids, 2)
    _check_integer("input_ids", input_ids)
    _checks.check_shape("input_ids", input_ids, logits.shape[:2], against="logits[..., 0]")
    return logits[:, :-1], input_ids[:, 1:]


def shift_mask(mask: torch.Tensor) -> torch.Tensor:
    r"""Align a ``[B, T]`` token mask with the targets: ``mask[:, 1:]`` (§4).

    ``mask[b, t] == 1`` marks token ``t`` as an action; after the shift, ``[b, j]`` refers
    to ``targets[b, j] = input_ids[b, j + 1]``. The dtype is kept.
    """
    mask = _checks.as_tensor("mask", mask)
    _checks.check_ndim("mask", mask, 2)
    _checks.check_mask("mask", mask)
    return mask[:, 1:]


# --------------------------------------------------------------------------- validation


def _check_integer(name: str, x: torch.Tensor) -> None:
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer tensor, got dtype {x.dtype}")


def _validate_params(temperature, top_k, top_p) -> Tuple[float, Optional[int], Optional[float]]:
    if isinstance(temperature, (bool, str, bytes)):
        raise ValueError(f"temperature: must be a positive number, got {temperature!r}")
    try:
        t = float(temperature)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"temperature: must be a positive number, got {temperature!r}") from exc
    if not (t > 0) or not math.isfinite(t):
        raise ValueError(f"temperature: must be a finite positive number, got {temperature!r}")

    k: Optional[int] = None
    if top_k is not None:
        if isinstance(top_k, bool):
            raise ValueError(f"top_k: must be an integer >= 1 or None, got {top_k!r}")
        try:
            k = operator.index(top_k)
        except TypeError as exc:
            raise ValueError(f"top_k: must be an integer >= 1 or None, got {top_k!r}") from exc
        if k < 1:
            raise ValueError(f"top_k: must be an integer >= 1 or None (None disables it), got {k}")

    p: Optional[float] = None
    if top_p is not None:
        if isinstance(top_p, (bool, str, bytes)):
            raise ValueError(f"top_p: must lie in (0, 1], got {top_p!r}")
        try:
            p = float(top_p)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"top_p: must lie in (0, 1], got {top_p!r}") from exc
        _checks.check_in_range("top_p", p, 0.0, 1.0, inclusive=(False, True))
    return t, k, p


def _prepare_logits(logits, min_ndim: int) -> torch.Tensor:
    logits = _checks.as_tensor("logits", logits)
    if logits.ndim < min_ndim:
        raise ValueError(f"logits: expected at least {min_ndim} dimensions [..., V], got shape {tuple(logits.shape)}")
    _checks.check_floating("logits", logits)
    if logits.shape[-1] == 0:
        raise ValueError("logits: the vocabulary dimension is empty")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits


def _sanitize_rows(logits: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """Reject unusable rows (NaN, +inf, all -inf) where ``valid``; neutralize the others.

    A row is usable when its maximum is finite (``amax`` propagates NaN). Rows outside
    ``valid`` that are not usable are replaced by zeros *by selection*, so NaN/inf stored in
    a masked position reaches neither the result nor the gradient.
    """
    if not _checks.values_checked():
        if valid is None:
            return logits
        return torch.where(valid[..., None], logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    with torch.no_grad():
        usable = torch.isfinite(logits.amax(-1))
        bad = ~usable if valid is None else (~usable & valid)
        if bool(bad.any()):
            raise ValueError(
                "logits: a row at a valid position contains NaN or +inf, or is -inf everywhere "
                "(no token has positive probability)"
            )
        needs_fill = valid is not None and bool((~usable).any())
    if needs_fill:
        return torch.where(usable[..., None], logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return logits


# --------------------------------------------------------------------------- support


def _removed_by_truncation(scores: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> torch.Tensor:
    """Boolean ``[N, V]``: True where top-k then top-p truncation removes the token.

    ``scores`` are already temperature-scaled and detached. Same operations, in the same
    order and dtype, as the ``generate()`` warpers, so boundaries and ties agree bit for bit.
    """
    removed = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    vocab = scores.shape[-1]
    if top_k is not None and top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        removed = scores < kth
        scores = scores.masked_fill(removed, -math.inf)
    if top_p is not None and top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1, descending=False)
        mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = mass_below <= (1 - top_p)
        drop_sorted[..., -1] = False  # the most probable token always survives
        removed = removed | torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return removed


def _support_mask(scores: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> Optional[torch.Tensor]:
    """``keep`` mask of shape ``scores.shape`` or ``None`` when nothing is truncated."""
    vocab = scores.shape[-1]
    if (top_k is None or top_k >= vocab) and (top_p is None or top_p >= 1.0):
        return None
    with torch.no_grad():
        flat = scores.detach().reshape(-1, vocab)
        rows = max(1, _SUPPORT_CHUNK_ELEMENTS // vocab)
        keep = torch.empty(flat.shape, dtype=torch.bool, device=flat.device)
        for start in range(0, flat.shape[0], rows):
            stop = start + rows
            keep[start:stop] = ~_removed_by_truncation(flat[start:stop], top_k, top_p)
    return keep.reshape(scores.shape)


def _warp(logits: torch.Tensor, t: float, k: Optional[int], p: Optional[float]) -> torch.Tensor:
    scaled = logits if t == 1.0 else logits / t
    keep = _support_mask(scaled, k, p)
    if keep is None:
        return scaled
    return scaled.masked_fill(~keep, -math.inf)


def sampling_logits(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> torch.Tensor:
    r"""Logits of the sampling distribution :math:`q_{T,k,p}`: :math:`z/T` on the kept support, -inf elsewhere.

    ``softmax`` of the result is the distribution a sampler with these settings draws
    from; ``torch.multinomial(result.softmax(-1), 1)`` reproduces ``generate(do_sample=True,
    temperature=T, top_k=k, top_p=p)``'s token distribution (module docstring for the exact
    truncation rules, ties and boundaries). A sampler must record
    ``token_logprobs(logits, sampled, temperature=..., top_k=..., top_p=...)`` (equivalently
    ``log_softmax`` of this result) as its behaviour log-prob (§7).

    Args:
      logits: ``[..., V]`` raw logits (any leading shape; ``[B, V]`` at a sampling step,
        ``[B, L, V]`` in the learner). Must not contain NaN or +inf, and each row needs a
        finite maximum.
      temperature: :math:`T > 0`.
      top_k: keep the k largest (with boundary ties); ``None`` disables.
      top_p: nucleus mass in (0, 1]; ``None`` or 1 disables.

    Returns:
      ``[..., V]`` tensor (``float32`` for half-precision input, otherwise the input dtype).
      Differentiable w.r.t. ``logits`` at kept entries (gradient ``1/T``); the support
      choice itself is piecewise constant and carries no gradient.
    """
    t, k, p = _validate_params(temperature, top_k, top_p)
    logits = _prepare_logits(logits, 1)
    logits = _sanitize_rows(logits, None)
    return _warp(logits, t, k, p)


# --------------------------------------------------------------------------- log-probs


def _prepare_targets(targets, logits: torch.Tensor, mask: Optional[torch.Tensor]):
    if not isinstance(targets, torch.Tensor):
        try:
            targets = torch.as_tensor(targets)
        except Exception as exc:
            raise ValueError(f"targets: cannot convert {type(targets).__name__} to a tensor ({exc})") from exc
    _check_integer("targets", targets)
    _checks.check_shape("targets", targets, logits.shape[:-1], against="logits[..., 0]")
    if targets.device != logits.device:
        raise ValueError(f"targets: on device {targets.device}, logits on {logits.device}")
    valid = None
    if mask is not None:
        valid = _checks.check_mask("mask", mask, targets.shape).to(logits.device)
        targets = torch.where(valid, targets, torch.zeros((), dtype=targets.dtype, device=targets.device))
    # Always checked (cheap, [B, L]): an out-of-range index is a hard device error on GPUs.
    if targets.numel():
        low, high = int(targets.min()), int(targets.max())
        vocab = logits.shape[-1]
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            where = " at a valid (mask=1) position" if mask is not None else ""
            raise ValueError(f"targets: token id {bad}{where} outside the vocabulary [0, {vocab})")
    return targets.long(), valid


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    return_support: bool = False,
    mask: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    r"""Log-probability of each target under the sampling distribution (§4, §7).

    .. math::

       \ell_{bj} = \log q_{T,k,p}(y_{bj}\mid h_{bj})
                 = \frac{z_{bj,y}}{T} - \log\sum_{u\in S_{bj}} \exp\frac{z_{bj,u}}{T}
                 \quad (y_{bj}\in S_{bj}),\qquad -\infty \text{ otherwise.}

    With no truncation and :math:`T=1` this is ``log_softmax(logits).gather(targets)`` of
    §4. The same function with the same settings must produce both the behaviour
    log-probs (at sampling time) and the learner's log-probs, so that
    :math:`\exp(\ell^\theta-\ell^{old})=1` when the parameters are unchanged (§24).

    Gradient: :math:`\partial\ell_{bj}/\partial z_{bj,v} = (\mathbb 1[v=y] - q_v)/T` for
    :math:`v\in S`, 0 outside :math:`S`. The support :math:`S` is treated as piecewise
    constant (top-k/top-p selection is not differentiable); gradients flow to ``logits``
    only. A target outside :math:`S` gets :math:`-\infty` (flagged by ``in_support``); its
    gradient w.r.t. ``logits`` is still finite (no NaN), but such a token was not sampled
    under these settings: it signals a sampler/learner mismatch and should be masked.

    Memory: ``log_softmax`` + ``gather`` (one fused kernel each way); the ``[B, L, V]``
    log-softmax is kept for the backward pass, plus one scaled copy when :math:`T\ne1` or
    the logits are half precision (promoted to ``float32``). With truncation the support is
    computed in row chunks under ``no_grad`` (transient sort buffers of at most
    ``_SUPPORT_CHUNK_ELEMENTS`` entries) and one masked ``[B, L, V]`` copy is kept. Nothing
    of size ``[B, L, V]`` is built beyond these (no probabilities, no one-hot). For large
    vocabularies without truncation, ``trajgrad.fused.fused_token_logprobs`` computes the
    same values chunk by chunk from the hidden states without the ``[B, L, V]`` logits.

    Args:
      logits: ``[B, L, V]`` (any ``[..., V]``), aligned with ``targets`` (use
        :func:`shift_logits_and_targets`). Rows at valid positions must have no NaN/+inf
        and a finite maximum.
      targets: ``[B, L]`` integer token ids in ``[0, V)`` (at valid positions when
        ``mask`` is given).
      temperature, top_k, top_p: the sampler's settings (see :func:`sampling_logits`).
      return_support: also return ``in_support`` ``[B, L]`` bool, True where the target is
        in the kept support (equivalently, where the result is finite).
      mask: optional ``[B, L]`` action mask. Masked positions may hold any target id
        (e.g. -100) and any logits (NaN/inf included); they give log-prob 0,
        ``in_support`` True, and no gradient.

    Returns:
      ``logp`` ``[B, L]`` (``float32`` for half-precision logits, else the logits dtype),
      or ``(logp, in_support)`` when ``return_support``.
    """
    t, k, p = _validate_params(temperature, top_k, top_p)
    logits = _prepare_logits(logits, 2)
    targets, valid = _prepare_targets(targets, logits, mask)
    logits = _sanitize_rows(logits, valid)

    warped = _warp(logits, t, k, p)
    logp = torch.log_softmax(warped, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    in_support = logp > -math.inf
    if valid is not None:
        logp = _checks.fill_masked(logp, valid)
        in_support = in_support | ~valid
    if return_support:
        return logp, in_support
    return logp


def entropy(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""Entropy of the sampling distribution :math:`q_{T,k,p}` at each position.

    .. math::

       H_{bj} = -\sum_{v\in S_{bj}} q_v \log q_v ,

    the entropy of the same (temperature-scaled, truncated, renormalized) distribution as
    :func:`token_logprobs`. Tokens outside the support contribute exactly 0, selected with
    ``torch.where`` so that :math:`0\cdot\log 0` never produces NaN in value or gradient.
    Differentiable w.r.t. ``logits``; the support is piecewise constant.

    Memory: materializes ``log_softmax`` and ``q`` (``[B, L, V]`` each).

    Args:
      logits: ``[B, L, V]`` (any ``[..., V]`` with at least one leading dimension).
      temperature, top_k, top_p: as in :func:`sampling_logits`.
      mask: optional ``[B, L]``; masked positions give 0 and no gradient, whatever their
        logits hold.

    Returns:
      ``[B, L]`` entropies in nats (0 at masked positions).
    """
    t, k, p = _validate_params(temperature, top_k, top_p)
    logits = _prepare_logits(logits, 2)
    valid = None
    if mask is not None:
        valid = _checks.check_mask("mask", mask, logits.shape[:-1]).to(logits.device)
    logits = _sanitize_rows(logits, valid)

    warped = _warp(logits, t, k, p)
    log_q = torch.log_softmax(warped, dim=-1)
    alive = warped > -math.inf
    # Outside the support q = exp(-inf) = 0 and log q is replaced by 0 (by selection), so
    # neither the product nor its backward ever sees 0 * inf.
    safe_log_q = torch.where(alive, log_q, torch.zeros((), dtype=log_q.dtype, device=log_q.device))
    h = -(log_q.exp() * safe_log_q).sum(-1)
    if valid is not None:
        h = _checks.fill_masked(h, valid)
    return h
