r"""Load a user's Hugging Face causal LM from a local directory or the local hub cache (never downloaded).

``model.path`` names either

* a local directory holding a checkpoint (``config.json``, the weights as ``*.safetensors``
  or ``*.bin``, and the tokenizer files with a chat template), as ``save_pretrained``
  writes it, or
* a hub id (``"Qwen/Qwen2.5-0.5B-Instruct"``) already in the local Hugging Face cache
  (``$HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``), resolved with
  ``local_files_only=True``: nothing is downloaded (``HF_HUB_OFFLINE`` semantics).

:func:`resolve_model_path` finds the directory and checks that it holds a checkpoint (cheap:
file names and ``config.json`` only; the config loader calls it before anything is built),
:func:`load_pretrained` loads ``AutoModelForCausalLM`` and ``AutoTokenizer`` from it. A
missing or incomplete model raises one ``ValueError`` naming the config key and saying
where it looked.

Only models whose logits are ``lm_head(h)`` of the final hidden state are accepted: the
learner and the sampler compute the head themselves in float32
(:mod:`trajgrad.model.learner`), so a final-logit soft-cap (Gemma 2) or a logit scale
(Cohere) would be silently dropped; such configs are refused.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Iterator, Tuple

import torch

__all__ = ["hub_cache_dir", "load_pretrained", "offline", "resolve_model_path"]

_WEIGHTS = (".safetensors", ".bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
# config attributes that change the logits after lm_head (the learner computes lm_head(h) itself)
_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale")


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` inside the block (restored after)."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    for k in keys:
        os.environ[k] = "1"
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def hub_cache_dir() -> str:
    """The local Hugging Face hub cache searched for hub ids."""
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return os.path.expanduser("~/.cache/huggingface/hub")


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")


def _from_cache(repo_id: str, key: str) -> Path:
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        with offline():
            found = snapshot_download(repo_id, local_files_only=True, cache_dir=cache)
    except Exception as exc:  # LocalEntryNotFoundError, HFValidationError (a malformed id), ...
        raise ValueError(
            f"{key}: {repo_id!r} is neither a local directory nor a model in the local Hugging Face cache "
            f"(looked for the directory {os.path.abspath(os.path.expanduser(repo_id))!r} and in the cache {cache!r}; "
            f"nothing is downloaded: fetch it first, e.g. `hf download {repo_id}`, or give a "
            f"directory written by save_pretrained) [{type(exc).__name__}]"
        ) from None
    return Path(found)


def resolve_model_path(path: str, *, key: str = "model.path") -> Path:
    """The checkpoint directory ``path`` names, checked; ValueError naming ``key`` otherwise.

    A directory is used as is; anything that is not shaped like a hub id (``name`` or
    ``owner/name``: ``./x``, ``/x``, ``~/x``, ``a/b/c``) must be an existing directory; a
    hub id that is not a directory is looked up in the local cache only. The directory must hold ``config.json`` (with a
    ``model_type``), weights and tokenizer files.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{key}: expected a directory or a hub id, got {path!r}")
    local = Path(path).expanduser()
    if local.is_dir():
        where = local
    elif local.exists():
        raise ValueError(f"{key}: {path!r} is a file; expected a checkpoint directory (config.json, weights, tokenizer)")
    elif not _HUB_ID.match(path) or ".." in path:
        raise ValueError(f"{key}: no such directory {str(local.absolute())!r}")
    else:
        where = _from_cache(path, key)
    cfg_file = where / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{key}: {str(where)!r} holds no config.json; expected a checkpoint saved with save_pretrained")
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{key}: cannot read {str(cfg_file)!r} ({exc})") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ValueError(f"{key}: {str(cfg_file)!r} has no model_type; not a Hugging Face model config")
    names = [p.name for p in where.iterdir()]
    if not any(n.endswith(_WEIGHTS) for n in names):
        raise ValueError(f"{key}: {str(where)!r} holds no weights (*.safetensors or *.bin)")
    if not any(n in _TOKENIZER_FILES for n in names):
        raise ValueError(f"{key}: {str(where)!r} holds no tokenizer (tokenizer.json, tokenizer_config.json, ...)")
    for attr in _HEAD_TRANSFORMS:
        cfgs = [config] + [v for v in config.values() if isinstance(v, dict)]  # text_config of multimodal configs
        if any(c.get(attr) not in (None, 1, 1.0) for c in cfgs):
            raise ValueError(f"{key}: the model's config sets {attr}, which changes its logits after lm_head; "
                             "the learner computes lm_head(h) itself, so this architecture is not supported")
    return where


def _load_tokenizer(where: Path, auto):
    """The tokenizer saved in ``where``. One declared as the generic fast tokenizer
    (``tokenizer_class`` ``PreTrainedTokenizerFast`` / ``TokenizersBackend``) with a
    ``tokenizer.json`` is loaded from that file as is: ``AutoTokenizer`` would build the
    model type's own tokenizer class instead, whose pre-tokenizer can differ from the saved one."""
    try:
        declared = json.loads((where / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        declared = None
    if declared in ("PreTrainedTokenizerFast", "TokenizersBackend") and (where / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(where))
    return auto.from_pretrained(str(where))


def load_pretrained(path: str, *, dtype: torch.dtype, key: str = "model.path") -> Tuple[torch.nn.Module, object]:
    """``(model, tokenizer)`` from :func:`resolve_model_path`'s directory, offline, in eval mode.

    ``AutoModelForCausalLM.from_pretrained(dir, dtype=dtype)`` with the ``sdpa`` attention
    implementation where the architecture has it, and ``AutoTokenizer.from_pretrained(dir)``.
    The tokenizer must carry a chat template (the conversation is rendered with it); a
    tokenizer without a padding token pads with its EOS token. Remote code is never run.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = resolve_model_path(path, key=key)
    with offline():
        try:
            tokenizer = _load_tokenizer(where, AutoTokenizer)
        except Exception as exc:
            raise ValueError(f"{key}: cannot load the tokenizer from {str(where)!r}: {' '.join(str(exc).split())[:300]}") from None
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{key}: the tokenizer in {str(where)!r} has no chat template; trajgrad renders "
                             "conversations with the model's own template (set tokenizer.chat_template and save it)")
        try:
            try:
                model = AutoModelForCausalLM.from_pretrained(str(where), dtype=dtype, attn_implementation="sdpa")
            except (ValueError, ImportError) as exc:
                if "sdpa" not in str(exc).lower() and "attn" not in str(exc).lower():
                    raise
                model = AutoModelForCausalLM.from_pretrained(str(where), dtype=dtype)
        except ValueError as exc:
            raise ValueError(f"{key}: cannot load a causal LM from {str(where)!r}: {' '.join(str(exc).split())[:300]}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    model.config._name_or_path = str(path)
    return model.eval(), tokenizer
