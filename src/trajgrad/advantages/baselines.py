r"""Baselines and group-relative advantages (spec §4, §5, §11, §12, §24).

A baseline :math:`b` that does not depend on the sampled action leaves the policy gradient
unbiased, :math:`\mathbb E[b\,\nabla\log\pi(a\mid h)\mid h]=0` (§5); subtracting it is a
control variate, not a change of objective. *Dividing* by a per-group statistic is
different: it reweights prompts (§12). Both choices are explicit arguments here.

=================================  ========================================================
``group_advantages(scale="std")``  :math:`A_i=(R_i-\bar R)/(s_R+\epsilon)`, GRPO (§11)
``group_advantages(scale="none")`` :math:`A_i=R_i-\bar R`, Dr. GRPO (§12)
``group_advantages(               :math:`A_i=(R_i-\bar R_g)/(s_{batch}+\epsilon)`, centred
scale="batch_std")``               per group, scaled by the batch reward std
``leave_one_out``                  :math:`A_i=R_i-\frac{1}{G-1}\sum_{k\ne i}R_k` (RLOO, §5)
``whiten``                         :math:`(x-\mu)/\sqrt{\sigma^2+\epsilon}` over the valid
                                   entries of the batch (verl's GAE advantage whitening)
``broadcast_to_tokens``            ``turn_advantages.gather(1, turn_ids)`` (§4)
=================================  ========================================================

**Which standard deviation.** ``unbiased=False`` (the default) is the population std
:math:`\sqrt{\frac1G\sum(R_i-\bar R)^2}`; ``unbiased=True`` is Bessel's
:math:`\sqrt{\frac1{G-1}\sum(R_i-\bar R)^2}`, what ``torch.std`` returns and what verl's GRPO
and TRL's GRPO use. The ratio is :math:`\sqrt{G/(G-1)}`: at :math:`G=8` the unbiased std is
6.9% larger (its variance 14.3% larger), so every std-scaled advantage is 6.5% smaller, a
uniform rescaling that acts like a 6.5% smaller learning rate under SGD (Adam mostly absorbs
it). The population std is kept as the default: it is the statistic of the group itself,
and it makes :math:`\sum_iA_i^2=G` (up to :math:`\epsilon`).

REINFORCE++, MaxRL and GDPO, built from these pieces, are in :mod:`trajgrad.advantages.normalized`.

All rewards are evidence: they are detached and no output carries a gradient.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _checks
from ._groups import _eps, _per_item, _rewards, _stats, _weighted_whiten
from ..registry import AdvantageEstimator, Param, finite_positive, flag, register_advantage_estimator

__all__ = ["GroupAdvantages", "SCALES", "group_advantages", "leave_one_out", "broadcast_to_tokens", "whiten",
           "WHITEN_EPS", "WHITEN_EMPTY"]

SCALES = ("std", "none", "batch_std")


class GroupAdvantages(NamedTuple):
    """Result of :func:`group_advantages`.

    Attributes:
      advantages: same shape as ``rewards`` (``[N, G]`` or ``[M]``).
      mean: ``[N]`` per-group mean reward :math:`\\bar R` (ragged input: one entry per group,
        groups ordered by increasing group id, i.e. ``torch.unique(group_ids)``).
      std: per-group std :math:`s_R` (same layout as ``mean``; the population std unless the
        estimator was asked for the unbiased one); exactly 0 for zero-variance groups.
      zero_variance: per-group ``bool``, True when every reward in the group is equal (e.g.
        all-fail / all-success under a binary verifier, §11). Such groups carry no relative
        signal: their advantages are exactly 0. Count them (``zero_variance.sum()``) and
        report them; dynamic sampling that resamples them changes which prompts are trained.
    """

    advantages: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    zero_variance: torch.Tensor


def group_advantages(
    rewards: torch.Tensor,
    *,
    scale: str = "std",
    eps: float = 1e-6,
    leave_one_out: bool = False,
    group_ids: Optional[torch.Tensor] = None,
    unbiased: bool = False,
) -> GroupAdvantages:
    r"""Group-relative advantages for ``G`` rollouts of each prompt (spec §11, §12, §5).

    With :math:`\bar R=\frac1G\sum_iR_i` and the *population* std
    :math:`s_R=\sqrt{\frac1G\sum_i(R_i-\bar R)^2}` of the group:

    * ``scale="std"`` (GRPO, Shao et al. 2024; §11):
      :math:`A_i=(R_i-\bar R)/(s_R+\epsilon)`.
    * ``scale="none"`` (Dr. GRPO, Liu et al. 2025; §12): :math:`A_i=R_i-\bar R`. Keeps the
      reward scale, so prompts with larger reward differences weigh more.
    * ``scale="batch_std"``: :math:`A_i=(R_i-\bar R_g)/(s_{batch}+\epsilon)` with
      :math:`s_{batch}` the population std of *all* rewards in the batch: centred per group,
      one common scale, so the relative weight of prompts is preserved.

    ``leave_one_out=True`` replaces the centring by the leave-one-out baseline (§5)
    :math:`b_i=\frac{1}{G-1}\sum_{k\ne i}R_k`, which excludes rollout :math:`i` and so does
    not couple :math:`A_i` to its own reward through the mean; note
    :math:`R_i-b_i=\frac{G}{G-1}(R_i-\bar R)`. The scale (if any) is applied after.

    Standardization is not neutral: ``"std"`` gives prompts with a tiny reward spread the
    same advantage magnitude as prompts with a large one (§12), and it makes the
    advantages invariant to multiplying the rewards by a positive constant, while
    ``"none"`` scales with them. All modes are invariant to adding a constant (§24).

    Zero-variance groups (every reward equal, e.g. all-fail or all-success, §11) have
    ``std == 0``, ``zero_variance == True`` and advantages exactly 0 in every mode; they are
    returned, never dropped.

    Args:
      rewards: ``[N, G]`` (``N`` prompts, ``G`` rollouts each), or ``[M]`` together with
        ``group_ids`` for ragged groups. Detached.
      scale: ``"std"`` (default, GRPO), ``"none"`` or ``"batch_std"``.
      eps: :math:`\epsilon\ge0` added to the std (``eps=0`` is allowed: zero-variance groups
        are still exactly 0, never 0/0).
      leave_one_out: use the §5 baseline; every group needs at least 2 rollouts.
      group_ids: ``[M]`` integer group label of each reward (any integers; groups are
        reported in increasing id order).
      unbiased: divide the variance by :math:`G-1` instead of :math:`G` (Bessel), for the
        group std and the batch std alike: verl's and TRL's GRPO (see the module docstring
        for the size of the difference). A group of one rollout still gets advantage 0
        (verl gives it :math:`R_i/(1+\epsilon)`).

    Returns:
      :class:`GroupAdvantages` ``(advantages, mean, std, zero_variance)``, all detached.
    """
    _checks.check_choice("scale", scale, SCALES)
    eps = float(eps)
    _checks.check_positive("eps", eps, allow_zero=True)
    if eps == float("inf"):
        raise ValueError("eps: must be finite")
    rewards = _rewards(rewards)
    mean, std, zero_variance, total, count, index = _stats(rewards, group_ids, bool(unbiased))
    if leave_one_out:
        if bool((count < 2).any()):
            name = "rewards" if group_ids is None else "group_ids"
            raise ValueError(f"{name}: leave-one-out needs at least 2 rollouts in every group")
        baseline = (_per_item(total, index) - rewards) / (_per_item(count, index) - 1)
    else:
        baseline = _per_item(mean, index)
    centred = rewards - baseline
    if scale == "std":
        denom = _per_item(std, index) + eps
    elif scale == "batch_std":
        batch_std = rewards.std(correction=int(bool(unbiased))) if rewards.numel() > 1 else rewards.new_zeros(())
        denom = (batch_std + eps).expand_as(rewards)
    else:
        denom = None
    flat = _per_item(zero_variance, index).expand_as(rewards)
    if denom is not None:
        # Select a safe divisor where the result is replaced anyway (never 0/0).
        centred = centred / torch.where(flat | (denom == 0), torch.ones_like(denom), denom)
    advantages = torch.where(flat, torch.zeros_like(centred), centred)
    return GroupAdvantages(advantages, mean, std, zero_variance)


def leave_one_out(rewards: torch.Tensor, *, group_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    r"""Leave-one-out (RLOO) advantages (spec §5; Kool et al. 2019, Ahmadian et al. 2024).

    .. math::
        b_i = \frac{1}{G-1}\sum_{k\ne i}R_k,\qquad A_i = R_i - b_i.

    :math:`b_i` excludes rollout :math:`i`, so it is independent of the action that produced
    :math:`R_i` given the task, and the estimator is unbiased. Example (§5): rewards
    ``[0, 1, 2]`` give ``[-1.5, 0, +1.5]``.

    Args:
      rewards: ``[N, G]`` with ``G >= 2``, or ``[M]`` with ``group_ids`` (every group >= 2).
      group_ids: optional ``[M]`` integer group labels.

    Returns:
      Advantages with the shape of ``rewards`` (detached). A constant group gives exactly 0.
    """
    return group_advantages(rewards, scale="none", leave_one_out=True, group_ids=group_ids).advantages


def broadcast_to_tokens(
    turn_advantages: torch.Tensor,
    turn_ids: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""Give every action token the advantage of its turn (spec §4).

    .. math:: A_{b,j} = \hat A_{b,\,\mathrm{turn}(b,j)}\quad(m_{b,j}=1),\qquad 0\ \text{otherwise},

    i.e. ``turn_advantages.gather(1, turn_ids)``. The loss still distinguishes the tokens of
    a turn through their log-probability gradients; equal advantages do not claim equal
    causal effect (§4).

    Args:
      turn_advantages: ``[B, T]`` one advantage per semantic action (detached).
      turn_ids: ``[B, L]`` integer turn index of each token, in ``[0, T)`` at valid
        positions; ignored (may be -1 or anything) where ``mask == 0``.
      mask: optional ``[B, L]`` 0/1 action mask (default all valid).

    Returns:
      ``[B, L]`` token advantages, exactly 0 where ``mask == 0``; detached.
    """
    adv = _checks.as_tensor("turn_advantages", turn_advantages)
    _checks.check_ndim("turn_advantages", adv, 2)
    _checks.check_floating("turn_advantages", adv)
    adv = adv.detach()
    ids = _checks.as_tensor("turn_ids", turn_ids)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"turn_ids: expected an integer tensor, got dtype {ids.dtype}")
    _checks.check_ndim("turn_ids", ids, 2)
    if ids.shape[0] != adv.shape[0]:
        raise ValueError(
            f"turn_ids: expected {adv.shape[0]} rows (the rows of turn_advantages), got shape {tuple(ids.shape)}"
        )
    if mask is None:
        m = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    else:
        m = _checks.check_mask("mask", mask, ids.shape)
    n_turns = adv.shape[1]
    bad = m & ((ids < 0) | (ids >= n_turns))
    if bool(bad.any()):
        value = ids[bad].flatten()[0].item()
        raise ValueError(f"turn_ids: id {value} at a valid position is outside [0, {n_turns})")
    if n_turns == 0:
        return torch.zeros(ids.shape, dtype=adv.dtype, device=adv.device)
    safe = torch.where(m, ids, torch.zeros_like(ids)).to(torch.long)
    out = torch.gather(adv, 1, safe)
    _checks.check_finite("turn_advantages", out, m)
    return _checks.fill_masked(out, m)


