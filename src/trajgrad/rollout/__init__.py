"""Rollouts: trajectories as sampled, generation, the episode loop, backends, and collation.

* :mod:`~trajgrad.rollout.trajectory`: :class:`Turn`, :class:`Trajectory` (token views
  aligned with the targets, §4) and the durable JSONL :class:`TrajectoryLog`.
* :mod:`~trajgrad.rollout.generation`: :func:`sample_actions` (token generation with the
  exact behaviour log-probs, KV cache) and :class:`HFBackend`, the in-process action backend.
* :mod:`~trajgrad.rollout.episodes`: :class:`EpisodeRunner`, the multi-turn episode loop
  (environment steps, observation tokens, compaction, policy versions; §16, §19) over an
  action backend.
* :mod:`~trajgrad.rollout.openai_backend`: :class:`OpenAIBackend` (an OpenAI-compatible
  server as action backend) and :class:`OpenAISampler`.
* :mod:`~trajgrad.rollout.vllm_server`: :class:`VLLMServer` (a vLLM server process trajgrad owns)
  and :mod:`~trajgrad.rollout.vllm_sampler`: :class:`VLLMSampler` (``rollout.backend: vllm``).
* :mod:`~trajgrad.rollout.sampler`: :class:`HFSampler` = ``EpisodeRunner(HFBackend(...))``.
* :mod:`~trajgrad.rollout.collate`: :func:`collate` -> :class:`RolloutBatch`.
* :mod:`~trajgrad.rollout.chat`: ChatML prompt and observation tokens.

Models, tokenizers, the decode step and position ids are in :mod:`trajgrad.model`


Importing this package does not import ``transformers``; the model helpers import it
when called.
"""
from .._lazy import lazy_attributes
from .chat import demonstration_trajectory, observation_ids, prompt_ids, render_prompt
from .collate import RolloutBatch, collate, position_ids_from_attention_mask
from .trajectory import Trajectory, TrajectoryLog, Turn, read_trajectories

_LAZY = {
    "HFSampler": "sampler",
    "sample_actions": "generation",
    "RowKV": "generation",
    "HFBackend": "generation",
    "Action": "generation",
    "SamplingSettings": "generation",
    "EpisodeRunner": "episodes",
    "OpenAISampler": "openai_backend",
    "OpenAIBackend": "openai_backend",
    "VLLMSampler": "vllm_sampler",
    "VLLMServer": "vllm_server",
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


__getattr__ = lazy_attributes(__name__, _LAZY)
