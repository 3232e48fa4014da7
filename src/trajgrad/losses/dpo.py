r"""Direct Preference Optimization from Bradley–Terry preferences, and its common variants (spec §9, §10).

Rafailov et al., 2023, "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model". With implicit rewards :math:`\hat r=\beta\log(\pi_\theta/\pi_{ref})` and the
margin :math:`z=\hat r_w-\hat r_l=\beta h`, :math:`h=\log\frac{\pi_\theta(y_w)}{\pi_{ref}(y_w)}-
\log\frac{\pi_\theta(y_l)}{\pi_{ref}(y_l)}`, ``loss_type`` selects the per-pair loss:

=============  =====================================================================  ==================
``loss_type``  per-pair loss                                                          paper
=============  =====================================================================  ==================
``sigmoid``    :math:`-(1-\varepsilon)\log\sigma(z)-\varepsilon\log\sigma(-z)`   DPO; cDPO for ε>0
``robust``     :math:`\frac{-(1-\varepsilon)\log\sigma(z)+\varepsilon\log\sigma(-z)}
               {1-2\varepsilon}`                                                     rDPO (Chowdhury
                                                                                      et al. 2024)
``hinge``      :math:`\max(0,1-z)`                                                   SLiC (Zhao et al.
                                                                                      2023)
``ipo``        :math:`\big(h-\frac1{2\beta}\big)^2` (β is IPO's τ)                  IPO (Azar et al.
                                                                                      2024)
``simpo``      :math:`-\log\sigma\big(\beta(\bar\ell_w-\bar\ell_l)-\gamma\big)`,     SimPO (Meng et al.
               :math:`\bar\ell=\log\pi_\theta(y)/|y|`, no reference                  2024)
=============  =====================================================================  ==================

These are TRL's ``DPOTrainer`` ``loss_type`` values ``sigmoid``, ``robust``, ``hinge``, ``ipo``
(TRL 1.16) and its CPO trainer's ``simpo``. Differences to TRL, each explicit here: TRL's
``sigmoid`` ignores ``label_smoothing`` (cDPO here, with :math:`\varepsilon=0` it is the same);
TRL's ``ipo`` divides each log-ratio by the response's token count (pass
``chosen_length``/``rejected_length`` for that; without them :math:`h` is the paper's sum).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .. import _checks
from .._aggregation import check_denominator
from ..registry import Param, finite_positive, policy_term
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


LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "simpo")


def _lengths(name: str, x, shape) -> torch.Tensor:
    x = _pair_input(name, x, shape).detach()
    if bool((x <= 0).any()):
        raise ValueError(f"{name}: token counts must be positive")
    return x


DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "simpo")
BETA = Param("beta", 0.1, "DPO's β (§10).", float, lambda v: finite_positive("beta", v))
_DPO_DOC = ("the preference loss of a pairwise recipe (``trajgrad.losses.dpo_loss``: ``sigmoid`` (DPO, default), "
            "``robust``, ``hinge``, ``ipo``, ``simpo``), its label smoothing ε and SimPO's margin γ.")


def _check_label_smoothing(v) -> None:
    finite_positive("label_smoothing", v, allow_zero=True)
    _checks.check_in_range("label_smoothing", v, 0.0, 0.5, inclusive=(True, False))


def _check_simpo_gamma(v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"simpo_gamma: must be a finite number, got {v!r}")


DPO_LOSS_TYPE = Param("dpo_loss_type", "sigmoid", _DPO_DOC, str,
                      lambda v: _checks.check_choice("dpo_loss_type", v, DPO_LOSS_TYPES))
LABEL_SMOOTHING = Param("label_smoothing", 0.0, _DPO_DOC, float, _check_label_smoothing)
SIMPO_GAMMA = Param("simpo_gamma", 0.5, _DPO_DOC, float, _check_simpo_gamma)


@policy_term(
    "dpo", fields=("beta",), ratio="none", detached=("reference log-probs",), aggregation="token_mean",
    kind="pairwise", params=(BETA, DPO_LOSS_TYPE, LABEL_SMOOTHING, SIMPO_GAMMA),
    text=lambda o: (f"loss = − log σ(β [log π_θ(y_w) − log π_ref(y_w)] − β [log π_θ(y_l) − log π_ref(y_l)]),  "
                    f"β = {o.beta:g}   (§10)\n"
                    "    sequence log-probs; reference log-probs detached; a static preference dataset"),
)
def dpo_loss(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: Optional[torch.Tensor],
    ref_rejected_logp: Optional[torch.Tensor],
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
    chosen_length: Optional[torch.Tensor] = None,
    rejected_length: Optional[torch.Tensor] = None,
    simpo_gamma: float = 0.5,
    denominator=None,
) -> LossResult:
    r"""DPO loss on sequence log-probabilities (§10), and the variants of the module table.

    With implicit rewards (§9: :math:`r=\beta\log\frac{\pi^*}{\pi_{ref}}+\beta\log Z`,
    the :math:`\log Z(x)` cancelling in the difference)

    .. math::
        \hat r_w=\beta(\log\pi_\theta(y_w)-\log\pi_{ref}(y_w)),\quad
        \hat r_l=\beta(\log\pi_\theta(y_l)-\log\pi_{ref}(y_l)),\quad
        z=\hat r_w-\hat r_l,

    .. math::
        \mathcal L = -\frac1B\sum_b\big[(1-\varepsilon)\log\sigma(z_b)
        +\varepsilon\log\sigma(-z_b)\big]\quad(\texttt{loss\_type="sigmoid"}).

    :math:`\varepsilon=` ``label_smoothing`` is conservative DPO (preferences flipped with
    probability :math:`\varepsilon`); the default 0 is the spec's loss. At :math:`z=0`
    the loss is :math:`\log 2` for any :math:`\varepsilon` (§24). Gradient (with
    :math:`\varepsilon=0`):
    :math:`\nabla\mathcal L=-\frac{\beta}{B}\sum_b\sigma(-z_b)\,(\nabla\log\pi_\theta(y_w)
    -\nabla\log\pi_\theta(y_l))`: it raises the chosen and lowers the rejected response,
    most where the implicit reward ranks them wrongly.

    Other ``loss_type`` values (module table), with their gradients w.r.t.
    :math:`\log\pi_\theta(y_w)` (the rejected one is the negative, over its own length):

    * ``robust``: :math:`-\frac{\beta}{1-2\varepsilon}\big[(1-\varepsilon)\sigma(-z)+\varepsilon\sigma(z)\big]`;
      an unbiased loss under label noise :math:`\varepsilon` (:math:`\varepsilon\in[0,0.5)`).
    * ``hinge``: :math:`-\beta\,\mathbb 1[z<1]` (no gradient once the margin exceeds 1).
    * ``ipo``: :math:`2(h-\frac1{2\beta})/|y_w|` with lengths, :math:`2(h-\frac1{2\beta})`
      without: a squared loss that pulls :math:`h` to :math:`1/(2\beta)` instead of pushing
      it to infinity (IPO's fix of DPO's overfitting to deterministic preferences).
    * ``simpo``: :math:`-\frac{\beta}{|y_w|}\big[(1-\varepsilon)\sigma(-x)-\varepsilon\sigma(x)\big]`,
      :math:`x=\beta(\bar\ell_w-\bar\ell_l)-\gamma`; the length-normalized log-probability
      is the implicit reward and there is no reference model (pass ``None`` for the
      reference arguments; they are ignored). Needs the lengths. TRL's CPO ``simpo`` with
      ``cpo_alpha=0``.

    ``label_smoothing`` applies to ``sigmoid``, ``robust`` and ``simpo``; it must be 0 for
    ``hinge`` and ``ipo``.

    Aggregation is a mean over pairs (the token modes do not apply to a per-pair loss);
    ``denominator=`` replaces :math:`B` by a global pair count for micro-batching.

    Args:
      chosen_logp, rejected_logp: ``[B]`` sequence log-probs under :math:`\pi_\theta`
        (attached; see :func:`sequence_logp`).
      ref_chosen_logp, ref_rejected_logp: ``[B]`` under the frozen reference (detached);
        ``None`` only with ``simpo``.
      beta: :math:`\beta>0`, the KL strength of §9 (IPO's :math:`\tau`; SimPO's reward scale).
      label_smoothing: :math:`\varepsilon\in[0,0.5)`.
      loss_type: one of :data:`LOSS_TYPES` (default ``"sigmoid"``, the spec's DPO).
      chosen_length, rejected_length: optional ``[B]`` positive token counts (detached);
        required by ``simpo``, used by ``ipo`` (TRL's per-token form), ignored otherwise.
      simpo_gamma: SimPO's target margin :math:`\gamma` (TRL CPO default 0.5).
      denominator: optional positive, finite pair count replacing :math:`B`.

    Returns:
      ``LossResult``; metrics ``rewards/chosen``, ``rewards/rejected``, ``rewards/margin``
      (batch means of :math:`\hat r_w,\hat r_l,z`; for ``simpo``
      :math:`\beta\bar\ell_w,\beta\bar\ell_l` and their difference) and
      ``rewards/accuracy`` (fraction with margin :math:`>0`), all detached.
    """
    _checks.check_choice("loss_type", loss_type, LOSS_TYPES)
    chosen_logp = _pair_input("chosen_logp", chosen_logp)
    shape = tuple(chosen_logp.shape)
    rejected_logp = _pair_input("rejected_logp", rejected_logp, shape)
    b = float(beta)
    _checks.check_positive("beta", b)
    if not math.isfinite(b):
        raise ValueError(f"beta: must be finite, got {beta}")
    ls = float(label_smoothing)
    _checks.check_in_range("label_smoothing", ls, 0.0, 0.5, inclusive=(True, False))
    if ls > 0 and loss_type in ("hinge", "ipo"):
        raise ValueError(f"label_smoothing: must be 0 with loss_type {loss_type!r}, got {label_smoothing}")
    have_len = chosen_length is not None or rejected_length is not None
    if have_len and (chosen_length is None or rejected_length is None):
        missing = "rejected_length" if rejected_length is None else "chosen_length"
        raise ValueError(f"{missing}: chosen_length and rejected_length go together")
    if have_len:
        len_c = _lengths("chosen_length", chosen_length, shape)
        len_r = _lengths("rejected_length", rejected_length, shape)
    elif loss_type == "simpo":
        raise ValueError("chosen_length: loss_type 'simpo' needs chosen_length and rejected_length")

    if loss_type == "simpo":
        g = float(simpo_gamma)
        if not math.isfinite(g):
            raise ValueError(f"simpo_gamma: must be finite, got {simpo_gamma}")
        chosen_reward = b * chosen_logp / len_c
        rejected_reward = b * rejected_logp / len_r
        z = chosen_reward - rejected_reward
        x = z - g
        per_pair = -(1.0 - ls) * F.logsigmoid(x) - ls * F.logsigmoid(-x) if ls > 0 else -F.logsigmoid(x)
    else:
        if ref_chosen_logp is None or ref_rejected_logp is None:
            name = "ref_chosen_logp" if ref_chosen_logp is None else "ref_rejected_logp"
            raise ValueError(f"{name}: required by loss_type {loss_type!r}")
        ref_c = _pair_input("ref_chosen_logp", ref_chosen_logp, shape).detach()
        ref_r = _pair_input("ref_rejected_logp", ref_rejected_logp, shape).detach()
        chosen_ratio = chosen_logp - ref_c
        rejected_ratio = rejected_logp - ref_r
        chosen_reward = b * chosen_ratio
        rejected_reward = b * rejected_ratio
        z = chosen_reward - rejected_reward
        if loss_type == "sigmoid":
            per_pair = -F.logsigmoid(z)
            if ls > 0:
                per_pair = (1.0 - ls) * per_pair - ls * F.logsigmoid(-z)
        elif loss_type == "robust":
            per_pair = (-(1.0 - ls) * F.logsigmoid(z) + ls * F.logsigmoid(-z)) / (1.0 - 2.0 * ls)
        elif loss_type == "hinge":
            per_pair = torch.relu(1.0 - z)
        else:  # ipo
            h = chosen_ratio / len_c - rejected_ratio / len_r if have_len else chosen_ratio - rejected_ratio
            per_pair = (h - 1.0 / (2.0 * b)).square()
    if denominator is None:
        d = torch.as_tensor(float(shape[0]), dtype=per_pair.dtype, device=per_pair.device)
    else:
        d = check_denominator(denominator, per_pair.dtype, per_pair.device)
    loss = per_pair.sum() / d
    with torch.no_grad():
        metrics = {
            "rewards/chosen": chosen_reward.detach().mean(),
            "rewards/rejected": rejected_reward.detach().mean(),
            "rewards/margin": z.detach().mean(),
            "rewards/accuracy": (z.detach() > 0).to(per_pair.dtype).mean(),
        }
    return LossResult(loss, metrics)


__all__ = ["dpo_loss", "sequence_logp", "LOSS_TYPES"]
