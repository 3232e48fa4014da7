"""Seeds and the settings that make a run reproducible.

One global seed per run, one derived seed per (step, purpose) (:func:`step_seed`), and the
record of what else decides whether the same seed gives the same bits
(:func:`determinism_settings`): torch's intra-op and inter-op thread counts, the thread
variables of the environment, and torch's deterministic-algorithm switches. The trainer
prints it at start and stores it in ``run.json``.

With several intra-op threads, the float sums a kernel splits over threads are still
bitwise repeatable as long as the split depends only on the sizes and the thread count;
kernels that add with atomics in the order threads arrive are not (the learner's
prefix-sharing gather was one: see :func:`trajgrad.model.learner.head_inputs`).
"""
from __future__ import annotations

import os
import random
from typing import Any, Dict

import numpy as np
import torch

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def step_seed(base: int, step: int, salt: int = 0) -> int:
    """A seed for ``(run seed, step, salt)``: a resumed run draws what the killed run would have."""
    return (base * 1_000_003 + step * 7919 + salt * 104729) % (2**31 - 1)


def determinism_settings() -> Dict[str, Any]:
    """What besides the seed decides a run's bits on this machine (JSON-serializable)."""
    out: Dict[str, Any] = {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "torch": torch.__version__,
    }
    for var in _THREAD_VARS:
        out[var] = os.environ.get(var)
    return out


def format_determinism(settings: Dict[str, Any]) -> str:
    """One line for the console."""
    env = ", ".join(f"{v}={settings.get(v)}" for v in _THREAD_VARS if settings.get(v) is not None) or "none set"
    return (f"threads: torch intra-op {settings['torch_threads']}, inter-op {settings['torch_interop_threads']} "
            f"(environment: {env}); deterministic algorithms: {settings['deterministic_algorithms']}, "
            f"cudnn deterministic: {settings['cudnn_deterministic']}, benchmark: {settings['cudnn_benchmark']}")
