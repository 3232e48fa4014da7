"""Benchmark: GAE scans against the per-timestep loop and against one elementwise pass.

For every case the same float64 inputs go through three things, timed side by side in one run:

* the **loop**: a Python loop over time, batch vectorized, the pattern of TRL's PPO trainer
  and verl's ``compute_gae_advantage_return`` (``for t in reversed(range(T))``); at
  ``mask = 0`` steps it carries the next value and the running advantage through unchanged
  (verl's multi-turn variant), at ``terminated`` steps it zeroes both, at ``truncated``
  steps it reads ``truncation_value`` (CleanRL's ``nextnonterminal`` written out). Each case
  runs the cheapest loop that has its features; the "vs plain loop" column divides the plain
  loop's time instead, the fastest loop there is;
* **trajgrad**: :func:`trajgrad.advantages.returns.gae`, :func:`~trajgrad.advantages.returns.token_skip_observation_gae`
  or :func:`~trajgrad.advantages.returns.skip_observation_gae`, input validation included;
* the **one-pass floor**: a single elementwise operation over the same ``[B, L]`` tensors,
  ``torch.addcmul(rewards, values, values)`` (a fused multiply-add) and
  ``torch.where(mask, rewards, values)``. No implementation that reads its inputs can beat it.

Results must agree with the loop to 1e-10 (asserted; max abs difference over valid steps).

Usage::

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/bench_gae.py [--threads 1] [--repeats 10]

The loop runs ``--loop-repeats`` times per case on ``B=16, L=32,768`` and once on the
131,072-step row (10-40 s a run); trajgrad and the floors run ``--repeats`` times per loop
run, interleaved with the loop runs so that a change of machine load hits both. The best
time of each is reported (``timeit``'s advice on a shared machine), with the CPU time ratio
and the page faults of a trajgrad call beside it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from trajgrad.advantages._scan import suffix_affine_scan_
from trajgrad.advantages.returns import gae, skip_observation_gae, token_skip_observation_gae

GAMMA, LAM = 1.0, 0.95
F64 = torch.float64


# ---------------------------------------------------------------- baselines (loops over time)


def loop_gae(rewards, values, gamma, lam):
    """Plain GAE: per-timestep loop, batch vectorized; bootstrap 0 after the last step."""
    length = rewards.shape[1]
    last = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    out = []
    for t in reversed(range(length)):
        next_values = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        out.append(last)
    return torch.stack(out[::-1], dim=1)


def loop_masked_gae(rewards, values, mask, gamma, lam, terminated=None, truncated=None, truncation_value=None,
                    bootstrap=None):
    """GAE loop that carries value and advantage across ``mask = 0`` steps, with optional flags.

    ``terminated`` zeroes the next value and the carry; ``truncated`` takes the next value
    from ``truncation_value`` and zeroes the carry; the value after the last valid step is
    ``bootstrap`` (0 by default). Only the operations a case needs are in its loop.
    """
    batch, length = rewards.shape
    m = mask.to(rewards.dtype)
    next_values = torch.zeros(batch, dtype=rewards.dtype) if bootstrap is None else bootstrap.clone()
    last = torch.zeros(batch, dtype=rewards.dtype)
    term = None if terminated is None else terminated.to(rewards.dtype)
    trunc = None if truncated is None else truncated.to(rewards.dtype)
    if trunc is not None and term is not None:
        trunc = trunc * (1 - term)
    out = []
    for t in reversed(range(length)):
        if term is None and trunc is None:
            delta = rewards[:, t] + gamma * next_values - values[:, t]
            candidate = delta + gamma * lam * last
        else:
            cont = 1.0
            if term is not None:
                cont = cont - term[:, t]
            if trunc is not None:
                cont = cont - trunc[:, t]
            nxt = cont * next_values
            if trunc is not None:
                nxt = nxt + trunc[:, t] * truncation_value[:, t]
            delta = rewards[:, t] + gamma * nxt - values[:, t]
            candidate = delta + gamma * lam * cont * last
        mt = m[:, t]
        next_values = values[:, t] * mt + (1 - mt) * next_values
        last = candidate * mt + (1 - mt) * last
        out.append(last * mt)
    return torch.stack(out[::-1], dim=1)


def loop_per_action(end_values, next_values, rewards, terminals, mask, gamma, lam):
    """The §20.4 listing, batch vectorized, padding entries skipped."""
    length = rewards.shape[1]
    m = mask.to(rewards.dtype)
    cont = 1.0 - terminals.to(rewards.dtype)
    last = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    out = []
    for i in reversed(range(length)):
        delta = rewards[:, i] + gamma * cont[:, i] * next_values[:, i] - end_values[:, i]
        candidate = delta + gamma * lam * cont[:, i] * last
        mi = m[:, i]
        last = candidate * mi + (1 - mi) * last
        out.append(last * mi)
    return torch.stack(out[::-1], dim=1)


# ---------------------------------------------------------------- inputs


def make_transcript(batch, length, obs_fraction, gen):
    """Rows of [prompt][action][observation][action]... with ~obs_fraction mask-0 tokens.

    Action spans are 64-1024 tokens; observation spans are sized so that the expected
    fraction of mask-0 tokens is ``obs_fraction``. Rewards sit on the last token of each
    action; values are random. Also returns the last token of every action (``[B, L]`` bool).
    """
    mask = torch.zeros(batch, length, dtype=torch.bool)
    ends = torch.zeros(batch, length, dtype=torch.bool)
    rewards = torch.zeros(batch, length, dtype=F64)
    for b in range(batch):
        pos = int(torch.randint(16, 128, (1,), generator=gen))
        while pos < length:
            act = int(torch.randint(64, 1025, (1,), generator=gen))
            end = min(pos + act, length)
            mask[b, pos:end] = True
            ends[b, end - 1] = True
            rewards[b, end - 1] = float(torch.randn(1, generator=gen, dtype=F64))
            mean_obs = act * obs_fraction / (1 - obs_fraction)
            obs = int(torch.randint(max(1, int(0.5 * mean_obs)), int(1.5 * mean_obs) + 2, (1,), generator=gen))
            pos = end + obs
    values = torch.randn(batch, length, generator=gen, dtype=F64)
    return rewards, values, mask, ends


def right_padding(batch, length, gen):
    """Each row valid up to a random length in [L/2, L]; with several rows, the first is full."""
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    if batch > 1:
        lengths[0] = length
    return torch.arange(length)[None, :] < lengths[:, None]


def episode_flags(where, rate, gen):
    """Random flags on a fraction ``rate`` of the positions allowed by ``where``."""
    return where & (torch.rand(where.shape, generator=gen) < rate)


def build_cases(batch, length, obs_fraction, gen):
    """(name, loop callable, trajgrad callable, valid mask, floor mask) for one shape."""
    r = torch.randn(batch, length, generator=gen, dtype=F64)
    v = torch.randn(batch, length, generator=gen, dtype=F64)
    tv = torch.randn(batch, length, generator=gen, dtype=F64)
    boot = torch.randn(batch, generator=gen, dtype=F64)
    full = torch.ones(batch, length, dtype=torch.bool)
    pad = right_padding(batch, length, gen)
    term = episode_flags(pad, 1 / 512, gen)
    trunc = episode_flags(pad & ~term, 1 / 1024, gen)
    kw = dict(gamma=GAMMA, lam=LAM)
    cases = [
        ("GAE", lambda: loop_gae(r, v, GAMMA, LAM), lambda: gae(r, v, **kw).advantages, full, (r, v)),
        ("GAE + mask", lambda: loop_masked_gae(r, v, pad, GAMMA, LAM),
         lambda: gae(r, v, mask=pad, **kw).advantages, pad, (r, v)),
        ("GAE + mask + terminated", lambda: loop_masked_gae(r, v, pad, GAMMA, LAM, term),
         lambda: gae(r, v, mask=pad, terminated=term, **kw).advantages, pad, (r, v)),
        ("GAE + mask + terminated + truncated + bootstrap",
         lambda: loop_masked_gae(r, v, pad, GAMMA, LAM, term, trunc, tv, boot),
         lambda: gae(r, v, mask=pad, terminated=term, truncated=trunc, truncation_value=tv, bootstrap_value=boot,
                     **kw).advantages, pad, (r, v)),
    ]
    tr, tvv, tmask, ends = make_transcript(batch, length, obs_fraction, gen)
    tterm = episode_flags(ends, 1 / 16, gen)
    ttrunc = episode_flags(ends & ~tterm, 1 / 16, gen)
    cases += [
        ("token skip-observation GAE", lambda: loop_masked_gae(tr, tvv, tmask, GAMMA, LAM),
         lambda: token_skip_observation_gae(tvv, tr, tmask, **kw).advantages, tmask, (tr, tvv)),
        ("token skip-observation GAE + terminated + truncated + bootstrap",
         lambda: loop_masked_gae(tr, tvv, tmask, GAMMA, LAM, tterm, ttrunc, tv, boot),
         lambda: token_skip_observation_gae(tvv, tr, tmask, terminated=tterm, truncated=ttrunc, truncation_value=tv,
                                            bootstrap_value=boot, **kw).advantages, tmask, (tr, tvv)),
    ]
    nv = torch.randn(batch, length, generator=gen, dtype=F64)
    aterm = episode_flags(pad, 1 / 16, gen)
    cases.append(
        ("skip-observation GAE per action (terminals + mask)",
         lambda: loop_per_action(v, nv, r, aterm, pad, GAMMA, LAM),
         lambda: skip_observation_gae(v, nv, r, aterm, GAMMA, LAM, mask=pad), pad, (r, v)),
    )
    return cases


# ---------------------------------------------------------------- timing


def scan_alone(batch, length, repeats, gen):
    """Best wall time of the in-place scan by itself, one number and a tensor as coefficient
    (values in {gamma*lam, 0, 1}: carry, stop, padding, as for a flagged transcript), and of one
    FMA pass over the same shape. The copies that refill the scan's inputs are not timed."""
    d0 = torch.randn(batch, length, generator=gen, dtype=F64)
    u = torch.rand(batch, length, generator=gen)
    c0 = torch.where(u < 0.3, 1.0, torch.where(u < 0.31, 0.0, GAMMA * LAM)).to(F64)
    d, c = d0.clone(), c0.clone()
    number, tensor, fma = [], [], []
    for _ in range(repeats):
        d.copy_(d0)
        number.append(once(lambda: suffix_affine_scan_(d, GAMMA * LAM))[0])
        d.copy_(d0)
        c.copy_(c0)
        tensor.append(once(lambda: suffix_affine_scan_(d, c))[0])
        fma.append(once(lambda: torch.addcmul(d0, c0, c0))[0])
    return min(number), min(tensor), min(fma)