# ------------------------------------------------------------------ batch normalization
WHITEN_EPS = ("variance", "std")
WHITEN_EMPTY = ("error", "zeros")


def _whiten_options(eps_placement: str, empty: str) -> bool:
    """Check :func:`whiten`'s ``eps_placement`` and ``empty``; True for sigma + eps."""
    _checks.check_choice("eps_placement", eps_placement, WHITEN_EPS)
    _checks.check_choice("empty", empty, WHITEN_EMPTY)
    return eps_placement == "std"


def whiten(
    values: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: float = 1e-8,
    eps_placement: str = "variance",
    empty: str = "error",
) -> torch.Tensor:
    r"""Whiten ``values`` over the valid entries of the whole batch (verl's ``masked_whiten``).

    .. math::
        \mu=\frac{\sum m\,x}{n},\quad \sigma^2=\frac{\sum m\,(x-\mu)^2}{n-1}\ (\text{or }/n),\quad
        \tilde x=\frac{x-\mu}{\sqrt{\sigma^2+\epsilon}}\ (+\mu\ \text{if not shift\_mean}),\quad n=\sum m.

    verl (0.9.1, ``verl.utils.torch_functional.masked_whiten``) applies it to GAE advantages
    over every valid token of the batch (``compute_gae_advantage_return``), to REINFORCE++
    returns and to GDPO's summed advantages; its defaults are the ones here
    (``shift_mean=True``, Bessel-corrected variance over tokens, :math:`\epsilon=10^{-8}` under
    the square root). With ``shift_mean=False`` the batch mean is added back: the result keeps
    the mean and gets unit variance around it. Token-level statistics weigh every *token*
    equally: long responses weigh more in :math:`\mu,\sigma` (§13).

    Whitening is a batch-level affine map of the advantages: subtracting :math:`\mu` is a
    (batch-dependent) constant baseline, dividing by :math:`\sigma` a batch-dependent step
    size; neither is a per-prompt reweighting (§12). The statistics must be computed over the
    *whole* batch (all micro-batches) before the update.

    A batch whose valid entries are all equal returns exactly 0 (or :math:`\mu` with
    ``shift_mean=False``), where verl returns rounding noise times :math:`10^4`.

    ``eps_placement="std"`` divides by :math:`\sigma+\epsilon` instead (OpenRLHF's and
    REINFORCE++'s reference code); ``empty="zeros"`` returns zeros for a batch with no valid
    entry (or one, where the unbiased variance needs two) instead of the error. Worked
    example, :math:`x=(1, 3)`, unbiased, :math:`\epsilon=1`: :math:`\mu=2`,
    :math:`\sigma^2=2`; ``"variance"`` gives :math:`\mp1/\sqrt3=\mp0.577350`, ``"std"``
    gives :math:`\mp1/(\sqrt2+1)=\mp0.414214`.

    Args:
      values: any-shape floating tensor (detached here); NaN/inf allowed at masked entries.
      mask: optional 0/1 mask of the same shape (default all valid).
      shift_mean: False adds the mean back after scaling.
      unbiased: Bessel's correction :math:`n/(n-1)` (verl's default); needs :math:`n\ge2`.
      eps: :math:`\epsilon\ge0` added to the variance (or the std, below).
      eps_placement: ``"variance"`` (:math:`\sqrt{\sigma^2+\epsilon}`, default) or ``"std"``
        (:math:`\sigma+\epsilon`).
      empty: ``"error"`` (default: ``ValueError`` naming ``mask``) or ``"zeros"``, for a batch
        with too few valid entries.

    Returns:
      Whitened values, shape of ``values``, exactly 0 at masked entries; detached.
    """
    x = _checks.as_tensor("values", values)
    _checks.check_floating("values", x)
    x = x.detach()
    m = torch.ones(x.shape, dtype=torch.bool, device=x.device) if mask is None else _checks.check_mask("mask", mask, x.shape)
    _checks.check_finite("values", x, m)
    std_plus_eps = _whiten_options(eps_placement, empty)
    return _weighted_whiten(x, m.to(x.dtype), shift_mean=bool(shift_mean), unbiased=bool(unbiased), eps=_eps(eps),
                            std_plus_eps=std_plus_eps, empty=empty)


