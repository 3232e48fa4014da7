"""Masking by multiplication: 0 · inf = NaN (§4).

Positions the mask excludes (prompt, tool observations, padding) may hold anything — a −inf
log-prob of a token outside the sampler's top-p support, a NaN from an uninitialized buffer.
Multiplying by the mask keeps them in the graph: 0 · inf and 0 · NaN are NaN, and the loss
and every gradient become NaN. Select with torch.where instead. Public record:
ecmwf/WeatherGenerator pull request #2717 (masked-out values zeroed by multiplying with the
mask, NaN · 0 = NaN poisoning the loss and its gradients).

    trajgrad verify examples/bugs/mask_multiply_nan.py:loss --as dapo   # fails masked_nan
"""
import torch


def loss(logp, old_logp, advantages, mask, denominator=None, eps=0.2):
    m = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp.detach())
    adv = advantages.detach()
    x = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    den = m.sum().clamp_min(1) if denominator is None else denominator
    return (x * m).sum() / den   # BUG: masked positions enter through multiplication
