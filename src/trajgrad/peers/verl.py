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
    from verl.workers.config import ActorConfig

    cfg = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1, rollout_n=1,
                      loss_agg_mode=loss_agg_mode, **fields)
    for k, v in (policy_loss or {}).items():
        setattr(cfg.policy_loss, k, v)
    return cfg


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
    """``adv_fn(rewards [M], group_ids [M]) -> [M]``: verl's ``compute_grpo_outcome_advantage``."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    def adv_fn(rewards, group_ids):
        M = rewards.shape[0]
        token_rewards = torch.zeros(M, 3, dtype=rewards.dtype)
        token_rewards[:, -1] = rewards
        adv, _ = compute_grpo_outcome_advantage(token_rewards, torch.ones(M, 3), np.asarray(group_ids.tolist()),
                                                epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
        return adv[:, 0]

    return adv_fn


def rloo_advantage() -> Callable:
    from verl.trainer.ppo.core_algos import compute_rloo_outcome_advantage

    def adv_fn(rewards, group_ids):
        M = rewards.shape[0]
        token_rewards = torch.zeros(M, 2, dtype=rewards.dtype)
        token_rewards[:, -1] = rewards
        adv, _ = compute_rloo_outcome_advantage(token_rewards, torch.ones(M, 2), np.asarray(group_ids.tolist()))
        return adv[:, 0]

    return adv_fn


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
