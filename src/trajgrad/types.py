"""Result types shared by the losses."""
from __future__ import annotations

from typing import Dict, NamedTuple

import torch


class LossResult(NamedTuple):
    """What every policy loss returns.

    Attributes:
      loss: scalar tensor to *minimize* (attached to the graph).
      metrics: dict of detached tensors (clip fractions by advantage sign and side,
        ratio / log-ratio statistics, token counts, ...).
    """

    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor]
