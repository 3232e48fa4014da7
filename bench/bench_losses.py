"""Forward+backward cost per token of each policy loss at B=64, L=4,096 (float32, CPU).

Baseline: the spec's minimal code for the same estimator (e.g. §8's four-line PPO clip,
§20.2's ``sao_policy_loss``), which has no input validation, multiplies by the mask instead
of selecting, and computes no metrics. The trajgrad column includes validation (shape, 0/1
mask, finiteness at valid positions) and the detached metrics every loss returns; the
third column runs trajgrad with value validation off (``trajgrad.validation(False)``).
Both sides get the same inputs in one run, interleaved round by round, and their values are
checked to agree. One intra-op thread, timed by the thread's CPU clock (``time.thread_time``):
on a shared machine wall-clock times include whole scheduler slices (~10 ms) spent in other
processes, which CPU time does not.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_losses.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import trajgrad
from trajgrad import losses

B, L = 64, 4096


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g) * 3
    old = logp + 0.1 * torch.randn(B, L, generator=g)
    adv = torch.randn(B, generator=g)[:, None].expand(B, L).contiguous()
    lengths = torch.randint(L // 4, L + 1, (B,), generator=g)
    mask = (torch.arange(L)[None] < lengths[:, None]).float()
    return logp, old, adv, mask


def naive_ppo(logp, old, adv, mask):
    ratio = torch.exp(logp - old)
    s = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    return -(s * mask).sum() / mask.sum()


def naive_reinforce(logp, old, adv, mask):
    return -(logp * adv * mask).sum() / mask.sum()


def naive_gspo(logp, old, adv, mask):
    n = mask.sum(-1).clamp_min(1)
    s = torch.exp(((logp - old) * mask).sum(-1) / n)
    a = adv[:, 0]
    return -torch.minimum(s * a, s.clamp(1 - 3e-4, 1 + 4e-4) * a).mean()


def naive_gspo_token(logp, old, adv, mask):
    n = mask.sum(-1).clamp_min(1)
    s = torch.exp(((logp - old) * mask).sum(-1) / n).detach()
    r = s[:, None] * torch.exp(logp - logp.detach())
    x = torch.minimum(r * adv, r.clamp(1 - 3e-4, 1 + 4e-4) * adv)
    return -((x * mask).sum(-1) / n).mean()


def naive_sapo(logp, old, adv, mask):
    r = torch.exp(logp - old)
    tau = torch.where(adv > 0, torch.full_like(adv, 1.0), torch.full_like(adv, 1.05))
    f = 4 / tau * torch.sigmoid(tau * (r - 1))
    n = mask.sum(-1).clamp_min(1)
    return -(((f * adv) * mask).sum(-1) / n).mean()


def naive_sao(logp, old, adv, mask):
    ratio = torch.exp(logp - old)
    trusted = (ratio > 0.7) & (ratio < 6.0)
    w = (ratio * trusted).detach()
    return -(w * adv * logp * mask).sum() / mask.sum().clamp_min(1)


def naive_cispo(logp, old, adv, mask):
    w = torch.exp(logp - old).clamp(max=1.28).detach()
    return -(w * adv * logp * mask).sum() / mask.sum()


def naive_gmpo(logp, old, adv, mask):
    z = logp - old
    sgn = torch.sign(adv)
    zt = sgn * torch.minimum(sgn * z, sgn * z.clamp(-0.4, 0.4))
    n = mask.sum(-1).clamp_min(1)
    s = torch.exp((zt * mask).sum(-1) / n)
    return -(adv[:, 0] * s).mean()


def naive_dppo_tv(logp, old, adv, mask):
    r = torch.exp(logp - old).detach()
    d = torch.exp(logp) - torch.exp(old)
    keep = torch.where(adv > 0, d <= 0.1, d >= -0.1).detach()
    return -(adv * r * logp * keep * mask).sum() / mask.sum()


def naive_dppo_kl(logp, old, adv, mask):
    r = torch.exp(logp - old).detach()
    p, q = torch.exp(logp), torch.exp(old)
    kl = q * (old - logp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    keep = torch.where(adv > 0, (kl <= 0.05) | (p <= q), (kl <= 0.05) | (p >= q)).detach()
    return -(adv * r * logp * keep * mask).sum() / mask.sum()


def _cov(logp, adv, mask):
    n = mask.sum()
    return ((logp - (logp * mask).sum() / n) * (adv - (adv * mask).sum() / n)).detach()


def naive_clip_cov(logp, old, adv, mask):
    ratio = torch.exp(logp - old)
    s1, s2 = ratio * adv, ratio.clamp(0.8, 1.2) * adv
    s = torch.minimum(s1, s2)
    cov = _cov(logp, adv, mask)
    cand = ((cov > 1.0) & (cov < 5.0) & (mask > 0) & (s1 <= s2)).nonzero()
    k = max(1, int(2e-4 * mask.sum().item()))
    pick = cand[torch.randperm(len(cand), generator=torch.Generator().manual_seed(0))[:k]]
    sel = torch.zeros_like(logp)
    sel[pick[:, 0], pick[:, 1]] = 1.0
    return -((s * (1 - sel) + s.detach() * sel) * mask).sum() / mask.sum()


def naive_kl_cov(logp, old, adv, mask):
    z = logp - old
    cov = torch.where(mask > 0, _cov(logp, adv, mask), torch.full_like(logp, -float("inf")))
    k = int(2e-3 * mask.sum().item())
    sel = torch.zeros_like(logp).view(-1)
    sel[torch.topk(cov.view(-1), k).indices] = 1.0
    term = -torch.exp(z) * adv + z.abs() * sel.view_as(z)
    return (term * mask).sum() / mask.sum()


CASES = [
    ("reinforce", naive_reinforce, lambda lp, o, a, m: losses.reinforce_loss(lp, a, m).loss),
    ("ppo_clip", naive_ppo, lambda lp, o, a, m: losses.ppo_clip_loss(lp, o, a, m, eps_low=0.2).loss),
    ("gspo", naive_gspo, lambda lp, o, a, m: losses.gspo_loss(lp, o, a[:, 0], m).loss),
    ("gspo_token", naive_gspo_token, lambda lp, o, a, m: losses.gspo_token_loss(lp, o, a, m).loss),
    ("sapo", naive_sapo, lambda lp, o, a, m: losses.sapo_loss(lp, o, a, m).loss),
    ("sao_dis", naive_sao, lambda lp, o, a, m: losses.sao_dis_loss(lp, o, a, m).loss),
    ("cispo", naive_cispo, lambda lp, o, a, m: losses.cispo_loss(lp, o, a, m).loss),
    ("gmpo", naive_gmpo, lambda lp, o, a, m: losses.gmpo_loss(lp, o, a[:, 0], m).loss),
    ("dppo_tv", naive_dppo_tv, lambda lp, o, a, m: losses.dppo_tv_loss(lp, o, a, m).loss),
    ("dppo_kl", naive_dppo_kl, lambda lp, o, a, m: losses.dppo_kl_loss(lp, o, a, m).loss),
    ("clip_cov", naive_clip_cov, lambda lp, o, a, m: losses.clip_cov_loss(lp, o, a, m).loss),
    ("kl_cov", naive_kl_cov, lambda lp, o, a, m: losses.kl_cov_loss(lp, o, a, m).loss),
]
# values agree to this relative tolerance (kl_cov: the fractional selection of rN tokens vs int(rN);
# dppo_kl: the spec-style code adds 1e-8 inside its logs)
TOL = {"kl_cov": 1e-4, "dppo_kl": 1e-4}


def _once(fn, inputs):
    logp, old, adv, mask = inputs
    x = logp.clone().requires_grad_(True)
    t0 = time.thread_time()
    loss = fn(x, old, adv, mask)
    loss.backward()
    return time.thread_time() - t0, float(loss.detach())


def _time_interleaved(naive, ours, inputs, repeats):
    """Minimum and median times of the three variants, run in turn in each round (so that a change
    of load on the shared machine hits all three alike). The ratio uses the minimum: on a loaded
    machine it is the best estimate of the uncontended cost. Also the median over rounds of the
    round's own ratio (trajgrad / spec code, both timed back to back): the estimate least moved by
    load that changes between rounds."""
    variants = [(naive, True), (ours, True), (ours, False)]
    times = [[], [], []]
    vals = [None, None, None]
    for i in range(repeats + 1):
        for j, (fn, checks) in enumerate(variants):
            with trajgrad.validation(checks):
                dt, v = _once(fn, inputs)
            if i:
                times[j].append(dt)
            vals[j] = v
    paired = statistics.median(o / b for o, b in zip(times[1], times[0]) if b > 0)
    return [min(t) for t in times], [statistics.median(t) for t in times], vals, paired


def _reuse_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse (no trimming, no mmap for blocks below 32 MB).

    By default glibc serves each 1 MB temporary from fresh pages and returns them on free, so
    every temporary costs ~256 page faults; which temporaries fault depends on the heap state
    left by earlier calls, and timings of the same code vary several-fold. With reuse, both
    sides are timed on their arithmetic, as under a caching allocator (PyTorch's on GPU).
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20))
    except OSError:
        return False


def main():
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--malloc", choices=("reuse", "default"), default="reuse",
                    help="reuse: glibc keeps freed blocks (see _reuse_freed_memory); default: glibc as configured")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--only", default="", help="comma-separated subset of the losses")
    ap.add_argument("--out", default="bench/results/losses.md")
    a = ap.parse_args()
    reuse = _reuse_freed_memory() if a.malloc == "reuse" else False
    inputs = _inputs()
    ntok = float(inputs[3].sum())
    rows = []
    for name, naive, ours in CASES:
        if a.only and name not in a.only.split(","):
            continue
        (tb, to, tf), (mb, mo, mf), (vb, vo, vf), paired = _time_interleaved(naive, ours, inputs, a.repeats)
        tol = TOL.get(name, 1e-5)
        assert abs(vb - vo) <= tol * max(1.0, abs(vb)), (name, vb, vo)
        rows.append((name, tb, to, tf, mb, mo, paired))
        print(f"{name:<11} spec code {tb * 1e9 / ntok:7.1f} ns/tok   trajgrad {to * 1e9 / ntok:7.1f} ns/tok "
              f"({to / tb:.2f}x)   no value checks {tf * 1e9 / ntok:7.1f} ns/tok ({tf / tb:.2f}x)", flush=True)
    load = os.getloadavg()[0]
    md = [
        "## Policy losses: forward+backward cost per valid token (B=64, L=4,096, float32)",
        "",
        f"Command: `OMP_NUM_THREADS=1 PYTHONPATH=src {sys.executable} bench/bench_losses.py --repeats {a.repeats} "
        f"--malloc {a.malloc}`  ",
        f"Allocator: {'glibc keeps freed blocks for reuse (mallopt; both sides alike)' if reuse else 'glibc default'}.  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{int(ntok):,} valid tokens of {B * L:,} (ragged lengths); minimum of {a.repeats} interleaved rounds "
        "(the last columns: ratio of the medians, and the median over rounds of each round's own ratio); "
        f"load average at the end {load:.1f} (shared machine).",
        "",
        "Baseline: the spec's minimal code for each estimator (no validation, mask by multiplication, no metrics).",
        "Times are the CPU time of the (single) computing thread, forward + backward; trajgrad with validation and its "
        "default metrics (ratio mean/min/max, KL k1/k3, clip or mask fractions; log-ratio quantiles are opt-in).",
        "",
        "| loss | spec code ns/token | trajgrad ns/token | ratio | trajgrad, value checks off | ratio | ratio of medians "
        "| median of paired ratios |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, tb, to, tf, mb, mo, paired in rows:
        md.append(f"| {name} | {tb * 1e9 / ntok:.1f} | {to * 1e9 / ntok:.1f} | {to / tb:.2f}x | {tf * 1e9 / ntok:.1f} | "
                  f"{tf / tb:.2f}x | {mo / mb:.2f}x | {paired:.2f}x |")
    md.append("")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
