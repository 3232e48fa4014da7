"""Benchmark: trajgrad's own sampler against vLLM (``rollout.backend: vllm``) on the main job's workload.

Workload: the ``default`` preset (SmolLM2-135M-Instruct + LoRA r=8, calculator task, GRPO,
8 prompts x 4 samples per step, temperature 0.7) with ``max_turns`` 2 and no evaluation, for
``--steps`` training steps per backend, each backend in a fresh :class:`Trainer` on the same
seed. Reported per backend, from the run's ``metrics.jsonl``: action tokens per second of the
rollouts (``throughput/gen_tokens_per_s``), seconds of rollout per step (``time/generate``),
seconds per training step (``time/step``: rollout + update), and for vLLM the server's start-up
seconds (separately) and the seconds of each weight sync (``sync/seconds``). Step 1 of each
backend is reported apart from the later steps (vLLM's first requests warm its caches).

Usage::

    .venv/bin/python bench/bench_vllm.py [--steps 3] [--dtype float32] [--out bench/results/vllm.md]

Needs ``make vllm`` (``.venv-vllm``). The machine is shared: the load average before and after
each backend is printed with the table.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _run(backend: str, steps: int, dtype: str, work: Path):
    from trajgrad.train.config import load_config
    from trajgrad.train.metrics import read_metrics
    from trajgrad.train.trainer import Trainer

    sets = {"train.steps": steps, "eval.before": False, "eval.after": False, "eval.every": 0,
            "checkpoint.every": 0, "log.progress": False, "model.dtype": dtype, "rollout.backend": backend}
    cfg = load_config(preset="default")
    data = cfg.model_dump()
    for key, value in sets.items():
        node = data
        *head, last = key.split(".")
        for part in head:
            node = node[part]
        node[last] = value
    data["task"]["options"] = {**data["task"].get("options", {}), "max_turns": 2}
    from trajgrad.train.config import build_config

    cfg = build_config(data)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    tr = Trainer(cfg, work / backend, console=lambda *a, **k: None)
    built = time.perf_counter() - t0
    startup = list(getattr(getattr(tr.sampler, "owned", None), "startup_seconds", []) or [])
    tr.run()
    total = time.perf_counter() - t0
    rows = [r for r in read_metrics(work / backend) if r["kind"] == "train"]
    return {"rows": rows, "built_s": built, "startup_s": startup, "total_s": total, "load_before": load,
            "load_after": os.getloadavg()[0]}


def _fmt(xs, f="{:.1f}"):
    return " / ".join(f.format(x) for x in xs) if xs else "-"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--backends", default="hf,vllm", help="comma-separated: hf, vllm")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "vllm.md")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    results = {}
    for backend in args.backends.split(","):
        print(f"{backend}: {args.steps} steps ...", flush=True)
        results[backend] = _run(backend, args.steps, args.dtype, work)
    lines = [f"# trajgrad's sampler vs vLLM ({args.dtype})", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} CPUs, shared with other jobs (load average before/after each backend below).", "",
             "```", f"PYTHONPATH=src python bench/bench_vllm.py --steps {args.steps} --dtype {args.dtype} --backends {args.backends}", "```", "",
             "Workload: the default preset (SmolLM2-135M-Instruct + LoRA r=8, calculator, GRPO, 8 prompts x 4 "
             "samples, T=0.7), max_turns 2. Per step: rollout of 32 episodes, update, weight sync (vLLM).", "",
             "| | trajgrad sampler (hf) | vLLM-CPU |", "| --- | ---: | ---: |"]
    empty = {"rows": [], "built_s": float("nan"), "startup_s": [], "total_s": float("nan"),
             "load_before": float("nan"), "load_after": float("nan")}
    hf, vl = results.get("hf", empty), results.get("vllm", empty)

    def col(res, key, later=True):
        vals = [r.get(key) for r in (res["rows"][1:] if later else res["rows"][:1]) if r.get(key) is not None]
        return statistics.mean(vals) if vals else float("nan")

    for label, key, f in (("action tokens/s, step 1", "throughput/gen_tokens_per_s", "{:.1f}"),
                          ("action tokens/s, steps 2+", "throughput/gen_tokens_per_s", "{:.1f}"),
                          ("rollout s/step, steps 2+", "time/generate", "{:.1f}"),
                          ("training step s (rollout + update), steps 2+", "time/step", "{:.1f}")):
        later = "2+" in label
        lines.append(f"| {label} | {f.format(col(hf, key, later))} | {f.format(col(vl, key, later))} |")
    syncs = [r["sync/seconds"] for r in vl["rows"] if "sync/seconds" in r]
    lines.append(f"| weight sync s (LoRA adapter load + prefix-cache reset) | - | {_fmt(syncs, '{:.2f}')} |")
    lines.append(f"| server start-up s (separate) | - | {_fmt(vl['startup_s'])} |")
    lines.append(f"| trainer built (incl. start-up) s | {hf['built_s']:.1f} | {vl['built_s']:.1f} |")
    lines.append(f"| whole run s ({args.steps} steps) | {hf['total_s']:.1f} | {vl['total_s']:.1f} |")
    lines.append(f"| load average before / after | {hf['load_before']:.1f} / {hf['load_after']:.1f} | "
                 f"{vl['load_before']:.1f} / {vl['load_after']:.1f} |")
    lines.append("")
    lines.append("Per step (time/step s): hf " + _fmt([r["time/step"] for r in hf["rows"]]) + "; vLLM "
                 + _fmt([r["time/step"] for r in vl["rows"]]) + ". Max |learner - served log-prob| per step, vLLM: "
                 + _fmt([r["mismatch/max_abs_log_ratio"] for r in vl["rows"]], "{:.1e}") + ".")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
