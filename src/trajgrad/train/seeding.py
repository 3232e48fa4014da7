"""Seeds: one global seed per run, one derived seed per (step, purpose)."""
from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def step_seed(base: int, step: int, salt: int = 0) -> int:
    """A seed for ``(run seed, step, salt)``: a resumed run draws what the killed run would have."""
    return (base * 1_000_003 + step * 7919 + salt * 104729) % (2**31 - 1)
