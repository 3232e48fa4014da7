r"""Outcome advantages with group baselines other than the mean: Pass@k, GPG, OPO (spec §5, §11, §12).

==========================  ================================================================
``passk_advantages``        only the best response of a group is credited, by its margin over
                            the second best (max@G with a leave-one-out baseline)
``gpg_advantages``          :math:`\alpha(R_i-\bar R)`, rescaled by the share of responses that
                            carry a signal (GPG, Chu et al. 2025)
``opo_advantages``          :math:`R_i-\sum_jL_jR_j/\sum_jL_j`, the length-weighted group mean
                            (OPO, Hao et al. 2025)
``remax_advantages``        :math:`R_i-R(\hat y_i)`, the reward of the greedy response as the
                            baseline (ReMax, Li et al. 2023)
``optimal_token_baseline``  a baseline per token position, the group's returns weighted by
                            each path's cumulative logit-gradient norm (OTB, Li et al. 2026)
==========================  ================================================================

Same conventions as :mod:`trajgrad.advantages.baselines`: rewards ``[N, G]`` (or ``[M]`` with integer
``group_ids``), detached; results are :class:`trajgrad.advantages.baselines.GroupAdvantages` (per-group
``mean``, population ``std`` and ``zero_variance`` of the raw rewards).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _checks
from ._groups import _eps, _per_item, _rewards, _stats
from ..registry import AdvantageEstimator, register_advantage_estimator
from .baselines import STD_EPS, STD_UNBIASED, GroupAdvantages, std_text
from .returns import reward_to_go

__all__ = ["passk_advantages", "gpg_advantages", "opo_advantages", "remax_advantages", "optimal_token_baseline",
           "TokenAdvantages"]


class TokenAdvantages(NamedTuple):
    advantages: torch.Tensor  # [B, L], 0 at masked positions
    returns: torch.Tensor     # [B, L] reward-to-go, 0 at masked positions
GPG_COUNTS = ("valid", "nonzero")
OTB_ALIGN = ("position", "action")


def _flat(r: torch.Tensor, group_ids):
    """``(flat [M], inverse [M], K, restore)`` for dense ``[N, G]`` or ragged ``[M]`` rewards."""
    if group_ids is None:
        _checks.check_ndim("rewards", r, 2)
        N, G = r.shape
        inverse = torch.arange(N, device=r.device)[:, None].expand(N, G).reshape(-1)
        return r.reshape(-1), inverse, N, lambda a: a.reshape(N, G)
    _, _, _, _, count, inverse = _stats(r, group_ids)
    return r, inverse, count.shape[0], lambda a: a


def passk_advantages(
    rewards: torch.Tensor,
    *,
    group_ids: Optional[torch.Tensor] = None,
    scale: bool = True,
    unbiased: bool = True,
    eps: float = 1e-6,
) -> GroupAdvantages:
    r"""Pass@k advantages: the best response of each group gets its margin over the second best.

    .. math::
        A_i=\begin{cases}\dfrac{R_{(1)}-R_{(2)}}{s_g+\epsilon},& i=\arg\max_{j\in g}R_j\\[4pt]
        0,&\text{otherwise,}\end{cases}

    with :math:`R_{(1)}\ge R_{(2)}` the two largest rewards of the group and :math:`s_g` its
    std (``scale=False``: no division). :math:`R_{(1)}-R_{(2)}` is the best response's reward
    minus the leave-one-out baseline of the objective :math:`\max_{j\le G}R_j` (the best of
    the *other* responses), so the update raises the probability of the group's best answer
    only: it optimizes max@G (pass@G for 0/1 rewards) instead of the mean reward (arXiv
    2503.19595; verl's ``grpo_passk``). Ties at the top give 0 to every response, whichever is
    called the best.

    Args:
      rewards: ``[N, G]`` or ``[M]`` with ``group_ids``; every group needs ``G >= 2``. Detached.
      group_ids: optional ``[M]`` integer group labels.
      scale: divide by the group std plus ``eps`` (verl's ``norm_adv_by_std_in_grpo``, default on).
      unbiased: Bessel's std (verl: ``torch.std``).
      eps: :math:`\epsilon\ge0`.

    Returns:
      :class:`GroupAdvantages` in the shape of ``rewards``.
    """
    r = _rewards(rewards)
    eps = _eps(eps)
    mean, std, zero_variance, _, count, _ = _stats(r, group_ids)
    if bool((count < 2).any()):
        raise ValueError("rewards: Pass@k advantages need at least 2 responses in every group")
    flat, inv, K, restore = _flat(r, group_ids)
    pos = torch.arange(flat.shape[0], device=flat.device)
    top = torch.full((K,), -torch.inf, dtype=flat.dtype, device=flat.device).scatter_reduce(0, inv, flat, "amax")
    is_top = flat == top[inv]
    first = torch.full((K,), flat.shape[0], dtype=pos.dtype, device=flat.device).scatter_reduce(
        0, inv, torch.where(is_top, pos, torch.full_like(pos, flat.shape[0])), "amin")
    best = pos == first[inv]
    others = torch.where(best, torch.full_like(flat, -torch.inf), flat)
    second = torch.full((K,), -torch.inf, dtype=flat.dtype, device=flat.device).scatter_reduce(0, inv, others, "amax")
    margin = top - second
    if scale:
        s = std * (count / (count - 1)).sqrt() if unbiased else std
        margin = margin / (s + eps) if eps > 0 else torch.where(margin > 0, margin / s.clamp_min(1e-300), margin)
    adv = torch.where(best, margin[inv], torch.zeros_like(flat))
    return GroupAdvantages(restore(adv), mean, std, zero_variance)


def gpg_advantages(
    rewards: torch.Tensor,
    *,
    group_ids: Optional[torch.Tensor] = None,
    count: str = "valid",
) -> GroupAdvantages:
    r"""GPG advantages: the group-centred reward rescaled by the batch's share of informative responses.

    Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning" (arXiv 2504.02546), used with the plain policy-gradient loss
    :math:`-A\,\log\pi_\theta` (no ratio, no clipping, no KL):

    .. math:: A_i=\alpha\,(R_i-\bar R_{g(i)}),\qquad \alpha=\frac{B}{B_{\mathrm{valid}}},

    :math:`B` the number of responses in the batch. In a group whose rewards are all equal
    every :math:`A_i` is 0, yet those responses still count in the loss's mean; :math:`\alpha`
    scales the remaining gradient back up to the mean over the responses that carry a signal
    (the paper's accurate gradient estimation). ``count`` picks :math:`B_{\mathrm{valid}}`:

    * ``"valid"`` (the paper's): responses in groups whose rewards are not all equal;
    * ``"nonzero"`` (verl 0.9.1's ``gpg``): responses whose *reward* is non-zero — with 0/1
      rewards it also counts all-correct groups and skips the failures of mixed groups.

    :math:`B_{\mathrm{valid}}=0` gives :math:`\alpha=B` (all advantages are then 0 for
    ``"valid"``). No std scaling (the paper's :math:`F_{norm}=1`).

    Args:
      rewards: ``[N, G]`` or ``[M]`` with ``group_ids``. Detached.
      group_ids: optional ``[M]`` integer group labels.
      count: ``"valid"`` or ``"nonzero"``.

    Returns:
      :class:`GroupAdvantages` in the shape of ``rewards``.
    """
    if count not in GPG_COUNTS:
        raise ValueError(f"count: must be one of {GPG_COUNTS}, got {count!r}")
    r = _rewards(rewards)
    mean, std, zero_variance, _, _, index = _stats(r, group_ids)
    centred = r - _per_item(mean, index)
    if count == "valid":
        valid = ~_per_item(zero_variance, index).expand_as(r)
    else:
        valid = r != 0
    alpha = r.numel() / valid.sum().clamp_min(1).to(r.dtype)
    return GroupAdvantages(alpha * centred, mean, std, zero_variance)


def opo_advantages(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    *,
    group_ids: Optional[torch.Tensor] = None,
) -> GroupAdvantages:
    r"""OPO advantages: the reward minus the length-weighted group mean (Hao et al. 2025, arXiv 2505.23585).

    .. math:: A_i=R_i-b_g,\qquad b_g=\frac{\sum_{j\in g}L_jR_j}{\sum_{j\in g}L_j},

    :math:`L_j` the token count of response :math:`j`. With a token-mean loss and exactly
    on-policy samples this is the baseline that minimizes the variance of the gradient when
    the score's norm grows with length (the paper's optimal baseline, under its assumption
    that per-token gradients are orthogonal and of equal norm). Equal lengths give the
    group-centred reward (Dr. GRPO, §12).

    Args:
      rewards: ``[N, G]`` or ``[M]`` with ``group_ids``. Detached.
      lengths: token counts, the shape of ``rewards``, ``>= 0``; every group needs a positive sum.
      group_ids: optional ``[M]`` integer group labels.

    Returns:
      :class:`GroupAdvantages` in the shape of ``rewards`` (``mean``: the unweighted group mean).
    """
    r = _rewards(rewards)
    w = _checks.as_tensor("lengths", lengths).detach().to(r.dtype)
    _checks.check_shape("lengths", w, r.shape, against="rewards")
    _checks.check_finite("lengths", w)
    if bool((w < 0).any()):
        raise ValueError("lengths: must be >= 0")
    mean, std, zero_variance, _, _, index = _stats(r, group_ids)
    flat_r, inv, K, restore = _flat(r, group_ids)
    flat_w = w.reshape(-1) if group_ids is None else w
    wsum = torch.zeros(K, dtype=r.dtype, device=r.device).index_add_(0, inv, flat_w)
    if bool((wsum <= 0).any()):
        raise ValueError("lengths: every group needs a positive total length")
    b = torch.zeros(K, dtype=r.dtype, device=r.device).index_add_(0, inv, flat_w * flat_r) / wsum
    return GroupAdvantages(restore(flat_r - b[inv]), mean, std, zero_variance)


def remax_advantages(rewards: torch.Tensor, baseline_rewards: torch.Tensor) -> torch.Tensor:
    r"""ReMax advantages: the sampled response's reward minus the greedy response's (Li et al. 2023, arXiv 2310.10505).

    .. math:: A_i=R(x_i,y_i)-R(x_i,\hat y_i),\qquad \hat y_i=\text{the greedy decoding for } x_i.

    The greedy response's reward is a baseline that does not depend on the sampled
    :math:`y_i`, so REINFORCE with it stays unbiased (§5), at the cost of one extra greedy
    generation per prompt and no critic. Rollouts of one prompt share the prompt's baseline.

    Args:
      rewards: ``[M]`` (or any shape) rewards of the sampled responses. Detached.
      baseline_rewards: the greedy responses' rewards, the shape of ``rewards``. Detached.

    Returns:
      ``[M]`` advantages (a tensor: there is no group statistic to report).
    """
    r = _rewards(rewards)
    b = _checks.as_tensor("baseline_rewards", baseline_rewards).detach().to(r.dtype)
    _checks.check_shape("baseline_rewards", b, r.shape, against="rewards")
    _checks.check_finite("baseline_rewards", b)
    return r - b


def optimal_token_baseline(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    behaviour_logp: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    *,
    is_weights: Optional[torch.Tensor] = None,
    zero_lone: bool = True,
    align: str = "position",
    eps: float = 1e-8,
) -> TokenAdvantages:
    r"""Optimal Token Baseline: a per-position baseline weighted by the path's gradient energy.

    Li et al. 2026, "The Optimal Token Baseline: Variance Reduction for Long-Horizon LLM-RL"
    (arXiv 2602.07078); verl's ``optimal_token_baseline``. For response :math:`i` of a group
    and token position :math:`t`, with reward-to-go :math:`G_{i,t}` (γ = 1, §3):

    .. math::
        w_{i,t}=1-2\pi_{i,t}+\sum_v\pi_{i,t}(v)^2=\lVert e_{y_{i,t}}-\pi_{i,t}\rVert^2,\qquad
        W_{i,t}=\sum_{j\le t}m_{i,j}\,w_{i,j},

    .. math::
        b_t=\frac{\sum_i m_{i,t}\,G_{i,t}\,W_{i,t}}{\sum_i m_{i,t}\,W_{i,t}+\epsilon},\qquad
        A_{i,t}=G_{i,t}-b_t .

    :math:`w` is the squared norm of the gradient of :math:`\log\pi(y_t)` with respect to the
    logits (the paper's logit-gradient proxy, from forward-pass probabilities only:
    :math:`\pi_{i,t}` the sampled token's probability, :math:`\sum_v\pi(v)^2` over the
    vocabulary). :math:`W` is its cumulative sum along the response: the minimum-variance
    constant baseline for the score :math:`\sum_{j\le t}\nabla\log\pi` weighs each path's
    return by that score's squared norm. With ``is_weights`` :math:`\bar\rho` (truncated
    rollout IS weights) :math:`w` is multiplied by :math:`\bar\rho^2`.

    ``zero_lone``: where a response is its group's only valid one at a position (the tail of
    the longest response; a group of one), the baseline would be its own return and the
    advantage 0; it is set to 0 there instead (verl's ``handle_zero_tail``, which zeroes the
    columns past the second-longest length: the same for right-padded responses without
    interior observation tokens).

    ``align``: which tokens of different responses share a baseline :math:`b_t`. ``"position"``:
    the same column of the batch (verl's ``optimal_token_baseline``); ``"action"``: the same
    action-token index, the :math:`k`-th action token of each response whatever the
    observation tokens before it (verl's multi-turn ``tir_optimal_token_baseline``, for
    tool-integrated responses). Both are the same for right-padded single-turn responses.

    Args:
      token_rewards: ``[B, L]`` per-token rewards (detached).
      mask: ``[B, L]`` action mask (NaN/inf allowed at masked positions of every input).
      group_ids: ``[B]`` integer group labels (responses to one prompt).
      behaviour_logp: ``[B, L]`` log-probs of the sampled tokens under the rollout policy.
      sum_pi_squared: ``[B, L]`` :math:`\sum_v\pi(v)^2` of the rollout policy's distribution.
      is_weights: optional ``[B, L]`` IS weights :math:`\bar\rho\ge0`.
      zero_lone: see above.
      align: ``"position"`` or ``"action"`` (see above).
      eps: :math:`\epsilon\ge0` in the denominator.

    Returns:
      :class:`TokenAdvantages` (advantages and reward-to-go, 0 at masked positions); detached.
    """

    eps = _eps(eps)
    if align not in OTB_ALIGN:
        raise ValueError(f"align: must be one of {OTB_ALIGN}, got {align!r}")
    r = _checks.as_tensor("token_rewards", token_rewards)
    _checks.check_ndim("token_rewards", r, 2)
    shape = tuple(r.shape)
    m = _checks.check_mask("mask", mask, shape)
    ids = _checks.as_tensor("group_ids", group_ids)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"group_ids: expected an integer tensor, got dtype {ids.dtype}")
    _checks.check_shape("group_ids", ids, (shape[0],), against="token_rewards' rows")
    zero = torch.zeros((), dtype=r.dtype if r.is_floating_point() else torch.get_default_dtype())

    def token_input(name, x):
        x = _checks.as_tensor(name, x).detach()
        _checks.check_shape(name, x, shape, against="token_rewards")
        x = torch.where(m, x.to(zero.dtype), zero)
        _checks.check_finite(name, x)
        return x

    lp = token_input("behaviour_logp", behaviour_logp)
    s2 = token_input("sum_pi_squared", sum_pi_squared)
    with torch.no_grad():
        G = reward_to_go(token_input("token_rewards", r), gamma=1.0, mask=m)
        w = 1.0 - 2.0 * torch.exp(torch.where(m, lp, zero)) + s2
        if is_weights is not None:
            w = w * token_input("is_weights", is_weights).square()
        mf = m.to(zero.dtype)
        W = torch.cumsum(w * mf, dim=-1) * mf
        _, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        K = int(inverse.max()) + 1 if inverse.numel() else 0
        # the slot each token shares with the other responses of its group: its column, or its action index
        slot = torch.arange(shape[1])[None, :].expand(shape) if align == "position" else \
            (torch.cumsum(m.to(torch.long), -1) - 1).clamp_min(0)
        row = inverse[:, None].expand(shape)

        def per_slot(x):
            return torch.zeros(K, shape[1], dtype=zero.dtype).index_put_((row, slot), x * mf, accumulate=True)

        num, den, count = per_slot(G * W), per_slot(W), per_slot(torch.ones_like(W))
        b = num / (den + eps) if eps > 0 else torch.where(den > 0, num / den.clamp_min(1e-300), zero)
        if zero_lone:
            b = torch.where(count <= 1, zero, b)
        adv = torch.where(m, G - b[row, slot], zero)
    return TokenAdvantages(adv, G)


# ---------------------------------------------------------------------- the recipes' registry entries
def _passk(o, rewards, group_ids=None):
    return passk_advantages(rewards, group_ids=group_ids, unbiased=o.std_unbiased, eps=o.std_eps)


register_advantage_estimator(AdvantageEstimator(
    name="passk", level="sequence", call=_passk, fields=("std_eps", "std_unbiased"), min_group=2,
    params=(STD_EPS, STD_UNBIASED),
    text=lambda o: (f"A_i = (R_(1) − R_(2)) / (std_G(R) + {o.std_eps:g}) for the best response of each group, 0 for "
                    f"the others,  G = {o.group_size}, {std_text(o)}\n"
                    "    R_(1), R_(2): the two largest rewards of the group; the margin over the best *other* response\n"
                    "    credits only the group's best answer (max@G / pass@G; verl's grpo_passk)"),
))
register_advantage_estimator(AdvantageEstimator(
    name="gpg", level="sequence", fields=(), min_group=2,
    call=lambda o, rewards, group_ids=None: gpg_advantages(rewards, group_ids=group_ids),
    text=lambda o: (f"A_i = α (R_i − mean_G(R)),  α = B / B_valid,  G = {o.group_size}\n"
                    "    B responses in the batch, B_valid of them in groups whose rewards are not all equal: the\n"
                    "    gradient is rescaled to the mean over the responses that carry a signal (GPG; no std scaling)"),
))
