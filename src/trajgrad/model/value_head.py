"""A token-wise critic head on the policy backbone's hidden states (§20.3)."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["ValueHead"]


class ValueHead(nn.Module):
    """Token-wise critic V(h_t) on the policy backbone's hidden states (detached input).

    ``values[b, j]`` is the value of the prefix that predicts target ``j`` (aligned with the
    targets, like every per-token tensor). The input is detached so that critic updates
    never move the policy; K critic updates per actor update (§20.3) reuse the cached
    hidden states.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.Tanh(), nn.Linear(hidden_size, 1))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net(hidden.detach().to(self.net[0].weight.dtype)).squeeze(-1)