# ---------------------------------------------------------------------- the recipes' fields and registry entries
STD_EPS = Param("std_eps", 1e-6, "ε in ``(R - mean)/(std + ε)``.", float,
                lambda v: finite_positive("std_eps", v, allow_zero=True))
STD_UNBIASED = Param("std_unbiased", False, "the group (and batch) std of the std-scaling estimators divides by G − 1 "
                     "(Bessel; verl's and TRL's GRPO) instead of G (default, the population std): at G = 8 the "
                     "advantages are 6.5% smaller (``trajgrad.advantages.group_advantages``).", bool,
                     lambda v: flag("std_unbiased", v))
_WHITEN_DOC = ("batch whitening (REINFORCE++ and GAE's ``whiten_advantages``; :func:`trajgrad.advantages.whiten`): "
               "``whiten_eps_placement`` ``\"variance\"`` divides by sqrt(σ² + ε) (verl), ``\"std\"`` by σ + ε "
               "(the REINFORCE++ reference code); ``whiten_empty`` ``\"error\"`` refuses a batch with too few valid "
               "entries, ``\"zeros\"`` gives it zero advantages.")
WHITEN_EPS_FIELD = Param("whiten_eps_placement", "variance", _WHITEN_DOC, str,
                         lambda v: _checks.check_choice("whiten_eps_placement", v, WHITEN_EPS))
