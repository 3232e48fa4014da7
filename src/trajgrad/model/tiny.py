"""A small randomly initialized ``LlamaForCausalLM`` for tests (nothing downloaded)."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["build_tiny_model"]


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
