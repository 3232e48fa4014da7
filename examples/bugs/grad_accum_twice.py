"""Gradient accumulation that divides twice: by the global token count and again by the number
of accumulation steps (§13).

The caller already passes the global denominator (all micro-batches), so the extra division
shrinks every update by the accumulation factor — and silently changes gradient clipping and
any loss-scale-sensitive optimizer setting. Public record: huggingface/transformers pull
request #35438 (the loss reported and back-propagated off by the gradient-accumulation factor
when `num_items_in_batch` and the accumulation scaling were both applied).

    trajgrad verify examples/bugs/grad_accum_twice.py:loss --as dapo   # fails value, gradient
"""
from _ppo import ppo_per_token


def loss(logp, old_logp, advantages, mask, denominator=None, accumulation_steps=2):
    x = ppo_per_token(logp, old_logp, advantages, mask)
    den = mask.bool().sum().clamp_min(1) if denominator is None else denominator
    return x.sum() / den / accumulation_steps  # BUG: den is already the global count
