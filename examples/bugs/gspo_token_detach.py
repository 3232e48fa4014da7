"""A GSPO-token loss with the stop-gradient in the wrong place (spec §17).

The sequence ratio s_i is left attached instead of sg[s_i]. Every printed value is identical
to the correct GSPO-token loss, but the gradient is not: each token also receives
(1/L_i) of every other token's gradient through s_i. Public record: agentscope-ai/Trinity-RFT
pull request #154 (a GSPO-token loss under review whose s_i(θ) placement had to be settled
against the paper's Eq. (14)). `trajgrad verify` catches it:

    trajgrad verify examples/bugs/gspo_token_detach.py:gspo_token_loss --as gspo_token   # fails gradient
"""
import torch


def gspo_token_loss(logp, old_logp, advantages, mask, eps_low=3e-4, eps_high=4e-4):
    m = mask.bool()
    logp = torch.where(m, logp, torch.zeros_like(logp))
    old = torch.where(m, old_logp, torch.zeros_like(old_logp)).detach()
    adv = torch.where(m, advantages, torch.zeros_like(advantages)).detach()
    lengths = m.sum(-1).clamp_min(1)
    seq_ratio = torch.exp((logp - old).sum(-1) / lengths)           # s_i, attached
    token_ratio = seq_ratio[:, None] * torch.exp(logp - logp.detach())  # BUG: should be seq_ratio.detach()
    unclipped = token_ratio * adv
    clipped = token_ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    per_token = torch.where(m, per_token, torch.zeros_like(per_token))
    per_seq = per_token.sum(-1) / lengths
    return per_seq[m.any(-1)].mean()
