r"""The model layer: build or load a causal LM, decode one token, and compute learner log-probs.

A layer below :mod:`trajgrad.rollout` and :mod:`trajgrad.train` (it imports neither):

* :mod:`~trajgrad.model.build`: :func:`build_model` (a preset or any causal LM from a path),
  :func:`build_policy_model` (from a model config, duck-typed), :func:`lora_target_modules`,
  :func:`model_device`; :mod:`~trajgrad.model.pretrained`: :func:`resolve_model_path`,
  :func:`load_pretrained` (a checkpoint directory or a hub id in the local cache, offline).
* :mod:`~trajgrad.model.tokenizer`: :class:`CharTokenizer`, :func:`build_char_tokenizer`,
  :data:`CHATML_TEMPLATE`; :mod:`~trajgrad.model.tiny`: :func:`build_tiny_model`;
  :mod:`~trajgrad.model.smollm2`: :func:`load_smollm2` (GGUF, de-quantized once and cached);
  :mod:`~trajgrad.model.dtype`: :func:`preferred_dtype`, :func:`resolve_dtype`.
* :mod:`~trajgrad.model.decode`: :func:`decode_step`, the lean one-token decode step
  (:class:`KVBuffers`, :func:`fast_backbone`); :mod:`~trajgrad.model.decode_plan`: its fused calls
  (:class:`DecodePlan`); :mod:`~trajgrad.model.shared_prefix`: its attention
  over a group's prompt kept once (:class:`SharedPrefix`); :mod:`~trajgrad.model.kv`: the KV-cache
  argument names and per-row keys/values (:class:`RowKV`).
* :mod:`~trajgrad.model.learner`: :func:`learner_logprobs`, :func:`head_inputs`,
  :func:`causal_parts` (:mod:`~trajgrad.model.parts`); :mod:`~trajgrad.model.value_head`: :class:`ValueHead`,
  :class:`CriticModel`.
* :mod:`~trajgrad.model.positions`: :func:`position_ids_from_attention_mask`,
  :func:`prefix_groups`.

Importing this package does not import ``transformers``; the functions import it when called.
"""
from .._lazy import lazy_attributes

_LAZY = {
    "build_model": "build", "build_policy_model": "build", "model_device": "build", "MODEL_NAMES": "build",
    "lora_target_modules": "build",
    "hub_cache_dir": "pretrained", "load_pretrained": "pretrained", "offline": "pretrained",
    "resolve_model_path": "pretrained",
    "CHATML_TEMPLATE": "tokenizer", "CharTokenizer": "tokenizer", "build_char_tokenizer": "tokenizer",
    "build_tiny_model": "tiny",
    "load_smollm2": "smollm2", "smollm2_gguf_path": "smollm2", "cache_root": "smollm2", "SMOLLM2_PACKAGE": "smollm2",
    "preferred_dtype": "dtype", "resolve_dtype": "dtype",
    "KVBuffers": "decode", "decode_step": "decode", "fast_backbone": "decode", "DecodePlan": "decode_plan",
    "SharedPrefix": "shared_prefix", "shared_prefix_attention": "shared_prefix",
    "RowKV": "kv", "cache_kwarg": "kv", "output_cache": "kv",
    "LearnerOutput": "learner", "head_inputs": "learner", "learner_logprobs": "learner",
    "causal_lm": "parts", "causal_parts": "parts",
    "CriticModel": "value_head", "ValueHead": "value_head",
    "PrefixGroups": "positions", "position_ids_from_attention_mask": "positions", "prefix_groups": "positions",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_attributes(__name__, _LAZY)
