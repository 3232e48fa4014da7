r"""A character-level tokenizer built in code (no download), with a ChatML chat template.

:class:`CharTokenizer`: one token per printable ASCII character, newline and tab, plus the
ChatML special tokens; :func:`build_char_tokenizer` returns a fresh one. Used by the tiny
test model (:func:`trajgrad.model.tiny.build_tiny_model`).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

__all__ = ["CHATML_TEMPLATE", "CharTokenizer", "build_char_tokenizer", "IM_START", "IM_END", "PAD", "UNK"]


IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<pad>"
UNK = "<unk>"

#: ChatML, as SmolLM2 renders it (without SmolLM2's default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _char_vocab() -> dict:
    specials = [PAD, IM_START, IM_END, UNK]
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    return {tok: i for i, tok in enumerate(specials + chars)}


def _char_backend():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = _char_vocab()
    tk = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # every character is its own pre-token; the special tokens are matched first
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in (PAD, IM_START, IM_END, UNK)])
    return tk


@functools.lru_cache(maxsize=None)
def _char_tokenizer_class() -> type:
    """The :class:`CharTokenizer` class, made once: it derives from ``transformers``' fast tokenizer,
    so ``transformers`` is imported when the first tokenizer is built, not when this module is."""
    from transformers import PreTrainedTokenizerFast

    class CharTokenizer(PreTrainedTokenizerFast):
        """Character-level tokenizer: one token per printable ASCII character, ``\\n``, ``\\t``.

        Special tokens: ``<pad>`` (0, padding), ``<|im_start|>`` (1), ``<|im_end|>`` (2, also
        EOS: it ends an assistant turn), ``<unk>`` (3, any other character). The chat template
        is ChatML (:data:`CHATML_TEMPLATE`). ``decode(encode(s)) == s`` for every string of
        the vocabulary's characters. Saved copies reload with ``AutoTokenizer``.
        """

        def __init__(self, *args, **kwargs):
            if "tokenizer_object" not in kwargs and "tokenizer_file" not in kwargs and not args:
                kwargs["tokenizer_object"] = _char_backend()
            kwargs.setdefault("pad_token", PAD)
            kwargs.setdefault("eos_token", IM_END)
            kwargs.setdefault("unk_token", UNK)
            kwargs.setdefault("bos_token", None)
            kwargs.setdefault("clean_up_tokenization_spaces", False)
            kwargs.setdefault("chat_template", CHATML_TEMPLATE)
            super().__init__(*args, **kwargs)

        def save_pretrained(self, save_directory, *args, **kwargs):
            out = super().save_pretrained(save_directory, *args, **kwargs)
            # reload as a plain fast tokenizer: ``AutoTokenizer`` does not know this class
            cfg = Path(save_directory) / "tokenizer_config.json"
            if cfg.exists():
                data = json.loads(cfg.read_text())
                data["tokenizer_class"] = "PreTrainedTokenizerFast"
                cfg.write_text(json.dumps(data, indent=2, ensure_ascii=False))
            return out

    CharTokenizer.__qualname__ = "CharTokenizer"  # pickled by reference as trajgrad.model.tokenizer.CharTokenizer
    return CharTokenizer


def __getattr__(name: str):
    if name == "CharTokenizer":  # PEP 562: the class exists once transformers is imported
        return _char_tokenizer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_char_tokenizer() -> CharTokenizer:
    """A fresh :class:`CharTokenizer` (101 tokens)."""
    return _char_tokenizer_class()()

