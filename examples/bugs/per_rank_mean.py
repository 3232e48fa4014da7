"""Token-mean PPO normalized on each rank, then averaged over ranks by data parallelism (§13).

Each rank divides by its own token count; DDP then averages the ranks' gradients. With unequal
token counts per rank the update is not the full batch's token mean: a token on a rank with
few tokens weighs more. Public record: huggingface/trl pull request #3231 (a DDP toy example
where per-device normalization is not invariant to how samples are placed on devices).

    trajgrad verify examples/bugs/per_rank_mean.py:loss --as dapo      # fails ranks_average
"""
import torch

from _ppo import ppo_per_token


def loss(logp, old_logp, advantages, mask):
    x = ppo_per_token(logp, old_logp, advantages, mask)
    return x.sum() / mask.bool().sum().clamp_min(1)  # BUG: a per-rank denominator
