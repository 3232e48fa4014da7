"""Rollouts: trajectories as sampled, the in-process sampler, models, and collation.

* :mod:`~trajgrad.rollout.trajectory`: :class:`Turn`, :class:`Trajectory` (token views
  aligned with the targets, §4) and the durable JSONL :class:`TrajectoryLog`.
* :mod:`~trajgrad.rollout.sampler`: :class:`HFSampler`, multi-turn batched sampling that
  records the exact behaviour log-probs and policy versions (§7, §16, §19).
* :mod:`~trajgrad.rollout.collate`: :func:`collate` -> :class:`RolloutBatch`.
* :mod:`~trajgrad.rollout.chat`: ChatML prompt and observation tokens.
* :mod:`~trajgrad.rollout.models`: :func:`load_smollm2`, :func:`build_tiny_model`,
  :class:`CharTokenizer`.

Importing this package does not import ``transformers``; the model helpers import it
when called.
"""
from .chat import demonstration_trajectory, observation_ids, prompt_ids, render_prompt
from .collate import RolloutBatch, collate, position_ids_from_attention_mask
from .trajectory import Trajectory, TrajectoryLog, Turn, read_trajectories

_LAZY = {
    "HFSampler": "sampler",
    "sample_actions": "sampler",
    "RowKV": "sampler",
    "CharTokenizer": "models",
    "build_char_tokenizer": "models",
    "build_tiny_model": "models",
    "load_smollm2": "models",
    "OpenAISampler": "openai_backend",
}

__all__ = [
    "Turn",
    "Trajectory",
    "TrajectoryLog",
    "read_trajectories",
    "RolloutBatch",
    "collate",
    "position_ids_from_attention_mask",
    "prompt_ids",
    "render_prompt",
    "observation_ids",
    "demonstration_trajectory",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
