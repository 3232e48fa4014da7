r"""The built-in advantage estimators: one registry entry each (spec §2, §5, §6, §11, §12, §20.4).

Sequence-level estimators map per-response rewards (``[N, G]``, or ``[M]`` with
``group_ids``) to one advantage per response through :mod:`trajgrad.baselines`; the token
level estimator (``gae``) maps critic values and token rewards to per-token advantages through
:func:`trajgrad.returns.token_skip_observation_gae`. See :mod:`trajgrad.registry`.
"""
from __future__ import annotations

import torch

from . import baselines, returns
from .registry import AdvantageEstimator, register_advantage_estimator


def _group(scale: str, *, leave_one_out: bool = False):
    def call(o, rewards, group_ids=None):
        return baselines.group_advantages(rewards, scale=scale, eps=o.std_eps, leave_one_out=leave_one_out,
                                          group_ids=group_ids)
    return call


def _raw_return(o, rewards, group_ids=None):
    r = torch.as_tensor(rewards)
    return baselines.GroupAdvantages(r.clone(), torch.zeros_like(r), torch.zeros_like(r), torch.zeros(0, dtype=torch.bool))


register_advantage_estimator(AdvantageEstimator(
    name="return", level="sequence", call=_raw_return, fields=(),
    text=lambda o: "A_i = R_i  (the raw return; no baseline)",
))

register_advantage_estimator(AdvantageEstimator(
    name="group_std", level="sequence", call=_group("std"), fields=("std_eps",), min_group=2,
    text=lambda o: (f"A_i = (R_i − mean_G(R)) / (std_G(R) + {o.std_eps:g}),  G = {o.group_size}, population std (1/G)\n"
                    "    groups with std = 0 have A = 0 (no relative signal, §11); std scaling reweights prompts (§12)"),
))

register_advantage_estimator(AdvantageEstimator(
    name="group_center", level="sequence", call=_group("none"), fields=(), min_group=2,
    text=lambda o: f"A_i = R_i − mean_G(R),  G = {o.group_size}  (no std scaling: Dr. GRPO, §12)",
))

register_advantage_estimator(AdvantageEstimator(
    name="batch_std", level="sequence", call=_group("batch_std"), fields=("std_eps",), min_group=2,
    text=lambda o: f"A_i = (R_i − mean_G(R)) / (std_batch(R) + {o.std_eps:g}),  G = {o.group_size}",
))

register_advantage_estimator(AdvantageEstimator(
    name="leave_one_out", level="sequence", call=_group("none", leave_one_out=True), fields=(), min_group=2,
    text=lambda o: f"A_i = R_i − (1/(G−1)) Σ_{{k≠i}} R_k,  G = {o.group_size}  (leave-one-out, §5)",
))


def _gae(o, values, rewards, mask, terminated=None, bootstrap_value=None):
    return returns.token_skip_observation_gae(values, rewards, mask, gamma=o.gamma, lam=o.lam, terminated=terminated,
                                              bootstrap_value=bootstrap_value)


register_advantage_estimator(AdvantageEstimator(
    name="gae", level="token", call=_gae, fields=("gamma", "lam"), needs_critic=True,
    text=lambda o: (f"A_t = Σ_l (γλ)^l δ_{{t+l}},  δ_t = r_t + γ V(next action token) − V(t),  γ = {o.gamma:g}, "
                    f"λ = {o.lam:g}\n"
                    "    skip-observation: tool-observation and prompt tokens are bridged, not decayed through (§20.4);\n"
                    "    true termination zeroes the bootstrap, truncation bootstraps from V (§6)"),
))

register_advantage_estimator(AdvantageEstimator(
    name="none", level="none", call=None, fields=(), text=lambda o: "none (the loss takes no advantage)",
))
