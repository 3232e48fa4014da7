r"""Per-turn statistics of per-token quantities (spec §7, §16).

:func:`group_stats` sums (and takes the minimum and maximum of) per-token quantities over the
valid tokens of each group — a turn index of a multi-turn episode — in one scatter pass per
quantity; :func:`mismatch_by_turn` is the sampler–learner mismatch per turn;
:func:`trajgrad.logprobs.correction.turn_metrics` the rollout correction's metrics per turn. Everything
returned is detached; values at masked positions are never read.
"""
from __future__ import annotations

import math
from typing import Dict

import torch

from . import _checks
def group_stats(values: Dict[str, torch.Tensor], mask: torch.Tensor, group_ids: torch.Tensor,
                *, extrema: tuple = ()) -> tuple:
    r"""Per-group sums of per-token quantities over the valid tokens, in one pass each.

    For every group id :math:`g` present at a valid token (a turn index, §16):
    :math:`n_g=\sum_t m_t\,\mathbb 1[g_t=g]`, and for each ``values[k]`` (``[B, L]``)
    :math:`S_{g,k}=\sum_t m_t\,\mathbb 1[g_t=g]\,x_t`; for the keys in ``extrema`` also the
    minimum and maximum over the group's valid tokens. Values at masked positions (NaN/inf
    allowed) are selected away, never multiplied by 0.

    Args:
      values: name -> ``[B, L]`` float tensor (bool tensors count as 0/1).
      mask: ``[B, L]`` valid tokens.
      group_ids: ``[B, L]`` integer group of each token (any value at masked positions).
      extrema: names of ``values`` whose per-group min and max are wanted.
    Returns:
      ``(ids, counts, sums, mins, maxs)``: ``ids`` a list of ints (ascending), ``counts``
      ``[G]`` float64, ``sums[k]`` ``[G]`` float64, ``mins[k]`` / ``maxs[k]`` ``[G]`` — all detached.
    """
    m = _checks.check_mask("mask", mask)
    gid = _checks.as_tensor("group_ids", group_ids)
    _checks.check_shape("group_ids", gid, tuple(m.shape), against="mask")
    if gid.is_floating_point() or gid.dtype == torch.bool:
        raise ValueError(f"group_ids: expected an integer tensor, got {gid.dtype}")
    with torch.no_grad():
        flat_m = m.reshape(-1)
        sel = gid.reshape(-1)[flat_m]
        ids, inv = torch.unique(sel, return_inverse=True)
        G = int(ids.numel())
        f64 = torch.float64
        counts = torch.zeros(G, dtype=f64, device=m.device).index_add_(0, inv, torch.ones_like(inv, dtype=f64))
        sums, mins, maxs = {}, {}, {}
        for k, x in values.items():
            _checks.check_shape(k, x, tuple(m.shape), against="mask")
            v = x.reshape(-1)[flat_m].to(f64)
            sums[k] = torch.zeros(G, dtype=f64, device=m.device).index_add_(0, inv, v)
            if k in extrema:
                mins[k] = torch.full((G,), math.inf, dtype=f64, device=m.device).scatter_reduce_(0, inv, v, "amin")
                maxs[k] = torch.full((G,), -math.inf, dtype=f64, device=m.device).scatter_reduce_(0, inv, v, "amax")
    return [int(i) for i in ids.tolist()], counts, sums, mins, maxs


def mismatch_by_turn(learner_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor,
                     turn_ids: torch.Tensor, *, prefix: str = "mismatch/") -> Dict[str, float]:
    r"""Sampler–learner mismatch per turn: ``{prefix}turn{k}/kl_k1`` and ``kl_k3``.

    .. math::
        k_1 = \overline{-z},\qquad k_3=\overline{e^{z}-1-z},\qquad z_t=\log\pi(y_t)-\log\mu(y_t),

    means over the action tokens of turn :math:`k` (the sampled estimates of
    :math:`\mathrm{KL}(\mu\Vert\pi)` on the tokens the sampler drew, §7; the per-step
    ``mismatch/kl_k1|k3`` restricted to one turn, §16). ``learner_logp`` :math:`\log\pi`
    and ``behaviour_logp`` :math:`\log\mu` are ``[B, L]``, detached; NaN/inf at masked
    positions are never read.
    """
    m = _checks.check_mask("mask", mask)
    lp = _checks.as_tensor("learner_logp", learner_logp).detach()
    beh = _checks.as_tensor("behaviour_logp", behaviour_logp).detach()
    _checks.check_shape("learner_logp", lp, tuple(m.shape), against="mask")
    _checks.check_shape("behaviour_logp", beh, tuple(m.shape), against="mask")
    with torch.no_grad():
        z = torch.where(m, lp.double() - beh.double(), torch.zeros((), dtype=torch.float64))
        if _checks.values_checked() and not bool(torch.isfinite(z).all()):
            raise ValueError("behaviour_logp: non-finite log-prob at a valid position (or learner_logp)")
        ids, n, sums, _, _ = group_stats({"k1": -z, "k3": torch.expm1(z) - z}, m, turn_ids)
    out: Dict[str, float] = {}
    for j, k in enumerate(ids):
        out[f"{prefix}turn{k}/kl_k1"] = float(sums["k1"][j] / n[j])
        out[f"{prefix}turn{k}/kl_k3"] = float(sums["k3"][j] / n[j])
    return out


__all__ = ["group_stats", "mismatch_by_turn"]
