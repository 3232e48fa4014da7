r"""Direct Preference Optimization from Bradley–Terry preferences (spec §9, §10).

Rafailov et al., 2023, "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model".
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import _checks
from ..types import LossResult


def sequence_logp(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Log-probability of each response, :math:`\log\pi(y_i\mid x)=\sum_t m_{i,t}\ell_{i,t}` (§4).

    Args:
      logp: ``[B, L]`` token log-probs (gradient flows through).
      mask: ``[B, L]`` response (action) mask; masked entries may be NaN/inf.
    Returns:
      ``[B]``; 0 for a row with no valid token.
    """
    logp = _checks.as_tensor("logp", logp)
    _checks.check_ndim("logp", logp, 2)
    _checks.check_floating("logp", logp)
    mask = _checks.check_mask("mask", mask, logp.shape)
    return _checks.per_token("logp", logp, logp.shape, mask).sum(-1)


def _pair_input(name: str, x, shape=None) -> torch.Tensor:
    x = _checks.as_tensor(name, x)
    _checks.check_ndim(name, x, 1)
    _checks.check_floating(name, x)
    if shape is None and x.shape[0] == 0:
        raise ValueError(f"{name}: empty batch (no preference pairs)")
    if shape is not None:
        _checks.check_shape(name, x, shape, against="chosen_logp")
    _checks.check_finite(name, x)
    return x


def dpo_loss(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    denominator=None,
) -> LossResult:
    r"""DPO loss on sequence log-probabilities (§10).

    With implicit rewards (§9: :math:`r=\beta\log\frac{\pi^*}{\pi_{ref}}+\beta\log Z`,
    the :math:`\log Z(x)` cancelling in the difference)

    .. math::
        \hat r_w=\beta(\log\pi_\theta(y_w)-\log\pi_{ref}(y_w)),\quad
        \hat r_l=\beta(\log\pi_\theta(y_l)-\log\pi_{ref}(y_l)),\quad
        z=\hat r_w-\hat r_l,

    .. math::
        \mathcal L = -\frac1B\sum_b\big[(1-\varepsilon)\log\sigma(z_b)
        +\varepsilon\log\sigma(-z_b)\big].

    :math:`\varepsilon=` ``label_smoothing`` is conservative DPO (preferences flipped with
    probability :math:`\varepsilon`); the default 0 is the spec's loss. At :math:`z=0`
    the loss is :math:`\log 2` for any :math:`\varepsilon` (§24). Gradient (with
    :math:`\varepsilon=0`):
    :math:`\nabla\mathcal L=-\frac{\beta}{B}\sum_b\sigma(-z_b)\,(\nabla\log\pi_\theta(y_w)
    -\nabla\log\pi_\theta(y_l))`: it raises the chosen and lowers the rejected response,
    most where the implicit reward ranks them wrongly.

    Aggregation is a mean over pairs (the four token modes do not apply to a per-pair
    loss); ``denominator=`` replaces :math:`B` by a global pair count for micro-batching.

    Args:
      chosen_logp, rejected_logp: ``[B]`` sequence log-probs under :math:`\pi_\theta`
        (attached; see :func:`sequence_logp`).
      ref_chosen_logp, ref_rejected_logp: ``[B]`` under the frozen reference (detached).
      beta: :math:`\beta>0`, the KL strength of §9.
      label_smoothing: :math:`\varepsilon\in[0,0.5)`.
      denominator: optional positive pair count replacing :math:`B`.

    Returns:
      ``LossResult``; metrics ``rewards/chosen``, ``rewards/rejected``, ``rewards/margin``
      (batch means of :math:`\hat r_w,\hat r_l,z`) and ``rewards/accuracy`` (fraction with
      :math:`z>0`), all detached.
    """
    chosen_logp = _pair_input("chosen_logp", chosen_logp)
    shape = tuple(chosen_logp.shape)
    rejected_logp = _pair_input("rejected_logp", rejected_logp, shape)
    ref_c = _pair_input("ref_chosen_logp", ref_chosen_logp, shape).detach()
    ref_r = _pair_input("ref_rejected_logp", ref_rejected_logp, shape).detach()
    b = float(beta)
    _checks.check_positive("beta", b)
    if not math.isfinite(b):
        raise ValueError(f"beta: must be finite, got {beta}")
    ls = float(label_smoothing)
    _checks.check_in_range("label_smoothing", ls, 0.0, 0.5, inclusive=(True, False))

    chosen_reward = b * (chosen_logp - ref_c)
    rejected_reward = b * (rejected_logp - ref_r)
    z = chosen_reward - rejected_reward
    per_pair = -F.logsigmoid(z)
    if ls > 0:
        per_pair = (1.0 - ls) * per_pair - ls * F.logsigmoid(-z)
    if denominator is None:
        d = torch.as_tensor(float(shape[0]), dtype=per_pair.dtype, device=per_pair.device)
    else:
        d = torch.as_tensor(denominator, dtype=per_pair.dtype, device=per_pair.device)
        if d.ndim != 0:
            raise ValueError(f"denominator: must be a scalar, got shape {tuple(d.shape)}")
        if not bool(d > 0):
            raise ValueError(f"denominator: must be positive, got {d.item()}")
    loss = per_pair.sum() / d
    with torch.no_grad():
        metrics = {
            "rewards/chosen": chosen_reward.detach().mean(),
            "rewards/rejected": rejected_reward.detach().mean(),
            "rewards/margin": z.detach().mean(),
            "rewards/accuracy": (z.detach() > 0).to(per_pair.dtype).mean(),
        }
    return LossResult(loss, metrics)


__all__ = ["dpo_loss", "sequence_logp"]
