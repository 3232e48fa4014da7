"""A correct PPO-clip per-token term, shared by the bug files (each changes one thing around it)."""
import torch


def ppo_per_token(logp, old_logp, advantages, mask, eps=0.2):
    """−min(ρA, clip(ρ, 1−ε, 1+ε)A) at action tokens, 0 elsewhere (selected with torch.where)."""
    m = mask.bool()
    zero = torch.zeros_like(logp)
    ratio = torch.exp(torch.where(m, logp - old_logp.detach(), zero))
    adv = torch.where(m, advantages.detach(), zero)
    x = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    return torch.where(m, x, zero)
