"""Benchmark: the sampler's lean decode step against the model's own forward per token.

``sample_actions(fast_decode=True)`` (model/decode.py: preallocated key/value buffers, the
fused calls of model/decode_plan.py) against ``fast_decode=False`` (the Hugging Face
forward with its dynamic cache for every new token) and against the lean step calling each
module as it is (a plan without stacked weights, functional norms or rotary table), on the
same rows, seed and model, alternating the three ``--rounds`` times; the median time of
each is reported. All must sample the same tokens (checked) with log-probs within 1e-5.

Models: the tiny Llama of ``bench_trl.py`` (hidden 128, 2 layers; 64 rows = 8 prompts x
G = 8) and, with ``--smollm2``, SmolLM2-135M-Instruct + LoRA r=8 (the default preset).

Usage::

    .venv/bin/python bench/bench_decode.py [--threads 1] [--rounds 7] [--smollm2]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

SIDES = ("forward", "modules", "plan")


@contextlib.contextmanager
def _modules_only():
    """The lean decode step with a plan that calls every module (the step before DecodePlan)."""
    from trajgrad.model.decode_plan import DecodePlan
    from trajgrad.rollout import generation

    generation.DecodePlan = DecodePlan.modules_only
    try:
        yield
    finally:
        generation.DecodePlan = DecodePlan


def _workload(smollm2: bool):
    from trajgrad.envs import get_task_source
    from trajgrad.rollout.chat import end_of_turn_id, prompt_ids

    if smollm2:
        from trajgrad.train.config import load_config
        from trajgrad.model.build import build_policy_model

        cfg = load_config(preset="default")
        model, tok = build_policy_model(cfg.model)
        src = get_task_source("calculator", **cfg.task.options)
        rows, new, name = 16, cfg.sampling.max_new_tokens, "SmolLM2-135M-Instruct + LoRA r=8 (default preset)"
    else:
        from trajgrad.model.tiny import build_tiny_model
        from trajgrad.model.tokenizer import build_char_tokenizer

        tok = build_char_tokenizer()
        model = build_tiny_model(tok, hidden_size=128, layers=2, heads=4, seed=0)
        src = get_task_source("calculator", few_shot=False, system_prompt="", max_turns=1, min_ops=1, max_ops=2,
                              max_operand=99)
        rows, new, name = 64, 32, "tiny Llama (hidden 128, 2 layers, char vocabulary), as in bench_trl.py"
    tasks = src.tasks("train", rows // 8 if not smollm2 else rows, 0)
    prompts = [prompt_ids(tok, src.make_env().reset(t)) for t in tasks]
    seqs = [p for p in prompts for _ in range(8)] if not smollm2 else prompts
    pad = tok.pad_token_id if tok.pad_token_id is not None else end_of_turn_id(tok)
    return model.eval(), seqs, [end_of_turn_id(tok)], pad, new, name


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--smollm2", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from trajgrad.rollout.sampler import sample_actions

    model, seqs, eos, pad, new, name = _workload(args.smollm2)
    load_before = os.getloadavg()
    times = {side: [] for side in SIDES}
    outs = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for side in SIDES:
            ctx = _modules_only() if side == "modules" else contextlib.nullcontext()
            t0 = time.perf_counter()
            with torch.no_grad(), ctx:
                outs[side] = sample_actions(model, seqs, eos_ids=eos, pad_id=pad, temperature=1.0, max_new_tokens=new,
                                            generator=torch.Generator().manual_seed(r), fast_decode=side != "forward")
            if r:
                times[side].append(time.perf_counter() - t0)
        for side in SIDES[1:]:
            assert [a for a, _, _ in outs[side]] == [a for a, _, _ in outs["forward"]], f"{side}: different tokens"
            dev = max((abs(x - y) for (_, a, _), (_, b, _) in zip(outs[side], outs["forward"]) for x, y in zip(a, b)),
                      default=0.0)
            assert dev < 1e-5, f"{side}: log-probs differ by {dev}"
    med = {k: statistics.median(v) for k, v in times.items()}
    n_tok = sum(len(a) for a, _, _ in outs["plan"])
    out = args.out or Path(__file__).resolve().parent / "results" / ("decode_smollm2.md" if args.smollm2 else "decode.md")
    lines = [
        f"# Lean decode step vs the model's forward per token ({'SmolLM2' if args.smollm2 else 'tiny model'})",
        "",
        f"- command: `.venv/bin/python bench/bench_decode.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M:%S')}; torch "
        f"{torch.__version__}, threads {args.threads}, load average {load_before[0]:.1f} before / {os.getloadavg()[0]:.1f} after",
        f"- workload: {name}; {len(seqs)} rows, up to {new} new tokens at temperature 1 ({n_tok} tokens in the last "
        f"round); median of {args.rounds} rounds alternating the three",
        "",
        "| decode | median (s) | rounds (s) |",
        "|---|---:|---|",
        f"| model forward per token (`fast_decode=False`) | {med['forward']:.3f} | "
        + ", ".join(f"{t:.3f}" for t in times["forward"]) + " |",
        f"| lean decode step, each module called | {med['modules']:.3f} | "
        + ", ".join(f"{t:.3f}" for t in times["modules"]) + " |",
        f"| lean decode step with its plan (`fast_decode=True`) | {med['plan']:.3f} | "
        + ", ".join(f"{t:.3f}" for t in times["plan"]) + " |",
        f"| **speed-up over the forward** | **{med['forward'] / med['plan']:.2f}x** | same tokens, log-probs within 1e-5 |",
        f"| **speed-up of the plan over the modules** | **{med['modules'] / med['plan']:.2f}x** | per round: "
        + ", ".join(f"{m / p:.2f}x" for m, p in zip(times["modules"], times["plan"])) + " |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()
