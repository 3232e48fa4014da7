"""Peak memory and time: exact reverse/forward-KL distillation and target log-probs from hidden
states, fused (chunked, trajgrad.fused) against the naive full-logit PyTorch path.

Every (what, V, L, method) configuration runs in its own subprocess, one at a time. The
subprocess builds its float32 inputs (student and teacher hidden states ``[1, L, H]``,
heads ``[V, H]``, H = 576 by default, SmolLM2-135M's width), runs a small warm-up, resets the kernel's peak-RSS counter
(``/proc/self/clear_refs``), records its baseline RSS, runs forward + backward once
(memory and time), then again ``--repeats - 1`` times (time only; the minimum is reported).
Net peak = peak RSS - baseline. Results (loss values, token log-probs, gradient samples) are
compared across methods: values must agree to 1e-5 relative.

The fused side runs with ``--chunk auto`` (and, for log-probs, ``--vocab-chunk auto``) by
default, i.e. what a user who sets nothing gets (:mod:`trajgrad.fused.chunking`: tiles of
positions x vocabulary columns for a trainable head); what it resolved to is reported.

Usage (not part of the test suite; the naive V=151936, L=2048 KL case peaks at ~8 GB RSS)::

    python bench/bench_distill.py                      # the default configuration, writes bench/results/distill.md
    python bench/bench_distill.py --vocab 32768 --length 1024 --what kl --chunk 128,auto --out /tmp/x.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

H = 576
VCHUNK = "auto"   # the fused log-probs' vocab_chunk_size (--vocab-chunk)
VCHUNK_ARG = "auto"


# ---------------------------------------------------------------------------------------
# worker (runs in a subprocess)
# ---------------------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _cpu_s() -> float:
    """User + system CPU seconds of this process (all threads)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _inputs(torch, what, V, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(1, L, H, generator=g)
    ws = torch.randn(V, H, generator=g) / H ** 0.5 * 2.0
    if what in ("kl", "fkl"):
        ht = torch.randn(1, L, H, generator=g)
        wt = torch.randn(V, H, generator=g) / H ** 0.5 * 2.0
        return hs, ws, ht, wt
    y = torch.randint(0, V, (1, L), generator=g)
    return hs, ws, y


def _naive_kl(torch, hs, ws, ht, wt, mask, chunk):
    with torch.no_grad():
        lt = torch.log_softmax(ht @ wt.T, -1)
    ls = torch.log_softmax(hs @ ws.T, -1)
    kl = (ls.exp() * (ls - lt)).sum(-1)
    loss = kl[mask].mean()
    loss.backward()
    return loss.detach(), None


def _fused_kl(torch, hs, ws, ht, wt, mask, chunk):
    from trajgrad.losses.distill import reverse_kl_distill_loss

    res = reverse_kl_distill_loss(student_hidden=hs, student_weight=ws, teacher_hidden=ht, teacher_weight=wt,
                                  mask=mask, chunk_size=chunk)
    res.loss.backward()
    return res.loss.detach(), None


def _naive_fkl(torch, hs, ws, ht, wt, mask, chunk):
    with torch.no_grad():
        lt = torch.log_softmax(ht @ wt.T, -1)
    ls = torch.log_softmax(hs @ ws.T, -1)
    kl = (lt.exp() * (lt - ls)).sum(-1)
    loss = kl[mask].mean()
    loss.backward()
    return loss.detach(), None


def _fused_fkl(torch, hs, ws, ht, wt, mask, chunk):
    from trajgrad.losses.distill import forward_kl_distill_loss

    res = forward_kl_distill_loss(student_hidden=hs, student_weight=ws, teacher_hidden=ht, teacher_weight=wt,
                                  mask=mask, chunk_size=chunk)
    res.loss.backward()
    return res.loss.detach(), None


def _naive_lp(torch, hs, ws, y, mask, chunk):
    lp = torch.log_softmax(hs @ ws.T, -1).gather(-1, y[..., None]).squeeze(-1)
    (lp.sum() / lp.numel()).backward()
    return lp.detach().sum(), lp.detach()


def _fused_lp(torch, hs, ws, y, mask, chunk):
    from trajgrad.fused import fused_token_logprobs

    lp = fused_token_logprobs(hs, ws, y, chunk_size=chunk, mask=mask, vocab_chunk_size=VCHUNK)
    (lp.sum() / lp.numel()).backward()
    return lp.detach().sum(), lp.detach()


FNS = {("kl", "naive"): _naive_kl, ("kl", "fused"): _fused_kl, ("fkl", "naive"): _naive_fkl,
       ("fkl", "fused"): _fused_fkl, ("lp", "naive"): _naive_lp,
       ("lp", "fused"): _fused_lp, ("lpf", "naive"): _naive_lp, ("lpf", "fused"): _fused_lp}


def _trainable(what):
    """Indices of the inputs that require grad: student hidden and head; lpf = frozen head."""
    return (0,) if what == "lpf" else (0, 1)


KINDS = {"kl": "reverse_kl", "fkl": "forward_kl", "lp": "logprob", "lpf": "logprob"}


def _chunk_arg(chunk: str):
    return chunk if chunk == "auto" else int(chunk)


def _vchunk_arg(vchunk: str):
    return {"auto": "auto", "none": None}.get(vchunk) if vchunk in ("auto", "none") else int(vchunk)


def _resolved(what: str, V: int, chunk, vchunk) -> str:
    """What the fused side ran: positions per chunk, and ``x columns`` for vocabulary blocks."""
    from trajgrad.fused.chunking import resolve_chunk_size, resolve_tiles

    if KINDS[what] != "logprob":
        return str(resolve_chunk_size(chunk, V, KINDS[what], __import__("torch").float32))
    rows, block = resolve_tiles(chunk, vchunk, V, "logprob", __import__("torch").float32, what == "lp")
    return str(rows) if block >= V else f"{rows} x {block}"


def worker(args) -> None:
    import torch

    from trajgrad.fused.chunking import get_chunk_budget

    global VCHUNK
    VCHUNK = _vchunk_arg(args.vocab_chunk)

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    fn = FNS[(args.what, args.method)]
    # warm-up on a short sequence (thread pools, allocator, kernels)
    small = _inputs(torch, args.what, args.vocab, 64, seed=1)
    small = [t.requires_grad_() if i in _trainable(args.what) else t for i, t in enumerate(small)]
    fn(torch, *small, torch.ones(1, 64, dtype=torch.bool), args.chunk)
    del small
    inputs = _inputs(torch, args.what, args.vocab, args.length)
    inputs = [t.requires_grad_() if i in _trainable(args.what) else t for i, t in enumerate(inputs)]
    mask = torch.ones(1, args.length, dtype=torch.bool)
    reset_ok = _reset_peak()
    base_rss = _status_kb("VmRSS")
    base_hwm = _status_kb("VmHWM")
    load = os.getloadavg()[0]
    c0, t0 = _cpu_s(), time.perf_counter()
    value, per_token = fn(torch, *inputs, mask, args.chunk)
    t1, c1 = time.perf_counter(), _cpu_s()
    peak = _status_kb("VmHWM")
    times = [t1 - t0]
    cpus = [c1 - c0]
    hs, ws = inputs[0], inputs[1]
    grad_h = hs.grad.detach().clone()
    grad_w_rows = ws.grad[:: max(1, args.vocab // 256)].detach().clone() if ws.grad is not None else None
    for _ in range(args.repeats - 1):
        hs.grad = None
        ws.grad = None
        c0, t0 = _cpu_s(), time.perf_counter()
        fn(torch, *inputs, mask, args.chunk)
        times.append(time.perf_counter() - t0)
        cpus.append(_cpu_s() - c0)
    torch.save({"value": value, "per_token": per_token, "grad_h": grad_h, "grad_w_rows": grad_w_rows},
               args.tensors)
    resolved = _resolved(args.what, args.vocab, args.chunk, VCHUNK) if args.method == "fused" else args.chunk
    print(json.dumps({
        "chunk": resolved, "budget_mib": get_chunk_budget() / 2 ** 20, "time_s": min(times), "times_s": times, "cpu_s": min(cpus), "cpus_s": cpus, "load": load, "peak_kb": peak, "base_rss_kb": base_rss,
        "base_hwm_kb": base_hwm, "hwm_reset": reset_ok, "value": float(value),
        "threads": torch.get_num_threads(),
    }))


# ---------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------


def _mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2 ** 20
    return float("nan")


def _naive_estimate_gb(what: str, V: int, L: int) -> float:  # generous upper bounds
    per = V * L * 4 / 2 ** 30
    return (6 if what in ("kl", "fkl") else 4) * per + 2 * V * H * 4 / 2 ** 30


def _run_one(what, method, V, L, chunk, repeats, threads, tmpdir):
    tensors = os.path.join(tmpdir, f"{what}_{method}_{V}_{L}.pt")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--what", what, "--method", method,
           "--vocab", str(V), "--length", str(L), "--chunk", str(chunk), "--repeats", str(repeats),
           "--tensors", tensors, "--hidden", str(H), "--vocab-chunk", VCHUNK_ARG]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"], "rc": proc.returncode}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["tensors"] = tensors
    return out


def _compare(torch, a_path, b_path):
    a, b = torch.load(a_path), torch.load(b_path)
    rel = lambda x, y: float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))  # noqa: E731
    out = {"value_rel": float(abs(a["value"] - b["value"]) / max(abs(float(b["value"])), 1e-30)),
           "grad_h_rel": rel(a["grad_h"], b["grad_h"]),
           "grad_w_rel": rel(a["grad_w_rows"], b["grad_w_rows"]) if b["grad_w_rows"] is not None else float("nan")}
    if a["per_token"] is not None:
        x, y = a["per_token"], b["per_token"]
        out["per_token_rel"] = float(((x - y).abs() / y.abs().clamp_min(1e-30)).max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tensors", help=argparse.SUPPRESS)
    ap.add_argument("--method", choices=["naive", "fused"], help=argparse.SUPPRESS)
    ap.add_argument("--what", default="kl,fkl,lp,lpf",
                    help="comma list of: kl (reverse KL), fkl (forward KL), lp (token log-probs), "
                         "lpf (log-probs, frozen head)")
    ap.add_argument("--vocab", default="151936", help="comma list of vocabulary sizes")
    ap.add_argument("--length", default="2048", help="comma list of sequence lengths")
    ap.add_argument("--hidden", type=int, default=576, help="hidden size H")
    ap.add_argument("--chunk", default="auto",
                    help="fused chunk_size: 'auto' (the default of the library) or positions; a comma list runs each")
    ap.add_argument("--vocab-chunk", default="auto",
                    help="the fused log-probs' vocab_chunk_size: 'auto' (the default of the library: tiles for a "
                         "trainable head), 'none' (the whole vocabulary) or columns")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per configuration (min reported)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--reserve-gb", type=float, default=3.0,
                    help="skip a naive run unless MemAvailable exceeds its estimate by this much")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "distill.md"))
    args = ap.parse_args()
    global H, VCHUNK_ARG
    H = args.hidden
    _vchunk_arg(args.vocab_chunk)
    VCHUNK_ARG = args.vocab_chunk
    if args.worker:
        args.vocab, args.length, args.chunk = int(args.vocab), int(args.length), _chunk_arg(args.chunk)
        worker(args)
        return

    import torch
    from tqdm import tqdm

    whats = [w for w in args.what.split(",") if w]
    vocabs = [int(v) for v in args.vocab.split(",")]
    lengths = [int(v) for v in args.length.split(",")]
    chunks = [c.strip() for c in args.chunk.split(",") if c.strip()]
    for c in chunks:
        _chunk_arg(c)
    plan = [(w, V, L) for w in whats for V in vocabs for L in lengths]
    rows = []
    started = datetime.datetime.now()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        bar = tqdm(total=len(plan) * (1 + len(chunks)), desc="bench", unit="run")
        for what, V, L in plan:
            need = _naive_estimate_gb(what, V, L)
            avail = _mem_available_gb()
            bar.set_postfix_str(f"{what} V={V} L={L} naive")
            if avail < need + args.reserve_gb:
                naive = {"error": [f"skipped: needs ~{need:.1f} GB, {avail:.1f} GB available"]}
            else:
                naive = _run_one(what, "naive", V, L, 0, args.repeats, args.threads, tmp)
            bar.update(1)
            for chunk in chunks:
                bar.set_postfix_str(f"{what} V={V} L={L} fused chunk={chunk}")
                fused = _run_one(what, "fused", V, L, chunk, args.repeats, args.threads, tmp)
                bar.update(1)
                cmp = {}
                if "error" not in naive and "error" not in fused:
                    cmp = _compare(torch, fused["tensors"], naive["tensors"])
                rows.append({"what": what, "V": V, "L": L, "chunk": chunk, "naive": naive, "fused": fused,
                             "cmp": cmp})
                tqdm.write(json.dumps({k: v for k, v in rows[-1].items()}, default=str))
        bar.close()
    load_after = os.getloadavg()
    _write(args, rows, started, load_before, load_after)


