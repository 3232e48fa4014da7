"""Benchmark: multi-turn sampling with KV reuse, and the learner's shared-prefix pass, each
against the full recompute it replaces, on the embedded default's own workload.

* Sampling: ``HFSampler(reuse_kv=True)`` (each episode's keys/values kept between turns,
  the prompt prefix shared by the batch computed once), with the model's own forward for
  every new token (``fast_decode=False``) and with the lean decode step (``fast_decode=True``,
  rollout/decode.py), against ``reuse_kv=False, fast_decode=False`` (the whole context
  re-run every turn and the model's forward per token, as a sampler that calls
  ``generate()`` once per turn does). Same model, tasks, seed; greedy decoding, so all
  must produce the same tokens (checked).
* Learner: ``head_inputs(share_prefix=True)`` (the common prefix of a micro-batch run once)
  against the plain pass, forward + backward of the summed log-probs of the action tokens
  of the trajectories just sampled (micro-batches of ``--micro-batch`` rows). Log-probs
  must agree to 1e-4 (float32; checked).

Model: SmolLM2-135M-Instruct + LoRA r=8 (the ``default`` preset, calculator task), or the
tiny random model with ``--tiny`` (no package needed).

Usage::

    .venv/bin/python bench/bench_rollout.py [--threads 2] [--tasks 32] [--out bench/results/rollout.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import torch


def build(tiny: bool):
    from trajgrad.train.config import load_config
    from trajgrad.model.build import build_policy_model

    cfg = load_config(preset="tiny" if tiny else "default")
    model, tok = build_policy_model(cfg.model)
    return cfg, model, tok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=32, help="held-out tasks rolled out (one episode each)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="the tiny random model instead of SmolLM2")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "rollout.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from trajgrad.envs import get_task_source
    from trajgrad.fused import fused_token_logprobs
    from trajgrad.rollout import HFSampler, collate
    from trajgrad.rollout.collate import prefix_groups
    from trajgrad.model.learner import head_inputs

    cfg, model, tok = build(args.tiny)
    src = get_task_source(cfg.task.name, **cfg.task.options)
    tasks = src.tasks("heldout", args.tasks, seed=0)
    load_before = os.getloadavg()

    # ---------------------------------------------------------------- sampling
    times, outs = {}, {}
    variants = {"base": (False, False), "reuse": (True, False), "fast": (True, True)}  # (reuse_kv, fast_decode)
    for key, (reuse, fast) in variants.items():
        sampler = HFSampler(model, tok, temperature=0.0, max_new_tokens=cfg.sampling.max_new_tokens, reuse_kv=reuse,
                            fast_decode=fast)
        t0 = time.perf_counter()
        outs[key] = sampler.rollout(src, tasks, group_size=1, seed=0)
        times[key] = time.perf_counter() - t0
        print(f"sampling reuse_kv={reuse} fast_decode={fast}: {times[key]:.1f} s", flush=True)
    tokens = {k: [[u.action_ids for u in t.turns] for t in v] for k, v in outs.items()}
    assert tokens["reuse"] == tokens["base"], "KV reuse changed the greedy tokens"
    assert tokens["fast"] == tokens["base"], "the lean decode step changed the greedy tokens"
    trajs = outs["fast"]
    n_turns = sum(len(t.turns) for t in trajs)
    n_act = sum(t.num_action_tokens for t in trajs)

    # ---------------------------------------------------------------- learner
    batch = collate(trajs, tok.pad_token_id)
    mbs = [list(range(i, min(i + args.micro_batch, len(batch)))) for i in range(0, len(batch), args.micro_batch)]
    groups = [prefix_groups(batch.input_ids[i], batch.attention_mask[i], per_group=False) for i in mbs]
    prefix = [g.length if g is not None else 0 for g in groups]
    ltimes, lps = {}, {}
    model.train()
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        got = []
        t0 = time.perf_counter()
        for idx in mbs:
            mb = batch.select(idx)
            h, w, b = head_inputs(model, mb.input_ids, mb.attention_mask, share_prefix=share)
            lp = fused_token_logprobs(h, w, mb.input_ids[:, 1:], bias=b, mask=mb.action_mask)
            lp.sum().backward()
            got.append(lp.detach())
        ltimes[share] = time.perf_counter() - t0
        lps[share] = torch.cat([torch.nn.functional.pad(g, (0, batch.input_ids.shape[1] - 1 - g.shape[1])) for g in got])
        print(f"learner share_prefix={share}: {ltimes[share]:.1f} s", flush=True)
    dev = float((lps[True] - lps[False])[batch.action_mask].abs().max())
    assert dev < 1e-4, f"shared-prefix log-probs differ by {dev}"
    load_after = os.getloadavg()

    name = "tiny random model" if args.tiny else "SmolLM2-135M-Instruct + LoRA r=8 (default preset)"
    lines = [
        "# Multi-turn sampling with KV reuse, and the learner's shared-prefix pass",
        "",
        f"- command: `{' '.join(['.venv/bin/python', 'bench/bench_rollout.py', *sys.argv[1:]]) if argv is None else 'main()'}`",
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M:%S')}",
        f"- machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, threads {args.threads}, "
        f"load average {load_before[0]:.1f} before / {load_after[0]:.1f} after",
        f"- workload: {name}, calculator task (`{cfg.task.options}`), {len(tasks)} held-out episodes, greedy, "
        f"max_new_tokens {cfg.sampling.max_new_tokens}: {n_turns} turns, {n_act} action tokens; "
        f"learner micro-batches of {args.micro_batch}, padded length {batch.input_ids.shape[1]}, "
        f"shared prefix {min(prefix)}-{max(prefix)} tokens",
        "",
        "| stage | baseline | baseline (s) | trajgrad | trajgrad (s) | speed-up | check |",
        "|---|---|---:|---|---:|---:|---|",
        f"| sampling | full context every turn | {times['base']:.1f} | KV reuse + shared prefix | {times['reuse']:.1f} | "
        f"{times['base'] / times['reuse']:.2f}x | same greedy tokens |",
        f"| sampling | full context every turn | {times['base']:.1f} | KV reuse + shared prefix + lean decode step | "
        f"{times['fast']:.1f} | {times['base'] / times['fast']:.2f}x | same greedy tokens |",
        f"| learner fwd+bwd | plain pass | {ltimes[False]:.1f} | shared prefix once | {ltimes[True]:.1f} | "
        f"{ltimes[False] / ltimes[True]:.2f}x | log-probs within {dev:.1e} |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
