"""Rewards of a collated batch before any estimator: shaping, the constraint penalty, logged facts."""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from ..advantages import credit
from ..advantages import returns as returns_lib
from ..rollout import RolloutBatch


def batch_facts(batch: RolloutBatch) -> Dict[str, float]:
    """What the batch is: mean reward, success rate, lengths, cut episodes."""
    mask = batch.action_mask
    return {"reward/mean": float(batch.rewards.mean()), "success/rate": float(batch.success.float().mean()),
            "len/action_tokens": float(mask.sum(1).float().mean()),
            "len/turns": float(batch.turn_mask.sum(1).float().mean()),
            "len/cut_episodes": float(batch.truncated.float().mean())}


def invalid_action_facts(trajs: Sequence) -> Dict[str, float]:
    """``env/invalid_action_frac``: the fraction of turns whose ``info["invalid_action"]`` names
    a reason (an action the environment refused, e.g. the gymnasium adapter's), and
    ``env/invalid_action/<reason>``: their count by reason."""
    turns, out = 0, {}
    for t in trajs:
        for turn in t.turns:
            turns += 1
            reason = turn.info.get("invalid_action")
            if reason:
                key = f"env/invalid_action/{reason if isinstance(reason, str) else 'invalid_action'}"
                out[key] = out.get(key, 0.0) + 1.0
    return {"env/invalid_action_frac": sum(out.values()) / max(turns, 1), **out}


def turn_rewards(batch: RolloutBatch, *, gamma: float, shaping: bool, lagrange=None,
                 penalize: bool = True) -> Tuple[torch.Tensor, Dict[str, float]]:
    """``[B, K]`` float64 per-turn rewards: optionally potential-shaped (§21, terminal
    potential 0) and minus :math:`\\lambda\\cdot` cost (§22); 0 at padded turns. With
    ``penalize=False`` the cost stays out of the rewards (a policy term that takes the cost
    advantages applies :math:`\\lambda` itself); the mean cost and :math:`\\lambda` are reported
    either way."""
    r = batch.turn_rewards.double()
    m = batch.turn_mask
    info: Dict[str, float] = {}
    if shaping:
        pots = torch.cat([batch.initial_potential.double()[:, None], batch.turn_potentials.double()], 1)
        r = returns_lib.shape_rewards(r, pots, gamma=gamma, mask=m,
                                      terminated=credit.terminal_turn_mask(m, batch.terminated),
                                      zero_terminal_potential=True)
        info["shaping/bonus"] = float((r - batch.turn_rewards.double())[m].sum() / len(batch))
    if lagrange is not None:
        costs = batch.turn_costs.double()
        info["constraint/mean_cost"] = float(costs.sum(1).mean())
        info["constraint/lambda"] = lagrange.value
        if penalize:
            r = r - lagrange.value * costs
    return torch.where(m, r, torch.zeros_like(r)), info


def token_rewards(batch: RolloutBatch, turn_r: torch.Tensor) -> torch.Tensor:
    """``[B, L]``: each turn's reward on its last action token
    (:func:`trajgrad.advantages.credit.place_turn_rewards`)."""
    return credit.place_turn_rewards(turn_r, batch.action_mask, batch.turn_ids, batch.turn_mask)

