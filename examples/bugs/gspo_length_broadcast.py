"""GSPO whose per-sequence term is broadcast over the tokens and summed: each response's term is
multiplied by its length (§17).

GSPO's objective has one clipped term per response, s_i A_i (then averaged over responses).
Broadcasting the [B, 1] term to [B, L] and summing over the mask weighs response i by L_i.
Public record: huggingface/trl issue #3823 (with importance_sampling_level="sequence" the
(B, 1) loss times the (B, T) mask multiplies the advantage by the number of tokens).

    trajgrad verify examples/bugs/gspo_length_broadcast.py:loss --as gspo    # fails value, gradient
"""
import torch


def loss(logp, old_logp, advantages, mask, eps_low=3e-4, eps_high=4e-4):
    m = mask.bool()
    zero = torch.zeros_like(logp)
    lengths = m.sum(-1).clamp_min(1)
    log_s = torch.where(m, logp - old_logp.detach(), zero).sum(-1) / lengths
    s = torch.exp(log_s)[:, None]                                 # [B, 1]
    adv = torch.where(m, advantages.detach(), zero).sum(-1, keepdim=True) / lengths[:, None]
    per_seq = -torch.minimum(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv)   # [B, 1]
    per_token = torch.where(m, per_seq.expand_as(logp), zero)     # BUG: broadcast, then summed
    rows = m.any(-1)
    return per_token.sum(-1)[rows].mean()
