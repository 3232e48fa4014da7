r"""verl's own loss, advantage and KL functions behind verify's adapter signatures (verl 0.9.1).

Each adapter calls the function from ``verl.trainer.ppo.core_algos`` unchanged, with a real
``verl.workers.config.ActorConfig`` carrying the settings; a global ``denominator`` is passed
the way verl receives it under data parallelism (``global_batch_info``: ``batch_num_tokens``
for ``token-mean``, ``global_batch_size`` for the sequence modes, ``dp_size=1``).
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

PINNED = "0.9.1"
# verl's loss_agg_mode -> the trajgrad aggregation it names
AGG = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
       "seq-mean-token-sum": "seq_mean_token_sum", "seq-mean-token-sum-norm": "seq_sum_constant"}


def _config(loss_agg_mode: str, policy_loss: Optional[dict] = None, **fields):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    if policy_loss:
        pl = dict(policy_loss)
        if isinstance(pl.get("rollout_correction"), dict):
            pl["rollout_correction"] = RolloutCorrectionConfig(**pl["rollout_correction"])
        fields["policy_loss"] = PolicyLossConfig(**pl)
    return ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1, rollout_n=1,
                       loss_agg_mode=loss_agg_mode, **fields)


def policy_loss(loss_mode: str = "vanilla", *, loss_agg_mode: str = "token-mean", policy_loss_fields=None,
                **actor_fields) -> Callable:
    """``loss_fn(logp, old_logp, advantages, mask, denominator=None)`` running verl's ``loss_mode``
    (a registered policy-loss name, or the name of a ``core_algos.compute_policy_loss_*`` function)."""
    from verl.trainer.ppo import core_algos

    fn = getattr(core_algos, loss_mode) if loss_mode.startswith("compute_") else core_algos.get_policy_loss_fn(loss_mode)

    def loss_fn(logp, old_logp, advantages, mask, denominator=None):
        cfg = _config(loss_agg_mode, policy_loss_fields, **actor_fields)
        if denominator is not None:
            key = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
            cfg.global_batch_info.update({"dp_size": 1, key: denominator})
        loss, _metrics = fn(old_logp, logp, advantages, mask.to(logp.dtype), loss_agg_mode=loss_agg_mode, config=cfg)
        return loss

    return loss_fn


def policy_loss_with_kl(kl_kind: str, kl_coef: float, *, loss_agg_mode: str = "token-mean") -> Callable:
    """verl's actor loss with ``use_kl_loss``: ``pg_loss + kl_coef * agg_loss(kl_penalty(logp, ref, kl_kind))``,
    both aggregated with ``loss_agg_mode`` (the composition in verl's ``dp_actor``), every piece verl's own."""
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.trainer.ppo.core_algos import kl_penalty as verl_kl

    pg = policy_loss("vanilla", loss_agg_mode=loss_agg_mode)

    def loss_fn(logp, old_logp, advantages, mask, ref_logp, denominator=None):
        kw = {} if denominator is None else {"batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size": denominator}
        kl = agg_loss(verl_kl(logp, ref_logp, kl_kind), mask.to(logp.dtype), loss_agg_mode, **kw)
        return pg(logp, old_logp, advantages, mask, denominator=denominator) + kl_coef * kl

    return loss_fn


def grpo_advantage(norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6) -> Callable:
    """``adv_fn(rewards [M], group_ids [M], lengths=None) -> [M]``: verl's ``compute_grpo_outcome_advantage``."""
    return outcome_advantage("grpo", config={"norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo},
                             norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, epsilon=epsilon)


def _outcome_layout(rewards: torch.Tensor, lengths: Optional[torch.Tensor]):
    """Response mask ``[M, L]`` (right padding, ``lengths`` default 3) and ``rewards`` placed at each
    response's last valid token, as verl's trainer lays out outcome rewards."""
    M = rewards.shape[0]
    lengths = torch.full((M,), 3, dtype=torch.long) if lengths is None else lengths.long()
    L = int(lengths.max())
    mask = (torch.arange(L)[None, :] < lengths[:, None]).to(rewards.dtype)
    token_rewards = torch.zeros(M, L, dtype=rewards.dtype)
    token_rewards[torch.arange(M), lengths - 1] = rewards
    return mask, token_rewards


def outcome_advantage(name: str, *, config: Optional[dict] = None, **kwargs) -> Callable:
    """``adv_fn(rewards [M], group_ids [M], lengths=None) -> [M]``: verl's registered advantage estimator
    ``name`` (``get_adv_estimator_fn``) on outcome rewards, each at the last valid token of a response of
    ``lengths[i]`` tokens (right padding). verl broadcasts the advantage over the response; the adapter
    checks that it is one value per response and returns it."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    fn = get_adv_estimator_fn(name)

    def adv_fn(rewards, group_ids, lengths=None):
        mask, token_rewards = _outcome_layout(rewards, lengths)
        cfg = AlgoConfig(adv_estimator=name, **(config or {}))
        adv, _ = fn(token_level_rewards=token_rewards, response_mask=mask, index=np.asarray(group_ids.tolist()),
                    config=cfg, **kwargs)
        first = adv[:, :1].expand_as(mask)
        spread = float(torch.where(mask > 0, (adv - first).abs(), torch.zeros((), dtype=adv.dtype)).max())
        if spread > 1e-12:
            raise ValueError(f"{name}: the advantage is not constant along a response (spread {spread:.2e})")
        return adv[:, 0]

    return adv_fn


def gdpo_advantage(components: Callable, weights=None) -> Callable:
    """verl's ``compute_gdpo_outcome_advantage`` with several reward components: ``adv_fn(rewards, group_ids,
    lengths)`` where ``components(rewards) -> [M, K]`` gives the components, passed the way verl's trainer
    passes them (``algorithm.gdpo_reward_keys``, per-sample scores in ``non_tensor_batch``, placed at the last
    valid response token found from ``batch["attention_mask"]``)."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.core_algos import compute_gdpo_outcome_advantage

    def adv_fn(rewards, group_ids, lengths=None):
        M = rewards.shape[0]
        comps = components(rewards)
        keys = [f"reward_{k}" for k in range(comps.shape[1])]
        mask, token_rewards = _outcome_layout(comps.sum(-1), lengths)
        cfg = AlgoConfig(adv_estimator="gdpo", gdpo_reward_keys=keys,
                         gdpo_reward_weights=None if weights is None else list(weights))
        batch = {"prompts": torch.zeros(M, 1, dtype=torch.long),
                 "attention_mask": torch.cat([torch.ones(M, 1, dtype=torch.long), mask.long()], dim=1)}
        non_tensor = {k: comps[:, i].numpy() for i, k in enumerate(keys)}
        adv, _ = compute_gdpo_outcome_advantage(token_rewards, mask, np.asarray(group_ids.tolist()), config=cfg,
                                                non_tensor_batch=non_tensor, batch=batch)
        return adv[:, 0]

    return adv_fn


def remax_advantage(baseline: Callable) -> Callable:
    """verl's ``compute_remax_outcome_advantage``: ``adv_fn(rewards, group_ids, lengths)`` with the greedy
    responses' rewards ``baseline(rewards, group_ids)`` (verl's ``reward_baselines``)."""
    from verl.trainer.ppo.core_algos import compute_remax_outcome_advantage

    def adv_fn(rewards, group_ids, lengths=None):
        mask, token_rewards = _outcome_layout(rewards, lengths)
        adv, _ = compute_remax_outcome_advantage(token_rewards, baseline(rewards, group_ids), mask)
        return adv[:, 0]

    return adv_fn


def rloo_advantage() -> Callable:
    """verl's ``compute_rloo_outcome_advantage`` (see :func:`outcome_advantage`)."""
    return outcome_advantage("rloo")


def kl_penalty(kind: str) -> Callable:
    """``kl_fn(logp, ref_logp) -> [B, L]``: verl's ``kl_penalty`` (k1, k2, k3 = low_var_kl, k3+)."""
    from verl.trainer.ppo.core_algos import kl_penalty as verl_kl

    return lambda logp, ref_logp: verl_kl(logp, ref_logp, kind)


def gae_whitened() -> Callable:
    """``gae_fn(values, rewards, mask) -> (advantages, returns)``: verl's ``compute_gae_advantage_return``
    (γ = 1, λ = 0.95: verl-ppo's defaults), which whitens the advantages over valid tokens."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    def gae_fn(values, rewards, mask):
        gamma, lam = (torch.tensor(v, dtype=values.dtype) for v in (1.0, 0.95))
        return compute_gae_advantage_return(rewards, values, mask.to(values.dtype), gamma, lam)

    return gae_fn


# verl's loss mode -> the PolicyLossConfig field holding its selection ratio
COV_RATIO_FIELD = {"clip_cov": "clip_cov_ratio", "kl_cov": "kl_cov_ratio"}


def cov_loss(loss_mode: str, **policy_loss_fields) -> Callable:
    """``loss_fn(logp, old_logp, advantages, mask, ratio)``: verl's ``clip_cov`` / ``kl_cov`` with the selection
    ratio (``clip_cov_ratio`` / ``kl_cov_ratio``) given per call, token-mean; the other ``PolicyLossConfig``
    fields from ``policy_loss_fields``. ``clip_cov`` draws its tokens from torch's global RNG."""
    key = COV_RATIO_FIELD[loss_mode]

    def loss_fn(logp, old_logp, advantages, mask, ratio):
        fields = {**policy_loss_fields, key: ratio}
        return policy_loss(loss_mode, loss_agg_mode="token-mean", policy_loss_fields=fields)(logp, old_logp,
                                                                                           advantages, mask)

    return loss_fn


def optimal_token_baseline(name: str = "optimal_token_baseline") -> Callable:
    """``otb_fn(token_rewards, mask, group_ids, behaviour_logp, sum_pi_squared) -> [B, L]``: verl's
    ``optimal_token_baseline`` or ``tir_optimal_token_baseline`` estimator (``handle_zero_tail=True``, no IS
    weights)."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    fn = get_adv_estimator_fn(name)

    def otb_fn(token_rewards, mask, group_ids, behaviour_logp, sum_pi_squared):
        adv, _ = fn(
            token_rewards, mask.to(token_rewards.dtype), np.asarray(group_ids.tolist()), behaviour_logp,
            sum_pi_squared)
        return adv

    return otb_fn


def value_loss(cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean") -> Callable:
    """``vf_fn(values, targets, mask, old_values)``: verl's ``compute_value_loss`` (the critic's clipped loss)."""
    from verl.trainer.ppo.core_algos import compute_value_loss

    def vf_fn(values, targets, mask, old_values):
        loss, _ = compute_value_loss(values, targets, old_values, mask.to(values.dtype), cliprange_value,
                                     loss_agg_mode=loss_agg_mode)
        return loss

    return vf_fn
