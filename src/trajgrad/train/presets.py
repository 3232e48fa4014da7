"""The named presets of ``trajgrad train --preset NAME`` (plain data, validated when imported).

``default``: SmolLM2-135M-Instruct + LoRA on the calculator tool with GRPO; ``tiny``: a random
tiny model on two-digit additions (SFT warm start, then GRPO); ``sao-tiny``, ``sao``,
``sao-coding``: single-rollout asynchronous optimization (§20); ``chain``: SmolLM2 on three
dependent tool calls (a short SFT warm start, then GRPO).
"""
from __future__ import annotations

from typing import Any, Dict

# The tiny presets' task: one addition of two operands in 10..49 (operands and results all
# two digits wide), solved with a tool call then the answer. 60% of the demonstrations answer
# without the tool, so the warm-started model mostly guesses; RL teaches it to use the tool.
# Running out of turns is a failure (terminated, no critic bootstrap for PPO/SAO to exploit).
_TINY_CALC = {"name": "calculator", "n_train": 1000, "n_heldout": 128,
              "options": {"few_shot": False, "system_prompt": "", "max_turns": 2, "max_turns_terminates": True,
                          "min_ops": 1, "max_ops": 1, "min_operand": 10, "max_operand": 49, "operators": "+",
                          "direct_demo_fraction": 0.6}}
_TINY_MODEL = {"name": "tiny", "dtype": "float32", "lora": None,
               "tiny": {"hidden_size": 96, "layers": 2, "heads": 4, "seed": 0}}
_TINY_SAMPLING = {"temperature": 0.7, "max_new_tokens": 24}
_TINY_SFT = {"steps": 300, "batch_size": 32, "lr": 3e-3}

PRESETS: Dict[str, Dict[str, Any]] = {
    # The main job: SmolLM2-135M-Instruct + LoRA learns to use a calculator tool, GRPO.
    "default": {
        "name": "smollm2-calculator-grpo",
        "model": {"name": "smollm2", "dtype": "auto", "lora": {"r": 8, "alpha": 16}},
        # no system message: SmolLM2-135M follows the one-shot chat example, while an
        # instruction system prompt makes it answer without calling the tool
        # two turns: call the calculator, then answer (the base model first writes a
        # made-up <result> instead of calling; RL has to teach it to call first)
        # running out of turns without an answer is a failure (terminated), so a recipe with a
        # critic (`--set recipe.name=ppo`) cannot learn to stall into a bootstrapped value
        "task": {"name": "calculator", "n_train": 4000, "n_heldout": 64,
                 "options": {"max_turns": 2, "max_turns_terminates": True, "system_prompt": ""}},
        "sampling": {"temperature": 0.7, "max_new_tokens": 32},
        "recipe": {"name": "grpo", "overrides": {"kl_coef": 0.0, "kl_placement": "none"}},
        "optim": {"lr": 5e-4},
        # 8 steps: held-out 0/64 -> 62/64 after 8 steps and after 12 alike (16 steps: 63/64);
        # no evaluation during the run (before and after only): 4 to 7 minutes on 2 cores (bench/results/main_job.md)
        "train": {"steps": 8, "prompts_per_step": 8, "group_size": 4, "micro_batch_size": 8},
        "eval": {"every": 0, "during_n": 16, "temperature": 0.0},
        "checkpoint": {"every": 4},
    },
    # A randomly initialized small model: SFT warm start, then GRPO; 40-50 s on 2 quiet cores, 15-20 min
    # when other jobs shared them (bench/bench_learning.py --task tiny).
    # After the warm start the model mostly answers without the calculator and guesses (held-out
    # greedy success ~7%); GRPO teaches it to call the tool (seeds 0-4: 89.1%, 50.0%, 89.8%, 89.8%, 100%
    # held-out; README "Seed stability").
    "tiny": {
        "name": "tiny-calculator-grpo",
        "model": _TINY_MODEL,
        "task": _TINY_CALC,
        "sampling": _TINY_SAMPLING,
        "recipe": {"name": "grpo", "overrides": {"kl_coef": 0.0, "kl_placement": "none"}},
        "optim": {"lr": 5e-4},
        "train": {"steps": 30, "prompts_per_step": 16, "group_size": 8, "micro_batch_size": 128},
        "sft": _TINY_SFT,
        "eval": {"every": 0, "temperature": 0.0},
        "checkpoint": {"every": 10},
        "log": {"tensorboard": False},
    },
}

_ASYNC = {"enabled": True, "workers": 2, "max_lag": 2, "batch_trajectories": 16, "queue_size": 4, "partial": "per_segment"}
PRESETS.update({
    # Single-rollout asynchronous optimization (§20) on 2 local Ray workers, tiny model.
    "sao-tiny": {
        "name": "tiny-calculator-sao",
        "model": _TINY_MODEL,
        "task": _TINY_CALC,
        "sampling": _TINY_SAMPLING,
        "recipe": {"name": "sao"},
        "optim": {"lr": 3e-4},  # below tiny's 5e-4: an update sees 16 trajectories, not 128
        "critic": {"lr": 1e-3, "warmup_steps": 2},
        "train": {"steps": 20, "prompts_per_step": 16, "micro_batch_size": 64},
        "sft": _TINY_SFT,
        "eval": {"every": 0, "temperature": 0.0},
        "checkpoint": {"every": 10},
        "log": {"tensorboard": False},
        "asynchronous": _ASYNC,
    },
    # SmolLM2-135M-Instruct + LoRA, SAO with the paper's reasoning interval (0.3, 5.0), K = 2.
    "sao": {
        "name": "smollm2-calculator-sao",
        "model": {"name": "smollm2", "dtype": "auto", "lora": {"r": 8, "alpha": 16}},
        "task": {"name": "calculator", "n_train": 4000, "n_heldout": 64,
                 "options": {"max_turns": 3, "max_turns_terminates": True, "system_prompt": ""}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 40},
        "recipe": {"name": "sao", "overrides": {"eps_low": 0.3, "eps_high": 5.0}},
        "optim": {"lr": 5e-4},
        "critic": {"lr": 1e-3, "warmup_steps": 2},
        "train": {"steps": 24, "prompts_per_step": 8, "micro_batch_size": 8},
        "eval": {"every": 0, "temperature": 0.0},
        "checkpoint": {"every": 4},
        "asynchronous": _ASYNC,
    },
})
# The dependent tool chain (lookup -> fetch -> calc -> answer, reward only for the answer; envs/chain.py)
# with GRPO. SmolLM2 never completes a chain untrained (held-out 0/64), so a short SFT warm start on the
# task's demonstrations (3 steps of 16; greedy held-out still 0/64 after it) lets sampling complete a chain
# now and then, and GRPO takes it from there (bench/bench_learning.py --task chain; README "Learning").
PRESETS["chain"] = {**PRESETS["default"], "name": "smollm2-chain-grpo",
                    "task": {"name": "chain", "n_train": 4000, "n_heldout": 64, "options": {"examples": 2}},
                    "sft": {"steps": 3, "batch_size": 16},
                    "train": {**PRESETS["default"]["train"], "steps": 12}}
# The paper's coding setting: (eps_low, eps_high) = (0.8, 3.0).
PRESETS["sao-coding"] = {**PRESETS["sao"], "name": "smollm2-calculator-sao-coding",
                         "recipe": {"name": "sao", "overrides": {"eps_low": 0.8, "eps_high": 3.0}}}
