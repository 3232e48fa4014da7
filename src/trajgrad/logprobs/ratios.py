r"""Importance ratios between the current policy and the policy that sampled (spec §7, §16, §17).

All inputs are ``[B, L]`` per-token log-probabilities aligned with the targets (§4);
``old_logp`` is the behaviour (rollout / old-policy) log-probability and is *detached*
inside every function: it is evidence, not a parameter. 16-bit inputs (float16,
bfloat16) are computed, and returned, in float32: a ratio :math:`e^{z}` overflows
float16 from :math:`z\approx11.1`.

=============================  =========================================================
``token_log_ratio``            :math:`\log\rho_{ij}=\ell^\theta_{ij}-\ell^{old}_{ij}` (§7)
``sequence_log_ratio``         :math:`\log\rho_{i,1:L}=\sum_j\log\rho_{ij}` (§7, kept in
                               log space: the product itself over/underflows)
``gspo_sequence_ratio``        :math:`s_i=\exp(\frac1{L_i}\sum_j\log\rho_{ij})` (§17, the
                               geometric mean, *not* the full-sequence density ratio)
``gspo_token_ratio``           :math:`s_{ij}=\mathrm{sg}[s_i]\,\pi_\theta/\mathrm{sg}[\pi_\theta]`
                               (§17 GSPO-token carrier)
``segment_log_ratios``         per-segment sums for trajectories sampled by several
                               behaviour policies (§16)
=============================  =========================================================
"""
from __future__ import annotations

from typing import Tuple

import torch

from .. import _checks


def _prepare(logp, old_logp, mask):
    logp = _checks.as_tensor("logp", logp)
    _checks.check_ndim("logp", logp, 2)
    _checks.check_floating("logp", logp)
    logp = _checks.at_least_float32(logp)  # ratios e^z overflow float16 from z ~ 11.1
    mask = _checks.check_mask("mask", mask, logp.shape)
    logp = _checks.per_token("logp", logp, logp.shape, mask)
    old_logp = _checks.per_token("old_logp", _checks.as_tensor("old_logp", old_logp).detach(), logp.shape, mask)
    return logp, old_logp, mask


def token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Per-token log importance ratio :math:`\ell^\theta-\mathrm{sg}[\ell^{old}]`, 0 where masked.

    Args:
      logp: ``[B, L]`` current log-probs (attached).
      old_logp: ``[B, L]`` behaviour log-probs (detached here).
      mask: ``[B, L]`` action mask.
    Returns:
      ``[B, L]``; exactly 0 at masked positions (so ``exp`` gives ratio 1 there).
    """
    logp, old_logp, mask = _prepare(logp, old_logp, mask)
    return _checks.fill_masked(logp - old_logp, mask)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Exact full-sequence log ratio :math:`\sum_j m_{ij}(\ell^\theta_{ij}-\ell^{old}_{ij})`, ``[B]`` (§7).

    This is the log of the Radon–Nikodym density ratio of the sampled response; its
    exponential has variance that grows with length, so it is returned in log space.
    """
    return token_log_ratio(logp, old_logp, mask).sum(-1)


def gspo_log_sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""GSPO's length-normalized log ratio :math:`\log s_i=\frac1{L_i}\sum_j\log\rho_{ij}`, ``[B]`` (§17).

    Rows with no valid token give 0.
    """
    lr = token_log_ratio(logp, old_logp, mask)
    mask = _checks.check_mask("mask", mask, lr.shape)
    lengths = mask.sum(-1).clamp_min(1).to(lr.dtype)
    return lr.sum(-1) / lengths


def gspo_sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""GSPO sequence ratio :math:`s_i=\exp[\frac1{L_i}\sum_t(\ell^\theta_{i,t}-\ell^{old}_{i,t})]`, ``[B]`` (§17).

    The :math:`L_i`-th root of the full-sequence ratio (a geometric mean of token ratios).
    It is *not* the exact density ratio (see :func:`sequence_log_ratio`). Gradient:
    :math:`\nabla s_i = \frac{s_i}{L_i}\sum_t\nabla\ell^\theta_{i,t}`.
    """
    return torch.exp(gspo_log_sequence_ratio(logp, old_logp, mask))


def gspo_token_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""GSPO-token ratio :math:`s_{i,t}=\mathrm{sg}[s_i]\cdot\exp(\ell^\theta_{i,t}-\mathrm{sg}[\ell^\theta_{i,t}])`, ``[B, L]`` (§17).

    Numerically :math:`s_{i,t}=s_i` at every valid token, but
    :math:`\nabla s_{i,t}=s_i\nabla\ell^\theta_{i,t}`: the sequence ratio is a detached
    weight and the *carrier* ``exp(logp - logp.detach())`` (value 1) routes the token's
    own log-prob gradient. Masked positions hold 1 and carry no gradient.
    """
    logp_f, old_f, mask_b = _prepare(logp, old_logp, mask)
    s = gspo_sequence_ratio(logp, old_logp, mask).detach()
    carrier = torch.exp(logp_f - logp_f.detach())
    out = s[:, None] * carrier
    return _checks.fill_masked(out, mask_b, 1.0)


def segment_log_ratios(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    segment_ids: torch.Tensor,
    num_segments: int | None = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Per-segment log ratios for trajectories sampled by several behaviour policies (§16).

    When turns :math:`0..k` were sampled by :math:`\mu_0` and later turns by :math:`\mu_1`
    there is no single behaviour checkpoint: each token's ``old_logp`` must be its own
    segment's behaviour log-prob, and the importance ratio is formed per segment:
    :math:`\log\rho_{i,s}=\sum_{j:\,seg_{ij}=s} m_{ij}(\ell^\theta_{ij}-\ell^{\mu_s}_{ij})`.

    Args:
      segment_ids: ``[B, L]`` integer id (``0 .. S-1``) of the behaviour segment that
        sampled each token (e.g. the policy version index within the trajectory).
      num_segments: ``S``; defaults to ``segment_ids.max() + 1``.
    Returns:
      ``(per_segment [B, S], per_token [B, L])``: the segment sums, and each valid
      token's own segment sum broadcast back (0 at masked positions).
    """
    lr = token_log_ratio(logp, old_logp, mask)
    mask_b = _checks.check_mask("mask", mask, lr.shape)
    segment_ids = _checks.as_tensor("segment_ids", segment_ids)
    _checks.check_shape("segment_ids", segment_ids, lr.shape, against="logp")
    if segment_ids.is_floating_point() or segment_ids.dtype == torch.bool:
        raise ValueError(f"segment_ids: expected an integer tensor, got dtype {segment_ids.dtype}")
    seg = torch.where(mask_b, segment_ids, torch.zeros_like(segment_ids)).long()
    if bool((seg < 0).any()):
        raise ValueError("segment_ids: must be non-negative at valid positions")
    s = (int(seg.max().item()) + 1 if seg.numel() else 1) if num_segments is None else int(num_segments)
    if num_segments is not None and seg.numel() and int(seg.max()) >= s:
        raise ValueError(f"segment_ids: contains id {int(seg.max())} >= num_segments={s}")
    per_segment = torch.zeros(lr.shape[0], max(s, 1), dtype=lr.dtype, device=lr.device)
    per_segment = per_segment.scatter_add(1, seg, lr)
    per_token = _checks.fill_masked(per_segment.gather(1, seg), mask_b)
    return per_segment, per_token
