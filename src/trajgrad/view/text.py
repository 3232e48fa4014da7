"""Token ids to text for ``trajgrad view``: the run's tokenizer when it can be built offline.

The tiny model's tokenizer is built in code (:func:`trajgrad.model.tokenizer.build_char_tokenizer`);
SmolLM2's is read from the local cache that :func:`trajgrad.model.smollm2.load_smollm2`
writes (``$TRAJGRAD_CACHE/smollm2``), never downloaded. Otherwise the page shows token ids.
Each id is decoded on its own (``decode([id])``), so the page shows the sampled sequence
token by token, special tokens included.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

from ..model.smollm2 import cache_root
from ..model.tokenizer import build_char_tokenizer

__all__ = ["build_tokenizer", "token_texts"]


def build_tokenizer(config: Optional[Dict[str, Any]]) -> Tuple[Optional[Any], str]:
    """``(tokenizer or None, one line saying which)`` for a run's config dict."""
    name = ((config or {}).get("model") or {}).get("name")
    if name == "tiny":
        return build_char_tokenizer(), "tokenizer: the tiny model's character tokenizer"
    if name == "smollm2":
        try:
            cache = cache_root() / "smollm2"
            if not (cache / "tokenizer.json").is_file() and not (cache / "tokenizer_config.json").is_file():
                return None, f"tokenizer: SmolLM2's is not cached in {cache} (token ids shown)"
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(cache), local_files_only=True), f"tokenizer: SmolLM2 ({cache})"
        except Exception as exc:  # any failure to build it offline: fall back to ids
            return None, f"tokenizer: SmolLM2's could not be loaded offline ({type(exc).__name__}; token ids shown)"
    return None, f"tokenizer: none for model {name!r} (token ids shown)"


def token_texts(tokenizer, ids: Iterable[int]) -> Dict[int, str]:
    """``{id: text}`` for every distinct id (``"⟨id⟩"`` where decoding fails)."""
    out: Dict[int, str] = {}
    for i in sorted(set(int(x) for x in ids)):
        try:
            out[i] = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except Exception:
            out[i] = f"\u27e8{i}\u27e9"
    return out
