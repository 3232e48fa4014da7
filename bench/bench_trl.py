"""trajgrad's group-synchronous GRPO trainer against TRL's GRPOTrainer, same inputs, one run.

Both train the same randomly initialized tiny Llama (char tokenizer, identical weights from
one seed) on the same calculator prompts, with the same group size, generation length,
sampling temperature, optimizer (AdamW, same lr), one optimizer step per generation batch
and no reference model (beta = 0). Single-turn episodes (TRL's GRPOTrainer is single-turn):
trajgrad's calculator environment with ``max_turns=1``. Reported: samples (completions) per
second over whole steps (generation + log-prob recompute + update), after warm-up steps,
and where trajgrad's time goes.

Workloads (``--workload``): ``tiny`` (the default: the tiny Llama, 8 prompts x G = 8, 32 new
tokens, full fine-tuning) and ``smollm2`` (SmolLM2-135M-Instruct, 2 prompts x G = 8, 128 new
tokens, LoRA r = 8 on q/k/v/o on both sides, float32).

TRL must be installed in the benchmark environment (not a trajgrad dependency); ``make peers``
builds ``.venv-peers`` (pinned trl, layered on ``.venv``)::

    PYTHONPATH=$PWD/src .venv-peers/bin/python bench/bench_trl.py --rounds 5
    PYTHONPATH=$PWD/src .venv-peers/bin/python bench/bench_trl.py --workload smollm2 --steps 2 --warmup 1 --rounds 1

``--trl-same-allocator`` adds TRL run with the allocator settings trajgrad's trainer applies
(``train.keep_freed_mb``; ``trajgrad.runtime.allocator``), given through glibc's environment
variables, alternated with the others: how much of the ratio those settings account for.

``--baseline-src DIR`` adds a third side, trajgrad imported from ``DIR`` (another checkout's
``src``), alternated with the others: the speed-up of this version over that one, measured in
the same run. Each side runs in its own subprocess, one after the other (never concurrently).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

P, G, L, LR, HIDDEN, LAYERS, HEADS = 8, 8, 32, 1e-4, 128, 2, 4
# per workload: prompts per step, group size, new tokens, model
WORKLOADS = {
    "tiny": {"P": 8, "G": 8, "L": 32, "model": "tiny"},
    "smollm2": {"P": 2, "G": 8, "L": 128, "model": "smollm2"},
}
LORA = {"r": 8, "alpha": 16}


def _configure(workload: str) -> None:
    global P, G, L
    w = WORKLOADS[workload]
    P, G, L = w["P"], w["G"], w["L"]


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


def _model_config(workload: str) -> dict:
    if WORKLOADS[workload]["model"] == "smollm2":
        return {"name": "smollm2", "dtype": "float32", "lora": dict(LORA)}
    return {"name": "tiny", "dtype": "float32", "lora": None,
            "tiny": {"hidden_size": HIDDEN, "layers": LAYERS, "heads": HEADS, "seed": 0}}


def _timed(module, name: str, acc: dict, key: str) -> None:
    """Wrap ``module.name`` so that its wall-clock time adds up in ``acc[key]``."""
    fn = getattr(module, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t0

    setattr(module, name, wrapper)


def run_trajgrad(steps: int, warmup: int, workload: str = "tiny") -> dict:
    import torch

    from trajgrad.train import updates
    from trajgrad.train.config import build_config
    from trajgrad.train.trainer import Trainer

    cfg = build_config({
        "name": "bench-trl", "model": _model_config(workload),
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
    import tempfile

    tr = Trainer(cfg, tempfile.mkdtemp(prefix="bench_trl_trajgrad_"), console=lambda *a: None)
    # inside the update: the forward passes (log-probs with their graph), the optimizer step
    # (gradient clipping included); backward and the rest of the update are what remains
    from trajgrad.rollout.trajectory import TrajectoryLog
    from trajgrad.train import tokenlog

    inner = {"forward": 0.0, "optimizer": 0.0, "fsync": 0.0, "tokenlog": 0.0, "trajlog": 0.0}
    _timed(updates, "logprobs", inner, "forward")
    _timed(updates, "finish_step", inner, "optimizer")
    # the per-token log (tokens.jsonl: recording, formatting, writing) and trajectories.jsonl
    for cls, name in ((tokenlog.StepRecord, "add"), (tokenlog.StepRecord, "lines"), (tokenlog.TokenLog, "write")):
        _timed(cls, name, inner, "tokenlog")
    _timed(TrajectoryLog, "extend", inner, "trajlog")
    # the logs' durability (trajectories.jsonl, tokens.jsonl: one fsync each per step); a wait on
    # the disk, which other processes' writes lengthen, not CPU time
    _timed(os, "fsync", inner, "fsync")
    times, cpu, parts = [], [], {"time/generate": 0.0, "time/logprob_recompute": 0.0, "time/update": 0.0}
    split = {k: 0.0 for k in inner}
    for i in range(steps + warmup):
        t0, c0 = time.perf_counter(), time.process_time()
        before = dict(inner)
        m = tr.train_step()
        tr.step += 1
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            cpu.append(time.process_time() - c0)
            for k in parts:
                parts[k] += m.get(k, 0.0)
            for k in split:
                split[k] += inner[k] - before[k]
    total = sum(times)
    bd = {k: v / total for k, v in parts.items()}
    bd["update/forward"] = split["forward"] / total
    bd["update/optimizer"] = split["optimizer"] / total
    bd["fsync"] = split["fsync"] / total
    bd["update/tokenlog"] = split["tokenlog"] / total
    bd["trajlog"] = split["trajlog"] / total
    # backward and the per-token log written during the update (tokens.jsonl)
    bd["update/backward_and_rest"] = bd["time/update"] - bd["update/forward"] - bd["update/optimizer"]
    return {"samples_per_s": steps * P * G / total, "seconds": total, "steps": steps, "breakdown": bd,
            "samples_per_cpu_s": steps * P * G / sum(cpu)}


def run_trl(steps: int, warmup: int, workload: str = "tiny") -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    peft_config = None
    if WORKLOADS[workload]["model"] == "smollm2":
        from peft import LoraConfig

        from trajgrad.model.build import build_model

        model, tok = build_model("smollm2", dtype="float32", lora=None, train=True)
        peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    else:
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

    stamps, cpu_stamps = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())
            cpu_stamps.append(time.process_time())

    import tempfile

    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="bench_trl_trl_"), per_device_train_batch_size=P * G, num_generations=G,
                      max_completion_length=L, learning_rate=LR, max_steps=steps + warmup, use_cpu=True,
                      report_to=[], logging_steps=1000, save_strategy="no", temperature=1.0, beta=0.0,
                      num_iterations=1, gradient_accumulation_steps=1, max_grad_norm=1e9, lr_scheduler_type="constant",
                      warmup_steps=0, weight_decay=0.0, loss_type="dapo", bf16=False, disable_tqdm=True,
                      dataloader_num_workers=0, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()], peft_config=peft_config)
    t_start, c_start = time.perf_counter(), time.process_time()
    trainer.train()
    marks = [t_start] + stamps
    durations = [b - a for a, b in zip(marks[:-1], marks[1:])][warmup:]
    cmarks = [c_start] + cpu_stamps
    cpu = [b - a for a, b in zip(cmarks[:-1], cmarks[1:])][warmup:]
    total = sum(durations)
    return {"samples_per_s": len(durations) * P * G / total, "seconds": total, "steps": len(durations),
            "samples_per_cpu_s": len(durations) * P * G / sum(cpu)}


def _breakdown(bd: dict) -> str:
    rest = 1 - bd["time/generate"] - bd["time/logprob_recompute"] - bd["time/update"]
    return (f"generation {bd['time/generate']:.0%}, separate log-prob passes {bd['time/logprob_recompute']:.0%}, "
            f"update {bd['time/update']:.0%} (forward {bd['update/forward']:.0%}, backward and the per-token log "
            f"{bd['update/backward_and_rest']:.0%}, optimizer {bd['update/optimizer']:.0%}), the rest (rewards, "
            f"advantages, collation, trajectory log) {rest:.0%}"
            + (f"; inside these: the per-token log (tokens.jsonl, in the update) {bd['update/tokenlog']:.1%}, "
               f"the trajectory log {bd['trajlog']:.1%}, waiting in fsync (both logs) {bd['fsync']:.1%}"
               if "fsync" in bd else ""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--side", choices=["trajgrad", "trl"])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    ap.add_argument("--out", default=None, help="default: bench/results/trl.md (tiny), trl_<workload>.md otherwise")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads of each side")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of each side; the median is reported")
    ap.add_argument("--trl-same-allocator", action="store_true",
                    help="also run TRL with the allocator settings trajgrad's trainer applies (train.keep_freed_mb), "
                         "alternated: how much of the ratio they account for")
    ap.add_argument("--baseline-src", default=None,
                    help="also run trajgrad imported from this directory (another checkout's src), alternated")
    a = ap.parse_args()
    _configure(a.workload)
    if a.side:
        import torch

        torch.set_num_threads(a.threads)
        fn = run_trajgrad if a.side == "trajgrad" else run_trl
        print("RESULT " + json.dumps(fn(a.steps, a.warmup, a.workload)))
        return
    out_path = a.out or ("bench/results/trl.md" if a.workload == "tiny" else f"bench/results/trl_{a.workload}.md")
    sides = ["trajgrad", "trl"] + (["trl-alloc"] if a.trl_same_allocator else []) + (["baseline"] if a.baseline_src else [])
    runs = {s: [] for s in sides}
    loads = []
    for rnd in range(a.rounds):  # alternate the sides so that a change in machine load hits all of them
        for side in sides:
            env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
            if side == "baseline":
                env["PYTHONPATH"] = os.path.abspath(a.baseline_src)
            if side == "trl-alloc":
                from trajgrad.runtime.allocator import env_equivalent
                from trajgrad.train.config import LoopConfig

                env.update(env_equivalent(LoopConfig().keep_freed_mb))
            out = subprocess.run([sys.executable, __file__, "--side", "trl" if side.startswith("trl") else "trajgrad",
                                  "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads),
                                  "--workload", a.workload], capture_output=True, text=True, env=env)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                print(out.stdout[-3000:], out.stderr[-5000:])
                raise SystemExit(f"{side} failed")
            runs[side].append(json.loads(line[0][7:]))
            loads.append(os.getloadavg()[0])
            print(f"round {rnd + 1} {side}: {runs[side][-1]['samples_per_s']:.2f} samples/s, "
                  f"{runs[side][-1].get('samples_per_cpu_s', float('nan')):.2f} per CPU-second", flush=True)
    res = {side: sorted(r, key=lambda x: x["samples_per_s"])[len(r) // 2] for side, r in runs.items()}  # median run
    import torch
    import trl

    ratio = res["trajgrad"]["samples_per_s"] / res["trl"]["samples_per_s"]
    per_round = [t["samples_per_s"] / r["samples_per_s"] for t, r in zip(runs["trajgrad"], runs["trl"])]
    wl = WORKLOADS[a.workload]
    model_text = (f"Llama hidden {HIDDEN}, {LAYERS} layers, char vocabulary, full fine-tuning" if wl["model"] == "tiny"
                  else f"SmolLM2-135M-Instruct, float32, LoRA r={LORA['r']} alpha={LORA['alpha']} on q/k/v/o (both sides)")
    cmd = (f"PYTHONPATH=$PWD/src {sys.executable} bench/bench_trl.py --workload {a.workload} --steps {a.steps} "
           f"--warmup {a.warmup} --threads {a.threads} --rounds {a.rounds}"
           + (" --trl-same-allocator" if a.trl_same_allocator else "")
           + (f" --baseline-src {a.baseline_src}" if a.baseline_src else ""))
    title = "same tiny model" if wl["model"] == "tiny" else "same SmolLM2-135M"
    md = [
        f"## trajgrad GRPO vs TRL GRPOTrainer ({title}, prompts, group size, generation length, optimizer)",
        "",
        f"Command: `{cmd}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}, trl {trl.__version__}, "
        f"threads {a.threads} (OMP_NUM_THREADS={a.threads}), load average {min(loads):.1f} to {max(loads):.1f} "
        f"(a shared 2-core machine); model: {model_text}; {P} prompts x G={G} per step, {L} new tokens, AdamW lr {LR}, "
        "beta 0, one update per batch.",
        "",
        "| trainer | samples/s | measured steps | seconds |",
        "| --- | ---: | ---: | ---: |",
        f"| TRL GRPOTrainer | {res['trl']['samples_per_s']:.2f} | {res['trl']['steps']} | {res['trl']['seconds']:.1f} |",
        f"| trajgrad | {res['trajgrad']['samples_per_s']:.2f} | {res['trajgrad']['steps']} | {res['trajgrad']['seconds']:.1f} |",
    ]
    if "trl-alloc" in res:
        md.append(f"| TRL GRPOTrainer, trajgrad's allocator settings | {res['trl-alloc']['samples_per_s']:.2f} | "
                  f"{res['trl-alloc']['steps']} | {res['trl-alloc']['seconds']:.1f} |")
    if "baseline" in res:
        md.append(f"| trajgrad from `{a.baseline_src}` (before) | {res['baseline']['samples_per_s']:.2f} | "
                  f"{res['baseline']['steps']} | {res['baseline']['seconds']:.1f} |")
    md += [
        f"| **ratio trajgrad / TRL** | **{ratio:.2f}x** | | |",
        "",
        f"Median of {a.rounds} alternating runs per side; per-round ratios trajgrad / TRL: "
        + ", ".join(f"{x:.2f}x" for x in per_round) + f" (lowest {min(per_round):.2f}x)"
        + "; samples/s per run: trajgrad " + ", ".join(f"{t['samples_per_s']:.1f}" for t in runs["trajgrad"])
        + ", TRL " + ", ".join(f"{r['samples_per_s']:.1f}" for r in runs["trl"])
        + ("" if "trl-alloc" not in runs else
           ", TRL with trajgrad's allocator settings " + ", ".join(f"{r['samples_per_s']:.1f}" for r in runs["trl-alloc"]))
        + ("" if "baseline" not in runs else
           ", trajgrad before " + ", ".join(f"{r['samples_per_s']:.1f}" for r in runs["baseline"])) + ".",
    ]
    if all("samples_per_cpu_s" in r for rr in runs.values() for r in rr):
        cres = {side: sorted(x["samples_per_cpu_s"] for x in r)[len(r) // 2] for side, r in runs.items()}
        threads = "one torch thread" if a.threads == 1 else f"{a.threads} torch threads, so up to {a.threads} CPU-seconds a second"
        md += ["", f"Per CPU-second of each process (process time, robust to other jobs on a shared machine; {threads}): "
               "median samples per CPU-second trajgrad " + f"{cres['trajgrad']:.2f}, TRL {cres['trl']:.2f}"
               + (f", trajgrad before {cres['baseline']:.2f}" if "baseline" in cres else "")
               + f"; ratio trajgrad / TRL **{cres['trajgrad'] / cres['trl']:.2f}x** (per round: "
               + ", ".join(f"{t['samples_per_cpu_s'] / r['samples_per_cpu_s']:.2f}x"
                           for t, r in zip(runs["trajgrad"], runs["trl"])) + ")"
               + (f"; TRL with trajgrad's allocator settings {cres['trl-alloc']:.2f}, trajgrad / that "
                  f"**{cres['trajgrad'] / cres['trl-alloc']:.2f}x** (per round: "
                  + ", ".join(f"{t['samples_per_cpu_s'] / r['samples_per_cpu_s']:.2f}x"
                              for t, r in zip(runs["trajgrad"], runs["trl-alloc"])) + ")" if "trl-alloc" in cres else "")
               + (f"; trajgrad / before {cres['trajgrad'] / cres['baseline']:.2f}x (per round: "
                  + ", ".join(f"{t['samples_per_cpu_s'] / b['samples_per_cpu_s']:.2f}x"
                              for t, b in zip(runs["trajgrad"], runs["baseline"])) + ")" if "baseline" in cres else "")
               + "."]
    if "baseline" in res:
        sp = [t["samples_per_s"] / b["samples_per_s"] for t, b in zip(runs["trajgrad"], runs["baseline"])]
        md += ["", f"This version / the baseline (same rounds): " + ", ".join(f"{x:.2f}x" for x in sp)
               + f"; medians {res['trajgrad']['samples_per_s'] / res['baseline']['samples_per_s']:.2f}x; "
               f"baseline / TRL {res['baseline']['samples_per_s'] / res['trl']['samples_per_s']:.2f}x."]
    md += ["", "Where trajgrad's step time goes (median run): " + _breakdown(res["trajgrad"]["breakdown"]) + "."]
    if "baseline" in res:
        md += ["", "Before (the baseline's median run): " + _breakdown(res["baseline"]["breakdown"]) + "."]
    md.append("")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
