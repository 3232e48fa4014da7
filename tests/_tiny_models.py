"""Tiny randomly initialized causal LMs of three families, each with a character-level
tokenizer and a chat template in its family's style (built in code, nothing downloaded).

* ``qwen2``: ChatML (``<|im_start|>role\\n...<|im_end|>\\n``), tools listed in the system
  turn inside ``<tools></tools>`` and tool results as ``<tool_response>`` user turns (Hermes
  style, as Qwen2.5 renders them).
* ``llama``: Llama 3 headers (``<|begin_of_text|>``, ``<|start_header_id|>role<|end_header_id|>\\n\\n
  ...<|eot_id|>``), tool results in the ``ipython`` role.
* ``gemma``: Gemma turns (``<bos>``, ``<start_of_turn>user|model\\n...<end_of_turn>\\n``), the
  system prompt folded into the first user turn (Gemma has no system role).

``LLAMA3_TRIM_TEMPLATE`` trims every message as Llama 3's own template does, and
``QWEN3_DROP_THINK_TEMPLATE`` drops the ``<think>`` block of earlier assistant turns as
Qwen3's does: both re-render an already-sampled history differently.
"""
from __future__ import annotations

import json
import os

import torch

QWEN2_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n\\nYou may call functions. Signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

_LLAMA3_BODY = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nYou can call these functions:' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + CONTENT + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = _LLAMA3_BODY.replace("CONTENT", "message['content']")
LLAMA3_TRIM_TEMPLATE = _LLAMA3_BODY.replace("CONTENT", "(message['content'] | trim)")

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(prefix='') %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set ns.prefix = messages[0]['content'] + '\\n\\n' %}{%- endif %}"
    "{%- if tools %}{%- set ns.prefix = ns.prefix + 'Tools:' %}"
    "{%- for tool in tools %}{%- set ns.prefix = ns.prefix + '\\n' + (tool | tojson) %}{%- endfor %}"
    "{%- set ns.prefix = ns.prefix + '\\n\\n' %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- else %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\\n' + ns.prefix + message['content'] + '<end_of_turn>\\n' }}"
    "{%- set ns.prefix = '' %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}"
)

QWEN3_DROP_THINK_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# (special tokens, eos (end of turn), bos, template, model type)
FAMILIES = {
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None, QWEN2_TEMPLATE),
    "llama": (["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
              "<|eot_id|>", "<|begin_of_text|>", LLAMA3_TEMPLATE),
    "gemma": (["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<end_of_turn>", "<bos>", GEMMA_TEMPLATE),
}


def family_tokenizer(family: str, *, template: str = None):
    """A character-level ``PreTrainedTokenizerFast`` with the family's special tokens and template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials, eos, bos, default_template = FAMILIES[family]
    unk = "<unk>"
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {t: i for i, t in enumerate(specials + [unk] + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials + [unk]])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token=eos, bos_token=bos, unk_token=unk, pad_token=specials[0],
        clean_up_tokenization_spaces=False, chat_template=template or default_template,
    )


def family_model(family: str, tokenizer, *, seed: int = 0, hidden_size: int = 64, layers: int = 2):
    """A random float32 causal LM of ``family`` (``AutoConfig.for_model`` + ``from_config``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"head_dim": 16} if family == "gemma" else {}
    config = AutoConfig.for_model(
        family, vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.2, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval()


def save_family_checkpoint(family: str, directory, *, seed: int = 0, template: str = None):
    """Write a checkpoint of ``family`` with ``save_pretrained`` (model and tokenizer); return the path."""
    tok = family_tokenizer(family, template=template)
    model = family_model(family, tok, seed=seed)
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    # declared as the generic fast tokenizer: loaded from tokenizer.json as saved (the model
    # type's own tokenizer class would pre-tokenize this vocabulary's whitespace away)
    cfg_file = os.path.join(str(directory), "tokenizer_config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_file, "w") as f:
        json.dump(cfg, f, indent=2)
    return str(directory)
