"""Benchmark: the main job's policy update, forward-only rows on against off; the head's entropy.

Two side-by-side comparisons on the main job (``trajgrad train``'s default preset: SmolLM2-135M
+ LoRA, GRPO, 8 prompts x G = 4):

1. **Forward-only rows** (``train.skip_zero_gradient_rows``). ``--steps`` training steps of the
   default preset are run and, at each, the batch, advantages and the weights and optimizer
   state before its update are kept. Each kept update is then timed ``--rounds`` times with
   the switch on and off, alternating which goes first, from the same weights and optimizer
   state (the trainer's ``policy_update``, token log on, as in training). Reported per batch:
   its zero-variance groups, the rows run forward only, the median times and their ratio,
   and the largest difference of the LoRA weights after the two updates (relative to the
   largest weight change).
2. **The entropy read off the log-prob pass** (``fused_token_logprobs(with_entropy=True)``)
   against the previous way, a second head pass (``fused_entropy`` under no_grad): SmolLM2's
   frozen head (49,152 x 576), ``--tokens`` random hidden states, forward + backward of the
   log-probs, ``--rounds`` alternating rounds; medians, ratio, largest entropy difference.

Usage::

    .venv/bin/python bench/bench_update.py --steps 4 --rounds 2 --threads 2
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _update_rows(steps: int, rounds: int):
    from trajgrad.train import presets, tokenlog, updates
    from trajgrad.train.config import build_config
    from trajgrad.train.trainer import Trainer

    d = copy.deepcopy(presets.PRESETS["default"])
    d["eval"].update({"before": False, "after": False})
    d["checkpoint"] = {"every": 0}
    d["log"] = {"tensorboard": False, "progress": False}
    tr = Trainer(build_config(d), tempfile.mkdtemp(prefix="bench_update_"), console=lambda *a: None)
    kept = []
    real = updates.prepare_policy_step

    def keep(st, *a, record=None, **k):  # the inputs of each policy update and the state before it
        kept.append((a, k, copy.deepcopy(st.model.state_dict()), copy.deepcopy(st.optimizer.state_dict())))
        return real(st, *a, record=record, **k)

    updates.prepare_policy_step = keep
    zero = []
    try:
        for _ in range(steps):
            m = tr.train_step()
            tr.step += 1
            zero.append(m["groups/zero_variance_frac"])
    finally:
        updates.prepare_policy_step = real
    st = tr.learner
    rows = []
    for i, (a, k, model0, opt0) in enumerate(kept):
        times = {True: [], False: []}
        after, frac = {}, 0.0
        for r in range(rounds):
            for skip in ((True, False) if r % 2 == 0 else (False, True)):
                st.model.load_state_dict(model0)
                st.optimizer.load_state_dict(opt0)
                st.skip_zero_gradient_rows = skip
                t0 = time.perf_counter()
                with tokenlog.recording(tr, a[0]):
                    m = updates.policy_update(st, *a[:4], **k)
                times[skip].append(time.perf_counter() - t0)
                frac = max(frac, m["update/forward_only_frac"])
                # the step's gradient (kept in .grad until the next step zeroes it)
                after[skip] = {n: p.grad.detach().clone() for n, p in st.model.named_parameters() if p.requires_grad}
        scale = max(float(g.abs().max()) for g in after[False].values())
        diff = max(float((after[True][n] - after[False][n]).abs().max()) for n in after[False])
        on, off = statistics.median(times[True]), statistics.median(times[False])
        rows.append((i + 1, zero[i], frac, off, on, off / on, diff / max(scale, 1e-30)))
    return rows


def _head_rows(tokens: int, rounds: int):
    from trajgrad.fused import fused_entropy, fused_token_logprobs
    from trajgrad.model.smollm2 import load_smollm2

    model, _ = load_smollm2(dtype=torch.float32)
    W = model.lm_head.weight.detach()
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(tokens, W.shape[1], generator=g) * 0.5
    y = torch.randint(0, W.shape[0], (tokens,), generator=g)

    def one_pass():
        h = h0.clone().requires_grad_()
        lp, ent = fused_token_logprobs(h, W, y, with_entropy=True)
        lp.sum().backward()
        return ent

    def two_passes():
        h = h0.clone().requires_grad_()
        lp = fused_token_logprobs(h, W, y)
        with torch.no_grad():
            ent = fused_entropy(h.detach(), W)
        lp.sum().backward()
        return ent

    dev = float((one_pass() - two_passes()).abs().max())
    times = {"one": [], "two": []}
    for r in range(rounds * 2):
        order = (("one", one_pass), ("two", two_passes)) if r % 2 == 0 else (("two", two_passes), ("one", one_pass))
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    one, two = statistics.median(times["one"]), statistics.median(times["two"])
    return W.shape, one, two, dev


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1100, help="action tokens of the head comparison (a main-job step has ~1,100)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "update.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    load0 = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = _update_rows(a.steps, a.rounds)
    shape, one, two, dev = _head_rows(a.tokens, a.rounds)
    load1 = os.getloadavg()
    cmd = "python bench/bench_update.py " + " ".join(sys.argv[1:] if argv is None else argv)
    tot_off, tot_on = sum(r[3] for r in rows), sum(r[4] for r in rows)
    lines = [
        "# The policy update: forward-only rows, and the entropy from the log-prob pass",
        "",
        f"Command: `{cmd}` ({started}; torch {torch.__version__}, {a.threads} threads; load average before "
        f"{load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f}, after {load1[0]:.1f}). Both comparisons side by side in one "
        "run on the same inputs, alternating which side goes first.",
        "",
        f"**Forward-only rows** (`train.skip_zero_gradient_rows`): the main job's first {a.steps} policy updates "
        "(default preset, SmolLM2-135M + LoRA, 32 rows, micro-batches of 8), each timed from the same weights and "
        f"optimizer state, median of {a.rounds} per side. 'gradients differ' is the largest difference of the "
        "LoRA gradients of the two updates, relative to the largest gradient entry (float32 rounding: the "
        "micro-batches differ; the weights after AdamW's step are not compared, since Adam divides by "
        "the root of tiny second moments and so turns rounding in near-zero gradients into visible steps).",
        "",
        "| update | zero-variance groups | rows forward only | differentiated s | forward-only on s | ratio | gradients differ |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, zv, frac, off, on, ratio, diff in rows:
        lines.append(f"| {i} | {zv:.1%} | {frac:.1%} | {off:.2f} | {on:.2f} | {ratio:.2f}x | {diff:.1e} |")
    lines += [
        f"| all | | | {tot_off:.2f} | {tot_on:.2f} | {tot_off / tot_on:.2f}x | |",
        "",
        f"**Entropy from the log-prob pass**: SmolLM2's frozen head {tuple(shape)}, {a.tokens} positions, forward + "
        f"backward of the log-probs with the entropy, median of {2 * a.rounds} per side: one pass "
        f"(`with_entropy=True`) {one:.3f} s, log-probs then `fused_entropy` {two:.3f} s: **{two / one:.2f}x**; "
        f"largest entropy difference {dev:.1e} nats (float32).",
        "",
    ]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
