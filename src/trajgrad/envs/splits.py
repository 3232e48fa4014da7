"""Train / held-out splits of finite task lists (datasets, adapted environments).

:func:`hash_split` assigns an item to ``heldout`` by the SHA-256 of its key, so the split
is the same for every seed and every run; :func:`take` draws ``n`` items of a split,
deterministically in ``seed``, cycling through the list (in a new order each pass) when
``n`` is larger than it.
"""
from __future__ import annotations

import hashlib
import random
from typing import List, Sequence, TypeVar

__all__ = ["hash_split", "take", "check_task_request"]

T = TypeVar("T")


def hash_split(key: str, heldout_fraction: float) -> str:
    """``"heldout"`` for a fixed ``heldout_fraction`` of keys (by hash), else ``"train"``."""
    if not 0.0 <= float(heldout_fraction) < 1.0:
        raise ValueError(f"heldout_fraction: expected a number in [0, 1), got {heldout_fraction!r}")
    h = int.from_bytes(hashlib.sha256(f"split|{key}".encode()).digest()[:8], "big") / 2.0**64
    return "heldout" if h < heldout_fraction else "train"


def take(items: Sequence[T], n: int, seed: int, *, what: str = "items") -> List[T]:
    """``n`` items drawn without replacement per pass over ``items`` (seeded shuffles).

    Raises ValueError naming ``what`` when ``items`` is empty and ``n > 0``.
    """
    if not (isinstance(n, int) and n >= 0):
        raise ValueError(f"n: expected an integer >= 0, got {n!r}")
    if n and not items:
        raise ValueError(f"{what}: no items to draw {n} from")
    rng = random.Random(f"take|{seed}")
    out: List[T] = []
    while len(out) < n:
        order = list(range(len(items)))
        rng.shuffle(order)
        out.extend(items[i] for i in order[: n - len(out)])
    return out


def check_task_request(split, n, seed, splits=("train", "heldout")) -> None:
    """The arguments of a task source's ``tasks(split, n, seed)``: ValueError naming the bad one."""
    if split not in splits:
        raise ValueError(f"split: expected one of {tuple(splits)}, got {split!r}")
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
        raise ValueError(f"n: expected a non-negative integer, got {n!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed: expected an integer, got {seed!r}")
