r"""Weights of a model: peft detection, trainable state, and safetensors save/load.

One place for what a weight sync (``trajgrad serve``'s ``/reload``, the OpenAI backend's
:meth:`~trajgrad.rollout.openai_backend.OpenAISampler.sync_weights`, the Ray weight store)
and a checkpoint need to agree on:

* :mod:`~trajgrad.weights.state`: :func:`unwrap`, :func:`is_peft`,
  :func:`peft_adapter_name`, :func:`trainable_state` / :func:`load_trainable_state`,
  :func:`module_state` / :func:`module_state_loader`, :func:`file_tensors`.
* :mod:`~trajgrad.weights.files`: :func:`save_trainable`, :func:`safetensors_files`,
  :func:`named_tensors_loader`, :func:`adapter_loader`, :func:`checkpoint_module_loader`.
* :mod:`~trajgrad.weights.reference`: :class:`ReferenceWeights` (pi_ref, §9), :class:`ReferenceModel`
  (a separate frozen pi_ref, ``reference.path``).

Imports neither ``transformers`` nor ``peft`` until a function needs them.
"""
from .files import (
    CHECKPOINT_FORMAT,
    CHECKPOINTS,
    LATEST,
    MANIFEST,
    adapter_loader,
    checkpoint_module_loader,
    is_checkpoint,
    named_tensors_loader,
    safetensors_files,
    save_trainable,
)
from .reference import ReferenceModel, ReferenceWeights
from .state import (
    file_tensors,
    is_peft,
    load_trainable_state,
    module_state,
    module_state_loader,
    peft_adapter_name,
    trainable_state,
    unwrap,
)

__all__ = [
    "CHECKPOINTS",
    "CHECKPOINT_FORMAT",
    "LATEST",
    "MANIFEST",
    "ReferenceModel",
    "ReferenceWeights",
    "adapter_loader",
    "checkpoint_module_loader",
    "file_tensors",
    "is_checkpoint",
    "is_peft",
    "load_trainable_state",
    "module_state",
    "module_state_loader",
    "named_tensors_loader",
    "peft_adapter_name",
    "safetensors_files",
    "save_trainable",
    "trainable_state",
    "unwrap",
]
