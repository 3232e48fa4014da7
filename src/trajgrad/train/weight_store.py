"""Weights sent from the learner to the rollout workers, and the actor that holds the newest.

Only the trainable tensors travel (the LoRA adapters, or every parameter of a model
trained in full): :func:`trajgrad.weights.trainable_state` / :func:`~trajgrad.weights.load_trainable_state`. The
:class:`WeightStore` (a Ray actor in the asynchronous runs) keeps the newest
``(version, [ObjectRef])``.
"""
from __future__ import annotations

import time
from typing import Dict, Mapping, Optional, Tuple

import torch

from ..weights import load_trainable_state, trainable_state

__all__ = ["trainable_state", "load_trainable_state", "WeightStore"]


class WeightStore:
    """Newest published weights (a Ray actor in :class:`AsyncTrainer`).

    Holds ``(version, [ObjectRef])``: the reference sits inside a list so that Ray
    passes it on instead of resolving it. Workers also report their progress (episode
    key and turn index) when they ask, for monitoring and fault-injection tests.
    """

    def __init__(self):
        self.version = -1
        self.box = None
        self.progress: Dict[int, Tuple[str, int, float]] = {}

    def publish(self, version: int, box: list) -> int:
        if version < self.version:
            raise ValueError(f"version: {version} is older than the published {self.version}")
        self.version = int(version)
        self.box = box
        return self.version

    def newer(self, version: int, worker: Optional[int] = None, key: Optional[str] = None, turn: Optional[int] = None):
        if worker is not None:
            self.progress[int(worker)] = (key, turn, time.time())
        if self.box is not None and self.version > version:
            return self.version, self.box
        return None

    def latest_version(self) -> int:
        return self.version

    def finished(self, worker: int, key: str) -> None:
        """A worker's episode ended: its progress turn becomes -1."""
        self.progress[int(worker)] = (key, -1, time.time())

    def get_progress(self) -> Dict[int, Tuple[str, int, float]]:
        return dict(self.progress)
