"""SAO's direct double-sided IS with the ratio left attached, documented as detached (§20.2).

With sg[r]·1{trusted}·A·log π the gradient inside the trust interval is r A ∇log π. Leaving r
attached adds r A log π ∇log π — the value is identical, so value tests and logged losses
cannot tell. The attached form is a legitimate choice (trajgrad's ratio_gradient="attached"),
but it is a different update from the one this docstring claims. Public record:
huggingface/trl issue #1720 (whether the PPO ratio must be detached: it depends on whether it
multiplies log π).

    trajgrad verify examples/bugs/sao_attached_as_detached.py:loss --as sao   # fails gradient
"""
import torch


def loss(logp, rollout_logp, advantages, mask, denominator=None, eps_low=0.3, eps_high=5.0):
    """Detached trusted-ratio weight times A log π (claimed)."""
    m = mask.bool()
    zero = torch.zeros_like(logp)
    r = torch.exp(torch.where(m, logp - rollout_logp.detach(), zero))    # BUG: not detached
    trusted = (r > 1 - eps_low) & (r < 1 + eps_high) & m
    x = torch.where(trusted, -r * advantages.detach() * logp, zero)
    den = m.sum().clamp_min(1) if denominator is None else denominator
    return x.sum() / den
