"""GRPO whose KL penalty is evaluated on every position of the response span, tool observations
included (§4, §9).

The tool's output was not sampled by the policy: a KL estimate there penalizes the policy for
text it never chose, and its gradient pushes on positions whose targets are the environment's.
The policy term is masked correctly; only the KL term uses the span mask. Public record:
THUDM/slime issue #1370 (no masking of tool responses in the KL accumulated into token-level
rewards for agentic RL).

    trajgrad verify examples/bugs/kl_on_observations.py:loss --as grpo --include-kl \
        --set kl_placement=loss --set kl_coef=0.04   # DeepSeekMath's KL term; fails value, masked_nan
"""
import torch

from _ppo import ppo_per_token


def loss(logp, old_logp, advantages, mask, ref_logp, denominator=None, kl_coef=0.04):
    m = mask.bool()
    rows = m.any(-1)
    pos = torch.arange(m.shape[1])[None]
    first = torch.where(m, pos, m.shape[1]).min(-1, keepdim=True).values
    last = torch.where(m, pos, -1).max(-1, keepdim=True).values
    span = (pos >= first) & (pos <= last)                      # BUG: observations inside the span
    d = ref_logp.detach() - logp
    k3 = torch.where(span, torch.exp(torch.where(span, d, 0.0)) - d - 1, 0.0)
    pg = ppo_per_token(logp, old_logp, advantages, mask)
    per_seq_pg = pg.sum(-1) / m.sum(-1).clamp_min(1)
    per_seq_kl = k3.sum(-1) / span.sum(-1).clamp_min(1)
    return (per_seq_pg + kl_coef * per_seq_kl)[rows].mean()
