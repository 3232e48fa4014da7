"""A plain PPO-clip loss written from spec §8 (token-mean aggregation, eps = 0.2).

It passes `trajgrad verify` against the `ppo` recipe's policy term:

    trajgrad verify examples/my_ppo_clip.py:ppo_loss --as ppo
"""
import torch


def ppo_loss(logp, old_logp, advantages, mask, denominator=None):
    m = mask.bool()
    zero = torch.zeros_like(logp)
    log_ratio = torch.where(m, logp - old_logp.detach(), zero)
    adv = torch.where(m, advantages.detach(), zero)
    ratio = torch.exp(log_ratio)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    count = m.sum() if denominator is None else denominator
    return -torch.where(m, surrogate, zero).sum() / count
