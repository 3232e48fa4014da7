"""Shared pieces of the group and batch estimators (:mod:`.baselines`, :mod:`.group_baselines`,
:mod:`.normalized`): reward checks, per-group statistics, weighted whitening.

Private to :mod:`trajgrad.advantages`: the public functions validate their arguments and
call these.
"""
from __future__ import annotations

import torch

from .. import _checks


def _rewards(rewards) -> torch.Tensor:
    rewards = _checks.as_tensor("rewards", rewards)
    if not rewards.is_floating_point():
        if rewards.is_complex():
            raise ValueError(f"rewards: expected a real tensor, got dtype {rewards.dtype}")
        rewards = rewards.to(torch.get_default_dtype())
    rewards = rewards.detach()
    _checks.check_finite("rewards", rewards)
    return rewards


def _group_index(group_ids, size: int, device):
    """``(inverse [M], counts [K])`` for integer ``group_ids`` ``[M]``."""
    ids = _checks.as_tensor("group_ids", group_ids)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"group_ids: expected an integer tensor, got dtype {ids.dtype}")
    _checks.check_shape("group_ids", ids, (size,), against="rewards")
    _, inverse, counts = torch.unique(ids.to(device), sorted=True, return_inverse=True, return_counts=True)
    return inverse, counts


def _stats(rewards: torch.Tensor, group_ids, unbiased: bool = False):
    """Per-group (mean, std, zero_variance, group sums, counts) and the gather index.

    The std is the population std, or Bessel's (``unbiased``; a group of one has std 0).
    Dense ``[N, G]`` input returns ``index=None``; ragged ``[M]`` input returns ``inverse``.
    """
    if group_ids is None:
        _checks.check_ndim("rewards", rewards, 2)
        if rewards.shape[1] == 0:
            raise ValueError("rewards: empty group (G = 0 rollouts per prompt)")
        count = torch.full((rewards.shape[0],), rewards.shape[1], dtype=rewards.dtype, device=rewards.device)
        total = rewards.sum(-1)
        mean = total / count
        spread = rewards.amax(-1) - rewards.amin(-1)
        var = ((rewards - mean[:, None]) ** 2).mean(-1)
        index = None
    else:
        _checks.check_ndim("rewards", rewards, 1)
        if rewards.shape[0] == 0:
            raise ValueError("rewards: empty (no rollout in any group)")
        index, counts = _group_index(group_ids, rewards.shape[0], rewards.device)
        k = counts.shape[0]
        count = counts.to(rewards.dtype)
        total = torch.zeros(k, dtype=rewards.dtype, device=rewards.device).index_add_(0, index, rewards)
        mean = total / count
        sq = (rewards - mean[index]) ** 2
        var = torch.zeros_like(total).index_add_(0, index, sq) / count
        hi = torch.full_like(total, -torch.inf).scatter_reduce(0, index, rewards, "amax")
        lo = torch.full_like(total, torch.inf).scatter_reduce(0, index, rewards, "amin")
        spread = hi - lo
    zero_variance = spread == 0
    if unbiased:
        var = var * count / (count - 1).clamp_min(1)
    std = torch.where(zero_variance, torch.zeros_like(var), var.sqrt())
    return mean, std, zero_variance, total, count, index


def _per_item(x: torch.Tensor, index) -> torch.Tensor:
    """Broadcast a per-group statistic to every rollout."""
    return x[:, None] if index is None else x[index]


# ------------------------------------------------------------------ batch normalization
def _eps(eps) -> float:
    eps = float(eps)
    _checks.check_positive("eps", eps, allow_zero=True)
    if eps == float("inf"):
        raise ValueError("eps: must be finite")
    return eps


def _weighted_whiten(x: torch.Tensor, w: torch.Tensor, *, shift_mean: bool, unbiased: bool, eps: float,
                     name: str = "mask", std_plus_eps: bool = False, empty: str = "error") -> torch.Tensor:
    """Whiten ``x`` with weights ``w >= 0`` (counts); entries with ``w == 0`` are ignored and returned as 0.

    ``empty="zeros"``: a batch with no valid entry (or one, with ``unbiased``) returns zeros."""
    valid = w > 0
    n = w.sum()
    few = not bool(n > 0) or (unbiased and not bool(n > 1))
    if few and empty == "zeros":
        return torch.zeros_like(x) if shift_mean else torch.where(valid, x, torch.zeros_like(x))
    if not bool(n > 0):
        raise ValueError(f"{name}: no valid entry to normalize over")
    if unbiased and not bool(n > 1):
        raise ValueError(f"{name}: the unbiased variance needs at least 2 valid entries")
    xs = torch.where(valid, x, torch.zeros_like(x))
    mean = (w * xs).sum() / n
    centred = torch.where(valid, xs - mean, torch.zeros_like(xs))
    var = (w * centred.square()).sum() / n
    if unbiased:
        var = var * n / (n - 1)
    spread = torch.where(valid, xs, torch.full_like(xs, -torch.inf)).amax() - torch.where(
        valid, xs, torch.full_like(xs, torch.inf)).amin()
    if bool(spread == 0):  # a constant batch: exactly 0 (never 0/0, never rounding noise / sqrt(eps))
        out = torch.zeros_like(xs)
    else:
        scale = var.sqrt() + eps if std_plus_eps else torch.sqrt(var + eps)
        out = centred / scale
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, torch.zeros_like(out))
