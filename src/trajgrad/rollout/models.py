"""Former location of the model builders; they live in :mod:`trajgrad.model` now.

Kept as re-exports for old imports (remove once nothing imports ``trajgrad.rollout.models``).
"""
from ..model.dtype import preferred_dtype
from ..model.kv import cache_kwarg, output_cache
from ..model.smollm2 import SMOLLM2_PACKAGE, cache_root, load_smollm2, smollm2_gguf_path
from ..model.tiny import build_tiny_model
from ..model.tokenizer import CHATML_TEMPLATE, CharTokenizer, build_char_tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "CharTokenizer",
    "SMOLLM2_PACKAGE",
    "build_char_tokenizer",
    "build_tiny_model",
    "cache_kwarg",
    "cache_root",
    "load_smollm2",
    "output_cache",
    "preferred_dtype",
    "smollm2_gguf_path",
]
