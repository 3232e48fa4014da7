"""trajgrad's group-synchronous GRPO trainer against TRL's GRPOTrainer, same inputs, one run.

Both train the same randomly initialized tiny Llama (char tokenizer, identical weights from
one seed) on the same calculator prompts, with the same group size, generation length,
sampling temperature, optimizer (AdamW, same lr), one optimizer step per generation batch
and no reference model (beta = 0). Single-turn episodes (TRL's GRPOTrainer is single-turn):
trajgrad's calculator environment with ``max_turns=1``. Reported: samples (completions) per
second over whole steps (generation + log-prob recompute + update), after warm-up steps,
and where trajgrad's time goes.

TRL must be installed in the benchmark environment (not a trajgrad dependency)::

    python3.11 -m venv /tmp/trlenv
    /tmp/trlenv/bin/pip install "torch==2.13.0" trl && /tmp/trlenv/bin/pip install -e ".[train]"
    /tmp/trlenv/bin/python bench/bench_trl.py

Each side runs in its own subprocess, one after the other (never concurrently).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

P, G, L, LR, HIDDEN, LAYERS, HEADS = 8, 8, 32, 1e-4, 128, 2, 4


def _tiny(seed=0):
    from trajgrad.model.tiny import build_tiny_model
    from trajgrad.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=HIDDEN, layers=LAYERS, heads=HEADS, seed=seed)
    return model, tok


def _tasks(n):
    from trajgrad.envs import get_task_source

    src = get_task_source("calculator", few_shot=False, system_prompt="", max_turns=1, min_ops=1, max_ops=2, max_operand=99)
    return src, src.tasks("train", n, 0)


def run_trajgrad(steps: int, warmup: int) -> dict:
    import torch

    from trajgrad.train.config import build_config
    from trajgrad.train.trainer import Trainer

    cfg = build_config({
        "name": "bench-trl", "model": {"name": "tiny", "dtype": "float32", "lora": None,
                                        "tiny": {"hidden_size": HIDDEN, "layers": LAYERS, "heads": HEADS, "seed": 0}},
        "task": {"name": "calculator", "n_train": 512, "n_heldout": 4,
                 "options": {"few_shot": False, "system_prompt": "", "max_turns": 1, "min_ops": 1, "max_ops": 2,
                             "max_operand": 99}},
        "sampling": {"temperature": 1.0, "max_new_tokens": L},
        "recipe": {"name": "grpo", "overrides": {"kl_coef": 0.0, "kl_placement": "none", "aggregation": "token_mean"}},
        "optim": {"lr": LR, "grad_clip": None},
        "train": {"steps": steps + warmup, "prompts_per_step": P, "group_size": G, "micro_batch_size": P * G},
        "eval": {"before": False, "after": False}, "checkpoint": {"every": 0},
        "log": {"tensorboard": False, "progress": False},
    })
    tr = Trainer(cfg, "/tmp/bench_trl_trajgrad", console=lambda *a: None)
    times, parts = [], {"time/generate": 0.0, "time/logprob_recompute": 0.0, "time/update": 0.0}
    for i in range(steps + warmup):
        t0 = time.perf_counter()
        m = tr.train_step()
        tr.step += 1
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            for k in parts:
                parts[k] += m.get(k, 0.0)
    total = sum(times)
    return {"samples_per_s": steps * P * G / total, "seconds": total, "steps": steps,
            "breakdown": {k: v / total for k, v in parts.items()}}


def run_trl(steps: int, warmup: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tok = _tiny()
    src, tasks = _tasks(512)
    env0 = src.make_env()
    prompts = [env0.reset(t) for t in tasks]
    answers = [t.answer for t in tasks]
    ds = Dataset.from_dict({"prompt": prompts, "answer": answers})

    def reward(completions, answer, **kw):
        from trajgrad.envs.base import extract_tag

        out = []
        for c, a in zip(completions, answer):
            text = c[0]["content"] if isinstance(c, list) else c
            got = extract_tag(text, "answer")
            out.append(1.0 if got is not None and got.strip() == str(a) else 0.0)
        return out

    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    args = GRPOConfig(output_dir="/tmp/bench_trl_trl", per_device_train_batch_size=P * G, num_generations=G,
                      max_completion_length=L, learning_rate=LR, max_steps=steps + warmup, use_cpu=True,
                      report_to=[], logging_steps=1000, save_strategy="no", temperature=1.0, beta=0.0,
                      num_iterations=1, gradient_accumulation_steps=1, max_grad_norm=1e9, lr_scheduler_type="constant",
                      warmup_steps=0, weight_decay=0.0, loss_type="dapo", bf16=False, disable_tqdm=True,
                      dataloader_num_workers=0, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()])
    t_start = time.perf_counter()
    trainer.train()
    marks = [t_start] + stamps
    durations = [b - a for a, b in zip(marks[:-1], marks[1:])][warmup:]
    total = sum(durations)
    return {"samples_per_s": len(durations) * P * G / total, "seconds": total, "steps": len(durations)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--side", choices=["trajgrad", "trl"])
    ap.add_argument("--out", default="bench/results/trl.md")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads of each side")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of each side; the median is reported")
    a = ap.parse_args()
    if a.side:
        import torch

        torch.set_num_threads(a.threads)
        fn = run_trajgrad if a.side == "trajgrad" else run_trl
        print("RESULT " + json.dumps(fn(a.steps, a.warmup)))
        return
    runs = {"trajgrad": [], "trl": []}
    for rnd in range(a.rounds):  # alternate the sides so that a change in machine load hits both
        for side in ("trajgrad", "trl"):
            env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
            out = subprocess.run([sys.executable, __file__, "--side", side, "--steps", str(a.steps), "--warmup",
                                  str(a.warmup), "--threads", str(a.threads)], capture_output=True, text=True, env=env)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                print(out.stdout[-3000:], out.stderr[-5000:])
                raise SystemExit(f"{side} failed")
            runs[side].append(json.loads(line[0][7:]))
            print(f"round {rnd + 1} {side}: {runs[side][-1]['samples_per_s']:.1f} samples/s", flush=True)
    res = {side: sorted(r, key=lambda x: x["samples_per_s"])[len(r) // 2] for side, r in runs.items()}  # median run
    import torch
    import trl

    ratio = res["trajgrad"]["samples_per_s"] / res["trl"]["samples_per_s"]
    bd = res["trajgrad"]["breakdown"]
    md = [
        "## trajgrad GRPO vs TRL GRPOTrainer (same tiny model, prompts, group size, generation length, optimizer)",
        "",
        f"Command: `{sys.executable} bench/bench_trl.py --steps {a.steps} --warmup {a.warmup} --threads {a.threads} "
        f"--rounds {a.rounds}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}, trl {trl.__version__}, "
        f"threads {a.threads}, load average {os.getloadavg()[0]:.1f}; model: Llama hidden {HIDDEN}, {LAYERS} layers, char vocabulary; "
        f"{P} prompts x G={G} per step, {L} new tokens, AdamW lr {LR}, beta 0, one update per batch.",
        "",
        "| trainer | samples/s | measured steps | seconds |",
        "| --- | ---: | ---: | ---: |",
        f"| TRL GRPOTrainer | {res['trl']['samples_per_s']:.1f} | {res['trl']['steps']} | {res['trl']['seconds']:.1f} |",
        f"| trajgrad | {res['trajgrad']['samples_per_s']:.1f} | {res['trajgrad']['steps']} | {res['trajgrad']['seconds']:.1f} |",
        f"| **ratio trajgrad / TRL** | **{ratio:.2f}x** | | |",
        "",
        f"Median of {a.rounds} alternating runs per side; per-round ratios: "
        + ", ".join(f"{t['samples_per_s'] / r['samples_per_s']:.2f}x" for t, r in zip(runs["trajgrad"], runs["trl"]))
        + "; samples/s per run: trajgrad " + ", ".join(f"{t['samples_per_s']:.0f}" for t in runs["trajgrad"])
        + ", TRL " + ", ".join(f"{r['samples_per_s']:.0f}" for r in runs["trl"]) + ".",
        "",
        f"Where trajgrad's step time goes: generation {bd['time/generate']:.0%}, log-prob recompute "
        f"{bd['time/logprob_recompute']:.0%}, update (forward + backward + optimizer) {bd['time/update']:.0%}, "
        f"the rest (rewards, advantages, logging) {1 - sum(bd.values()):.0%}.",
        "",
    ]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
