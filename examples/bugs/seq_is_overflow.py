"""A sequence importance weight formed as exp(Σ log-ratio), then the length-th root (§17).

Mathematically (π_θ(y)/π_old(y))^(1/L) = exp((1/L) Σ_t log-ratio), but computing the product
first overflows: over a few thousand tokens the sum of log-ratios passes 709 (float64) or 88
(float32), exp gives inf, and inf^(1/L) is inf — the loss and its gradient are inf/NaN on long
responses while every short test passes. Take the mean in log space, then exp. Public record:
rasbt/reasoning-from-scratch issue #243 (sequence-level probabilities, a product of token
probabilities, used for the ratio; the ratio explodes or vanishes).

    trajgrad verify examples/bugs/seq_is_overflow.py:loss --as gspo   # fails long_sequence
"""
import torch


def loss(logp, old_logp, advantages, mask, denominator=None, eps_low=3e-4, eps_high=4e-4):
    m = mask.bool()
    zero = torch.zeros_like(logp)
    lengths = m.sum(-1).clamp_min(1)
    ratio_of_products = torch.exp(torch.where(m, logp - old_logp.detach(), zero).sum(-1))  # BUG: overflows
    s = ratio_of_products ** (1.0 / lengths)
    adv = torch.where(m, advantages.detach(), zero).sum(-1) / lengths
    per_seq = -torch.minimum(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv)
    rows = m.any(-1)
    n = rows.sum() if denominator is None else denominator
    return per_seq[rows].sum() / n