def once(fn):
    """(wall seconds, CPU seconds of this process, result, minor page faults) of one call."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu, start = time.process_time(), time.perf_counter()
    result = fn()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall, cpu, result, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--repeats", type=int, default=10, help="timed trajgrad / floor runs per loop run")
    parser.add_argument("--loop-repeats", type=int, default=2, help="loop runs per case at B=16 (1 at B=1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--obs-fraction", type=float, default=0.3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "gae.md")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test (writes nothing)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    shapes = [(16, 32_768), (1, 131_072)] if not args.quick else [(4, 2_048), (1, 4_096)]

    small = torch.randn(2, 256, dtype=F64)  # warm-up (allocator, dispatcher)
    gae(small, small, gamma=GAMMA, lam=LAM, mask=small > 0, terminated=small > 2)
    token_skip_observation_gae(small, small, small > 0, gamma=GAMMA, lam=LAM)

    load_before = os.getloadavg()
    rows = []
    worst = 0.0
    for batch, length in shapes:
        cases = build_cases(batch, length, args.obs_fraction, gen)
        loop_runs = args.loop_repeats if batch > 1 else 1
        plain_loop_s = plain_loop_c = None
        for name, loop_fn, ours_fn, valid, (r, v) in cases:
            floor_mask = valid.clone()
            loop_t, ours_t, fma_t, where_t, loop_c, ours_c, ours_f = [], [], [], [], [], [], []
            base = ours = None
            ours_fn()  # warm-up at this size
            for _ in range(loop_runs):
                dt, dc, base, _ = once(loop_fn)
                loop_t.append(dt)
                loop_c.append(dc)
                for _ in range(args.repeats):
                    ours = None  # the previous result is consumed and dropped, as in a training step
                    dt, dc, ours, df = once(ours_fn)
                    ours_t.append(dt)
                    ours_c.append(dc)
                    ours_f.append(df)
                    fma_t.append(once(lambda: torch.addcmul(r, v, v))[0])
                    where_t.append(once(lambda: torch.where(floor_mask, r, v))[0])
            err = float((base - ours)[valid].abs().max())
            worst = max(worst, err)
            assert err <= 1e-10, f"{name} B={batch} L={length}: max |diff| {err:.3g} > 1e-10"
            assert bool(torch.all(ours[~valid] == 0)), f"{name}: masked steps must be 0"
            best, med = min, statistics.median
            loop_s, ours_s, fma_s, where_s = best(loop_t), best(ours_t), best(fma_t), best(where_t)
            cpu_ratio = best(loop_c) / best(ours_c)
            if plain_loop_s is None:
                plain_loop_s, plain_loop_c = loop_s, best(loop_c)
            obs = 1.0 - float(valid.float().mean())
            faults = med(ours_f)
            rows.append((name, batch, length, obs, loop_s, ours_s, cpu_ratio, fma_s, where_s, plain_loop_s, faults,
                         err, plain_loop_c / best(ours_c)))
            print(f"{name:<66} B={batch:<3} L={length:<7} loop {loop_s:7.3f} s  ours {1e3 * ours_s:7.2f} ms  "
                  f"{loop_s / ours_s:6.0f}x loop (CPU time {cpu_ratio:6.0f}x)  {ours_s / fma_s:5.1f}x FMA  "
                  f"{ours_s / where_s:5.1f}x where  faults {faults:.0f}  diff {err:.1e}", flush=True)
    scans = [(batch, length) + scan_alone(batch, length, 5 * args.repeats, gen) for batch, length in shapes]
    load_after = os.getloadavg()

    header = ("| case | B | L | mask-0 fraction | loop (s) | trajgrad (ms) | speed-up vs loop | same, CPU time "
              "| vs plain loop | same, CPU time | one FMA pass (ms) | one where pass (ms) | trajgrad / FMA pass "
              "| trajgrad / where pass "
              "| page faults per call | max abs diff |")
    sep = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    lines = [header, sep]
    for name, batch, length, obs, loop_s, ours_s, cpu_ratio, fma_s, where_s, plain_s, faults, err, plain_c in rows:
        lines.append(
            f"| {name} | {batch} | {length:,} | {obs:.2f} | {loop_s:.2f} | {1e3 * ours_s:.2f} | "
            f"{loop_s / ours_s:.0f}x | {cpu_ratio:.0f}x | {plain_s / ours_s:.0f}x | {plain_c:.0f}x | "
            f"{1e3 * fma_s:.3f} | "
            f"{1e3 * where_s:.3f} | {ours_s / fma_s:.1f}x | {ours_s / where_s:.1f}x | {faults:.0f} | {err:.1e} |"
        )
    table = "\n".join(lines)
    print(table)
    scan_lines = ["| B | L | scan, number coefficient (ms) | scan, tensor coefficient (ms) | one FMA pass (ms) | "
                  "number scan / FMA pass | tensor scan / FMA pass |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for batch, length, number_s, tensor_s, fma_s in scans:
        scan_lines.append(f"| {batch} | {length:,} | {1e3 * number_s:.2f} | {1e3 * tensor_s:.2f} | {1e3 * fma_s:.3f} | "
                          f"{number_s / fma_s:.1f}x | {tensor_s / fma_s:.1f}x |")
    scan_table = "\n".join(scan_lines)
    print(scan_table)

    command = " ".join(["OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python", "bench/bench_gae.py", *sys.argv[1:]])
    if argv is not None:
        command = f"bench_gae.main({argv!r})"
    meta = [
        "# GAE benchmark: one scan vs the per-timestep loop and vs one elementwise pass",
        "",
        f"- command: `{command}`",
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M:%S')}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} logical CPUs",
        f"- torch intra-op threads: {torch.get_num_threads()}",
        f"- load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f} "
        "(the machine is shared; other jobs may have been running)",
        f"- float64, gamma = {GAMMA}, lambda = {LAM}, seed {args.seed}; best of {args.loop_repeats} loop runs "
        f"(1 on the 131,072-step row) and of {args.repeats} trajgrad / floor runs per loop run, interleaved "
        "(the best time is the one least disturbed by the other jobs on the machine, as `timeit` advises); "
        "wall-clock times, and the speed-up also in CPU time of the process (insensitive to time spent "
        "descheduled); 'page faults per call': the median number of minor page faults during one trajgrad "
        "call (first touches of output memory the allocator took fresh from the system)",
        "- loop: Python loop over time, batch vectorized (the TRL / verl pattern), carrying value and advantage "
        "across mask-0 steps; each case runs the cheapest loop with its features ('vs plain loop': the plain "
        "GAE loop of the same shape instead)",
        "- trajgrad: one backward affine scan per call (per-step coefficient from the flags), "
        "input validation included",
        "- one-pass floor: `torch.addcmul(rewards, values, values)` and `torch.where(mask, rewards, values)` "
        "over the same `[B, L]` float64 tensors",
        f"- every result agrees with its loop to 1e-10 (asserted); largest difference {worst:.1e}",
        "- masks: right padding to a random length in [L/2, L] (GAE, per action); a transcript of 64-1024-token "
        f"actions and observation spans, {args.obs_fraction:.0%} mask-0 tokens (token level); terminations every "
        "~512 valid steps (every ~16 actions at token level and per action), truncations ~1/1024",
        "",
        table,
        "",
        "Reading the table. 'trajgrad / FMA pass' counts how many single elementwise passes over the same "
        "`[B, L]` tensors one call costs. A call is one in-place backward scan (log depth; every level "
        "halves the work; with one number as coefficient, i.e. no flags and at most right padding, the "
        "coefficient products are numbers too, about half the cost of a coefficient tensor) plus a fixed "
        "handful of passes: the offset, the read-off of advantages and returns, and the selection that "
        "removes padding contents (a bitwise AND with the mask, or one tail fill per row for right "
        "padding). Flags only change the per-step coefficient of the one scan (built from the flags read "
        "as bytes: padding + gamma*lam * carry); truncation values are selected (`torch.where`) into the "
        "offset and bootstrap values read by index. Finiteness of the valid inputs is checked by one "
        "reduction over the offset (every valid input enters it; the per-input check runs only when it is "
        "not finite, to name the input).",
        "",
        "The scan by itself (`trajgrad.advantages._scan.suffix_affine_scan_` on the same shapes, in place, its input "
        "copies untimed; a tensor coefficient with values in {gamma*lam, 0, 1}, i.e. carry, stop and padding, "
        "as the flagged cases use; best of "
        f"{5 * args.repeats}), against one FMA pass over the same shape:",
        "",
        scan_table,
        "",
        "Memory: the two outputs share one `[2, B, L]` block. Where the C allocator hands each call fresh "
        "pages from the system (it depends on the process's allocation history), every call also pays "
        "about 2,000 minor page faults per 8 MB of output, some 2.5 us each on this virtual machine; "
        "the 'page faults per call' column shows whether a run paid them.",
        "",
    ]
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(meta))
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
