r"""Advantage estimators built on group and batch statistics: REINFORCE++, MaxRL, GDPO (spec §5, §11, §12).

================================  ===========================================================
``reinforce_pp_advantages``       REINFORCE++: rewards (optionally group-centred) normalized
                                  over the whole batch (Hu et al. 2025)
``reinforce_pp_token_advantages`` the token-level form: reward-to-go of per-token rewards,
                                  whitened over every valid token (verl's REINFORCE++)
``maxrl_advantages``              :math:`A_i=(R_i-\bar R)/\bar R` (MaxRL, Tajwar et al. 2026)
``gdpo_advantages``               each reward component normalized within its group, summed,
                                  normalized over the batch (GDPO, Liu et al. 2026)
================================  ===========================================================

Same conventions as :mod:`trajgrad.advantages.baselines`: rewards ``[N, G]`` (or ``[M]`` with integer
``group_ids``), detached, results as :class:`trajgrad.advantages.baselines.GroupAdvantages`.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _checks
from ._groups import _eps, _per_item, _rewards, _stats, _weighted_whiten
from ..registry import AdvantageEstimator, Param, finite_positive, flag, register_advantage_estimator
from .baselines import (STD_EPS, STD_UNBIASED, WHITEN_EMPTY, WHITEN_EMPTY_FIELD, WHITEN_EPS, WHITEN_EPS_FIELD,
                        GroupAdvantages, group_advantages, std_text, whiten, whiten_empty_text)
from .returns import reward_to_go

__all__ = ["reinforce_pp_advantages", "reinforce_pp_token_advantages", "maxrl_advantages", "gdpo_advantages",
           "MAXRL_EPS"]


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    *,
    group_baseline: bool = False,
    group_ids: Optional[torch.Tensor] = None,
    lengths: Optional[torch.Tensor] = None,
    unbiased: bool = True,
    eps: float = 1e-8,
    eps_placement: str = "variance",
    empty: str = "error",
) -> GroupAdvantages:
    r"""REINFORCE++ advantages: rewards normalized over the global batch (Hu et al. 2025, arXiv 2501.03262).

    .. math::
        \tilde R_i = R_i - b_i,\qquad A_i = \frac{\tilde R_i-\mu}{\sqrt{\sigma^2+\epsilon}},

    with :math:`b_i=0` (REINFORCE++) or the group mean :math:`\bar R_{g(i)}`
    (``group_baseline=True``, REINFORCE++-baseline), and :math:`\mu,\sigma` the mean and std of
    :math:`\tilde R` over the *whole batch*, not per prompt: the paper's point is that
    per-prompt std normalization (GRPO, §11–§12) is biased and overfits easy prompts, while
    one global scale is effectively unbiased. The KL to the reference is put in the reward,
    per token (``kl_placement="reward"``, §9), before this normalization.

    ``lengths`` (the response token counts) weighs each response by its number of tokens,
    which is exactly verl's form: verl broadcasts :math:`\tilde R_i` to the tokens and whitens
    over all valid tokens (:func:`whiten`). Without it every response weighs one (the paper's
    and ms-swift's response-level form). For REINFORCE++ with a per-token KL in the reward, the
    per-token returns differ along a response; :func:`reinforce_pp_token_advantages` is that
    token-level form.

    Args:
      rewards: ``[N, G]``, or ``[M]`` (with ``group_ids`` for the baseline; without it, one
        rollout per prompt). Detached.
      group_baseline: subtract the group mean first (needs groups: ``[N, G]`` or ``group_ids``).
      group_ids: optional ``[M]`` integer group labels.
      lengths: optional token counts, shape of ``rewards`` (``>= 0``; 0 = not counted).
      unbiased: Bessel-corrected batch variance (verl's default).
      eps: :math:`\epsilon` under the square root (verl: :math:`10^{-8}`).
      eps_placement: ``"variance"`` (:math:`\sqrt{\sigma^2+\epsilon}`, default) or ``"std"``
        (:math:`(\tilde R_i-\mu)/(\sigma+\epsilon)`, the REINFORCE++ reference code); see
        :func:`trajgrad.advantages.whiten` for a worked example.
      empty: ``"error"`` (default) or ``"zeros"``: advantages of a batch with no counted
        response (all ``lengths`` 0, or one response with ``unbiased``) are 0.

    Returns:
      :class:`GroupAdvantages`; ``mean``/``std``/``zero_variance`` are per group (one group =
      the whole batch when there are no groups), population std of the raw rewards.
    """
    r = _rewards(rewards)
    eps = _eps(eps)
    _checks.check_choice("eps_placement", eps_placement, WHITEN_EPS)
    _checks.check_choice("empty", empty, WHITEN_EMPTY)
    grouped = group_ids is not None or r.ndim == 2
    if group_baseline and not grouped:
        raise ValueError("group_ids: group_baseline=True needs groups ([N, G] rewards or group_ids)")
    if grouped:
        mean, std, zero_variance, _, _, index = _stats(r, group_ids)
    else:
        _checks.check_ndim("rewards", r, 1)
        mean, std, zero_variance, _, _, index = _stats(r[None, :], None)
    centred = r - _per_item(mean, index) if group_baseline else r
    if lengths is None:
        w = torch.ones_like(r)
    else:
        w = _checks.as_tensor("lengths", lengths).detach().to(r.dtype)
        _checks.check_shape("lengths", w, r.shape, against="rewards")
        _checks.check_finite("lengths", w)
        if bool((w < 0).any()):
            raise ValueError("lengths: must be >= 0")
    adv = _weighted_whiten(centred, w, shift_mean=True, unbiased=bool(unbiased), eps=eps,
                           name="lengths" if lengths is not None else "rewards",
                           std_plus_eps=eps_placement == "std", empty=empty)
    return GroupAdvantages(adv, mean, std, zero_variance)


def reinforce_pp_token_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    unbiased: bool = True,
    eps: float = 1e-8,
    eps_placement: str = "variance",
    empty: str = "error",
) -> torch.Tensor:
    r"""Token-level REINFORCE++: reward-to-go of the per-token rewards, whitened over the batch's tokens.

    .. math:: G_t=\sum_{l\ge0}\gamma^l r_{t+l},\qquad A_t=\frac{G_t-\mu}{\sqrt{\sigma^2+\epsilon}}
        \ \ (\mu,\sigma\ \text{over every valid token of the batch}),

    where :math:`r_t` carries the per-token KL penalty :math:`-\beta k_t` and the outcome
    reward at the last token (Hu et al. 2025; verl's ``reinforce_plus_plus`` estimator).
    :func:`trajgrad.advantages.returns.reward_to_go` bridges masked (observation) tokens without
    discount; verl's loop instead restarts the sum at every masked position, which is the
    same for single-turn responses padded on the right.

    Args:
      token_rewards: ``[B, L]`` per-token rewards (detached).
      mask: ``[B, L]`` action mask.
      gamma: discount in ``[0, 1]``.
      unbiased, eps, eps_placement, empty: see :func:`trajgrad.advantages.whiten` (``empty="zeros"``:
        a batch with no valid token gives zeros).
    Returns:
      ``[B, L]`` advantages, 0 at masked positions; detached.
    """

    g = reward_to_go(token_rewards, gamma=gamma, mask=mask)
    return whiten(g, mask, unbiased=unbiased, eps=eps, eps_placement=eps_placement, empty=empty)


MAXRL_EPS = ("max", "add")


def maxrl_advantages(rewards: torch.Tensor, *, group_ids: Optional[torch.Tensor] = None, eps: float = 0.0,
                     eps_mode: str = "max", centred: bool = True) -> GroupAdvantages:
    r"""MaxRL advantages: the group-centred reward divided by the group *mean* (Tajwar et al. 2026, arXiv 2602.02710).

    .. math:: A_i=\frac{R_i-\bar R}{\bar R}\quad(\bar R>0),\qquad A_i=0\quad(\bar R=0).

    For binary rewards with :math:`K` successes among :math:`G` rollouts,
    :math:`\bar R=K/G` and :math:`\frac1G\sum_iA_i\nabla\log\pi(y_i)=\frac1K\sum_{i:R_i=1}
    \nabla\log\pi(y_i)-\frac1G\sum_i\nabla\log\pi(y_i)`: the score averaged over the
    *successful* rollouts only (the paper's unbiased estimator of the order-:math:`G`
    truncation of :math:`\nabla\log p_\theta(x)`, maximum likelihood of success) minus a
    zero-mean control variate. Prompts are weighted like :math:`1/p` (hard prompts more),
    against GRPO's :math:`1/\sqrt{p(1-p)}`.

    **Mean-zero rule.** Rewards must be non-negative (a success probability, e.g. 0/1 or a
    pass rate in [0, 1]); then :math:`\bar R=0` means no rollout succeeded, and the
    advantages are exactly 0 (the paper's no-success convention: the success-conditioned
    average is empty). All-success groups give 0 as well (:math:`R_i=\bar R`). With the
    default ``eps=0`` there is no :math:`\epsilon`: a tiny positive mean gives large
    advantages, by design (weight :math:`1/p`).

    **Conventions.** The denominator :math:`D` is :math:`\max(\bar R,\epsilon)`
    (``eps_mode="max"``, default) or :math:`\bar R+\epsilon` (``"add"``, TRL's form);
    :math:`A_i=(R_i-\bar R)/D`, or the uncentred :math:`A_i=R_i/D` (``centred=False``: the
    success-conditioned average without the control variate; an all-success group then gives
    1). :math:`D=0` (no success, :math:`\epsilon=0`) gives 0. Worked example,
    :math:`R=(1,0,0,0)`, :math:`\bar R=0.25`, :math:`\epsilon=0.25`: ``"max"`` gives
    :math:`(3,-1,-1,-1)`, ``"add"`` gives :math:`(1.5,-0.5,-0.5,-0.5)`; ``centred=False``
    with :math:`\epsilon=0` gives :math:`(4,0,0,0)`.

    Args:
      rewards: ``[N, G]`` or ``[M]`` with ``group_ids``; every entry ``>= 0``. Detached.
      group_ids: optional ``[M]`` integer group labels.
      eps: :math:`\epsilon\ge0` (finite).
      eps_mode: ``"max"`` or ``"add"`` (above).
      centred: subtract the group mean (default) or not.

    Returns:
      :class:`GroupAdvantages` (population std of the rewards; ``zero_variance`` flags
      all-fail and all-success groups).
    """
    r = _rewards(rewards)
    if r.numel() and bool((r < 0).any()):
        raise ValueError("rewards: MaxRL needs non-negative rewards (a success indicator or probability)")
    eps = _eps(eps)
    _checks.check_choice("eps_mode", eps_mode, MAXRL_EPS)
    mean, std, zero_variance, _, _, index = _stats(r, group_ids)
    m = _per_item(mean, index).expand_as(r)
    den = m.clamp_min(eps) if eps_mode == "max" else m + eps
    safe = torch.where(den > 0, den, torch.ones_like(den))
    adv = torch.where(den > 0, ((r - m) if centred else r) / safe, torch.zeros_like(r))
    if centred:
        adv = torch.where(_per_item(zero_variance, index).expand_as(r), torch.zeros_like(adv), adv)
    return GroupAdvantages(adv, mean, std, zero_variance)


def gdpo_advantages(
    rewards: torch.Tensor,
    *,
    group_ids: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    unbiased: bool = False,
    batch_normalize: bool = True,
) -> GroupAdvantages:
    r"""GDPO advantages: each reward component normalized within its group, then summed (Liu et al. 2026, arXiv 2601.05242).

    For components :math:`k=1..K` with weights :math:`w_k`:

    .. math::
        A^{(k)}_i=\frac{R^{(k)}_i-\bar R^{(k)}_g}{s^{(k)}_g+\epsilon},\qquad
        S_i=\sum_kw_kA^{(k)}_i,\qquad
        A_i=\frac{S_i-\mathrm{mean}_{batch}(S)}{\mathrm{std}_{batch}(S)+\epsilon}.

    Normalizing the *sum* of rewards (GRPO with several rewards) maps different reward
    combinations to the same advantage ("reward collapse"); normalizing each component first
    keeps them apart, and the final batch normalization keeps the range independent of
    :math:`K`. A component that is constant within a group contributes exactly 0 there.

    Peers: TRL 1.16 (``multi_objective_aggregation="normalize_then_sum"``) is exactly this with
    ``unbiased=True, eps=1e-4``. verl 0.9.1 (``gdpo``) uses ``unbiased=True, eps=1e-6`` for the
    groups and whitens :math:`S` over tokens (:func:`whiten`: :math:`\sqrt{\sigma^2+10^{-8}}`,
    token-weighted); ``batch_normalize=False`` returns :math:`S` for that.

    Args:
      rewards: ``[N, G, K]``, or ``[M, K]`` with ``group_ids``. Detached.
      group_ids: optional ``[M]`` integer group labels.
      weights: optional ``[K]`` component weights (default all 1).
      eps: :math:`\epsilon\ge0` in both normalizations.
      unbiased: Bessel-corrected std in both normalizations.
      batch_normalize: apply the final batch normalization.

    Returns:
      :class:`GroupAdvantages`: advantages ``[N, G]`` / ``[M]``; ``mean``/``std`` per group of
      the weighted raw reward sum :math:`\sum_kw_kR^{(k)}`; ``zero_variance`` where every
      component is constant within the group.
    """
    r = _rewards(rewards)
    eps = _eps(eps)
    _checks.check_ndim("rewards", r, 3 if group_ids is None else 2)
    K = r.shape[-1]
    if K == 0:
        raise ValueError("rewards: no reward component (K = 0)")
    if weights is None:
        w = torch.ones(K, dtype=r.dtype, device=r.device)
    else:
        w = _checks.as_tensor("weights", weights).detach().to(r.dtype)
        _checks.check_shape("weights", w, (K,), against="the reward components")
        _checks.check_finite("weights", w)
    total = torch.zeros(r.shape[:-1], dtype=r.dtype, device=r.device)
    flat = None
    for k in range(K):
        ga = group_advantages(r[..., k], scale="std", eps=eps, group_ids=group_ids, unbiased=unbiased)
        total = total + w[k] * ga.advantages
        flat = ga.zero_variance if flat is None else flat & ga.zero_variance
    raw = (r * w).sum(-1)
    mean, std, _, _, _, _ = _stats(raw, group_ids)
    if batch_normalize:
        total = _weighted_whiten(total, torch.ones_like(total), shift_mean=True, unbiased=bool(unbiased), eps=eps,
                                 name="rewards", std_plus_eps=True) if total.numel() > 1 else torch.zeros_like(total)
    return GroupAdvantages(total, mean, std, flat)


# ---------------------------------------------------------------------- the recipes' registry entries
def _reinforce_pp(group_baseline: bool):
    def call(o, rewards, group_ids=None):
        return reinforce_pp_advantages(rewards, group_baseline=group_baseline, group_ids=group_ids,
                                       unbiased=o.std_unbiased, eps=o.std_eps, eps_placement=o.whiten_eps_placement,
                                       empty=o.whiten_empty)
    return call


def _reinforce_pp_text(group_baseline: bool):
    def text(o) -> str:
        centred = "R_i − mean_G(R)" if group_baseline else "R_i"
        var = "Bessel (1/(n−1))" if o.std_unbiased else "population (1/n)"
        g = f",  G = {o.group_size}" if group_baseline else ""
        scale = (f"sqrt(var_batch(Ã) + {o.std_eps:g})" if o.whiten_eps_placement == "variance" else
                 f"(std_batch(Ã) + {o.std_eps:g})")
        return (f"Ã_i = {centred}{g};  A_i = (Ã_i − mean_batch(Ã)) / {scale},  "
                f"{var} variance\n"
                "    one normalization over the whole batch of responses, not per prompt (REINFORCE++; a per-token\n"
                "    KL goes into the reward before it, kl_placement = 'reward')" + whiten_empty_text(o, "response"))
    return text


_PP_FIELDS = ("std_eps", "std_unbiased", "whiten_eps_placement", "whiten_empty")
_PP_PARAMS = (STD_EPS, STD_UNBIASED, WHITEN_EPS_FIELD, WHITEN_EMPTY_FIELD)
register_advantage_estimator(AdvantageEstimator(
    name="reinforce_pp", level="sequence", call=_reinforce_pp(False), fields=_PP_FIELDS,
    text=_reinforce_pp_text(False), params=_PP_PARAMS,
))
register_advantage_estimator(AdvantageEstimator(
    name="reinforce_pp_baseline", level="sequence", call=_reinforce_pp(True), fields=_PP_FIELDS,
    min_group=2, text=_reinforce_pp_text(True), params=_PP_PARAMS,
))
MAXRL_EPS_FIELD = Param("maxrl_eps", 0.0, "MaxRL's ε ≥ 0 in the denominator D: ``max(mean_G(R), ε)`` "
                        "(``maxrl_eps_mode`` ``\"max\"``) or ``mean_G(R) + ε`` (``\"add\"``, TRL's form); 0: none. "
                        "``maxrl_advantages(eps=, eps_mode=)``.", float,
                        lambda v: finite_positive("maxrl_eps", v, allow_zero=True))
MAXRL_EPS_MODE = Param("maxrl_eps_mode", "max", "MaxRL's ε placement: ``\"max\"`` or ``\"add\"`` (see maxrl_eps).",
                       str, lambda v: _checks.check_choice("maxrl_eps_mode", v, MAXRL_EPS))
MAXRL_CENTRED = Param("maxrl_centred", True, "MaxRL subtracts the group mean (``True``, (R − mean)/D) or not "
                      "(``False``, R/D: the success-conditioned average without the control variate). "
                      "``maxrl_advantages(centred=)``.", bool, lambda v: flag("maxrl_centred", v))


def _maxrl_text(o) -> str:
    num = "R_i − mean_G(R)" if o.maxrl_centred else "R_i"
    if o.maxrl_eps == 0:
        den, zero = "mean_G(R)", "mean_G(R) = 0 (no success)"
    elif o.maxrl_eps_mode == "max":
        den, zero = f"max(mean_G(R), {o.maxrl_eps:g})", "the denominator is 0"
    else:
        den, zero = f"(mean_G(R) + {o.maxrl_eps:g})", "the denominator is 0"
    control = ("= the score averaged over successful rollouts minus a control\n    variate" if o.maxrl_centred else
               "= the score averaged over successful rollouts (uncentred: no control\n    variate)")
    return (f"A_i = ({num}) / {den},  G = {o.group_size};  A_i = 0 when {zero}\n"
            f"    rewards ≥ 0 (success indicator); {control}: prompts weigh ~1/p (maximum likelihood of success, MaxRL)")


register_advantage_estimator(AdvantageEstimator(
    name="maxrl", level="sequence", fields=("maxrl_eps", "maxrl_eps_mode", "maxrl_centred"), min_group=2,
    params=(MAXRL_EPS_FIELD, MAXRL_EPS_MODE, MAXRL_CENTRED),
    call=lambda o, rewards, group_ids=None: maxrl_advantages(rewards, group_ids=group_ids, eps=o.maxrl_eps,
                                                             eps_mode=o.maxrl_eps_mode, centred=o.maxrl_centred),
    text=_maxrl_text,
))


def _gdpo(o, rewards, group_ids=None):
    r = torch.as_tensor(rewards)
    if r.ndim == (1 if group_ids is not None else 2):  # one reward component
        r = r[..., None]
    return gdpo_advantages(r, group_ids=group_ids, eps=o.std_eps, unbiased=o.std_unbiased)


register_advantage_estimator(AdvantageEstimator(
    name="gdpo", level="sequence", call=_gdpo, fields=("std_eps", "std_unbiased"), min_group=2,
    params=(STD_EPS, STD_UNBIASED),
    text=lambda o: (f"A^k_i = (R^k_i − mean_G(R^k)) / (std_G(R^k) + {o.std_eps:g}) for each reward component k,  "
                    f"G = {o.group_size}, {std_text(o)}\n"
                    f"S_i = Σ_k A^k_i;  A_i = (S_i − mean_batch(S)) / (std_batch(S) + {o.std_eps:g})   (GDPO: components\n"
                    "    normalized apart, so different reward combinations keep different advantages)"),
))