WHITEN_EMPTY_FIELD = Param("whiten_empty", "error", _WHITEN_DOC, str,
                           lambda v: _checks.check_choice("whiten_empty", v, WHITEN_EMPTY))


def whiten_empty_text(o, what: str) -> str:
    """The ``explain`` line of ``whiten_empty``: empty for the default (refused), else one line."""
    return f"\n    a batch with no counted {what} gives A = 0 (whiten_empty = 'zeros')" if o.whiten_empty == "zeros" else ""


def _group(scale: str, *, leave_one_out: bool = False):
    def call(o, rewards, group_ids=None):
        return group_advantages(rewards, scale=scale, eps=o.std_eps, leave_one_out=leave_one_out, group_ids=group_ids,
                                unbiased=o.std_unbiased if scale != "none" else False)
    return call


def std_text(o) -> str:
    """How ``explain`` names the recipe's std (population or Bessel)."""
    return "unbiased std (1/(G−1), Bessel)" if o.std_unbiased else "population std (1/G)"


def _raw_return(o, rewards, group_ids=None):
    r = torch.as_tensor(rewards)
    return GroupAdvantages(r.clone(), torch.zeros_like(r), torch.zeros_like(r), torch.zeros(0, dtype=torch.bool))


register_advantage_estimator(AdvantageEstimator(
    name="return", level="sequence", call=_raw_return, fields=(),
    text=lambda o: "A_i = R_i  (the raw return; no baseline)",
))
register_advantage_estimator(AdvantageEstimator(
    name="group_std", level="sequence", call=_group("std"), fields=("std_eps", "std_unbiased"), min_group=2,
    params=(STD_EPS, STD_UNBIASED),
    text=lambda o: (f"A_i = (R_i − mean_G(R)) / (std_G(R) + {o.std_eps:g}),  G = {o.group_size}, {std_text(o)}\n"
                    "    groups with std = 0 have A = 0 (no relative signal, §11); std scaling reweights prompts (§12)"),
))
register_advantage_estimator(AdvantageEstimator(
    name="group_center", level="sequence", call=_group("none"), fields=(), min_group=2,
    text=lambda o: f"A_i = R_i − mean_G(R),  G = {o.group_size}  (no std scaling: Dr. GRPO, §12)",
))
register_advantage_estimator(AdvantageEstimator(
    name="batch_std", level="sequence", call=_group("batch_std"), fields=("std_eps", "std_unbiased"), min_group=2,
    params=(STD_EPS, STD_UNBIASED),
    text=lambda o: f"A_i = (R_i − mean_G(R)) / (std_batch(R) + {o.std_eps:g}),  G = {o.group_size}, {std_text(o)}",
))
register_advantage_estimator(AdvantageEstimator(
    name="leave_one_out", level="sequence", call=_group("none", leave_one_out=True), fields=(), min_group=2,
    text=lambda o: f"A_i = R_i − (1/(G−1)) Σ_{{k≠i}} R_k,  G = {o.group_size}  (leave-one-out, §5)",
))