def _gb(kb):
    return kb / 2 ** 20


def _write(args, rows, started, load_before, load_after) -> None:
    import torch

    env = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "TRAJGRAD_CHUNK_BUDGET_MIB") if k in os.environ)
    cmd = (env + " " if env else "") + "PYTHONPATH=src python bench/bench_distill.py " + " ".join(sys.argv[1:])
    threads = rows[0]["fused"].get("threads", torch.get_num_threads()) if rows else torch.get_num_threads()
    lines = [
        "# Exact distillation and target log-probs from hidden states: fused vs naive",
        "",
        f"- command: `{cmd.strip()}`",
        f"- date: {started:%Y-%m-%d %H:%M}; torch {torch.__version__}; threads {threads}; "
        f"CPU cores visible {os.cpu_count()}; {platform.machine()}",
        f"- load average (1/5/15 min) before: {' / '.join(f'{x:.1f}' for x in load_before)}, "
        f"after: {' / '.join(f'{x:.1f}' for x in load_after)} (the machine is shared; times are noisy)",
        f"- float32, H = {H}, B = 1, all positions valid; forward + backward; wall and CPU (user + system, "
        f"all threads) time = min over {args.repeats} run(s) in the same process after a warm-up; the "
        "1-minute load average when the measured run started is shown (2 cores; above 2 the run shared "
        "them with other work, which inflates wall time more than CPU time); memory = peak RSS (VmHWM) of a separate "
        "subprocess per configuration, raw and net of the baseline measured after imports and input allocation",
        "- naive KL: `lt = log_softmax(ht @ Wt.T)` (no grad), `ls = log_softmax(hs @ Ws.T)`, "
        "`((ls.exp() * (ls - lt)).sum(-1)).mean()`; fused KL: `reverse_kl_distill_loss(student_hidden=..., "
        "teacher_hidden=...)`",
        "- naive forward KL: the same with `((lt.exp() * (lt - ls)).sum(-1)).mean()`; fused: "
        "`forward_kl_distill_loss(...)`",
        "- naive log-probs: `log_softmax(hs @ W.T).gather(-1, y)`; fused: `fused_token_logprobs`",
        "- chunk: `auto` is the library default (`chunk_size=\"auto\"`, budget "
        f"{rows[0]['fused'].get('budget_mib', float('nan')) if rows else float('nan'):.0f} MiB of [chunk, V] "
        "temporaries, trajgrad.fused.chunking; for log-probs with a trainable head `vocab_chunk_size=\"auto\"` "
        "makes tiles of positions x 2,048 vocabulary columns within 4 MiB); what it resolved to is in "
        f"parentheses (`P x C` for tiles); log-probs' vocab_chunk_size: `{VCHUNK_ARG}`",
        "- two memory ratios: 'net memory ratio, incl. head grad' = naive net peak / fused net peak, each "
        "including everything the process allocated (the ratio the targets refer to); 'excl. head grad' = the "
        "same with the [V, H] float32 head-weight gradient "
        f"({_gb(4 * H * (rows[0]['V'] if rows else 0) / 1024):.2f} GB here) subtracted from both peaks: both paths "
        "must allocate it (it is the result), so it bounds the first ratio when the head is trainable",
        "- agree: relative difference of the loss / per-token log-probs (must be <= 1e-5), and of the "
        "hidden-state and head-weight gradients (max-abs difference over max-abs value)",
        "",
    ]
    for what, title in (("kl", "Reverse KL, student + teacher heads"),
                        ("fkl", "Forward KL, student + teacher heads"), ("lp", "Target log-probs"),
                        ("lpf", "Target log-probs, frozen head (gradient w.r.t. hidden states only)")):
        sel = [r for r in rows if r["what"] == what]
        if not sel:
            continue
        lines += [f"## {title}", "",
                  "| V | L | chunk | naive wall s | fused wall s | wall ratio | naive CPU s | fused CPU s | CPU ratio | "
                  "load 1m (naive / fused) | naive peak GB raw / net | fused peak GB raw / net | net memory ratio, incl. head "
                  "grad | net memory ratio, excl. head grad | value rel diff | grad rel diff (h / W) |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                  "| ---: | ---: |"]
        for r in sel:
            n, f, c = r["naive"], r["fused"], r["cmp"]

            def cell_time(x):
                return f"{x['time_s']:.2f}" if "time_s" in x else "; ".join(x.get("error", ["?"]))

            def cell_mem(x):
                if "peak_kb" not in x:
                    return "-"
                return f"{_gb(x['peak_kb']):.2f} / {_gb(x['peak_kb'] - x['base_rss_kb']):.2f}"

            ratio_t = f"{f['time_s'] / n['time_s']:.2f}x" if "time_s" in n and "time_s" in f else "-"
            cpu_n = f"{n['cpu_s']:.1f}" if "cpu_s" in n else "-"
            cpu_f = f"{f['cpu_s']:.1f}" if "cpu_s" in f else "-"
            ratio_c = f"{f['cpu_s'] / n['cpu_s']:.2f}x" if "cpu_s" in n and "cpu_s" in f else "-"
            load = f"{n.get('load', float('nan')):.1f} / {f.get('load', float('nan')):.1f}"
            ratio_m = ratio_g = "-"
            if "peak_kb" in n and "peak_kb" in f:
                net_n, net_f = n["peak_kb"] - n["base_rss_kb"], f["peak_kb"] - f["base_rss_kb"]
                ratio_m = f"{net_n / max(1, net_f):.1f}x lower"
                if what != "lpf":
                    g_kb = 4 * H * r["V"] / 1024
                    ratio_g = f"{(net_n - g_kb) / (net_f - g_kb):.1f}x lower" if net_f - g_kb > 1024 else "-"
            val = "-"
            if c:
                v = c.get("per_token_rel", c["value_rel"]) if what not in ("kl", "fkl") else c["value_rel"]
                val = f"{v:.1e} {'ok' if v <= 1e-5 else 'FAIL'}"
            grad = f"{c['grad_h_rel']:.1e} / {c['grad_w_rel']:.1e}" if c else "-"
            chunk = f"auto ({f.get('chunk', '?')})" if r["chunk"] == "auto" else r["chunk"]
            lines.append(f"| {r['V']} | {r['L']} | {chunk} | {cell_time(n)} | {cell_time(f)} | {ratio_t} | "
                         f"{cpu_n} | {cpu_f} | {ratio_c} | {load} | "
                         f"{cell_mem(n)} | {cell_mem(f)} | {ratio_m} | {ratio_g} | {val} | {grad} |")
        lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
