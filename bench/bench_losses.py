"""Forward+backward cost per token of each policy loss at B=64, L=4,096 (float32, CPU).

Baseline: the spec's minimal code for the same estimator (e.g. §8's four-line PPO clip,
§20.2's ``sao_policy_loss``), which has no input validation, multiplies by the mask instead
of selecting, and computes no metrics. The trajgrad column includes validation (shape, 0/1
mask, finiteness at valid positions) and the detached metrics every loss returns; the
third column runs trajgrad with value validation off (``trajgrad.validation(False)``).
Both sides get the same inputs in one run; values are checked to agree.

    .venv/bin/python bench/bench_losses.py
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


CASES = [
    ("reinforce", naive_reinforce, lambda lp, o, a, m: losses.reinforce_loss(lp, a, m).loss),
    ("ppo_clip", naive_ppo, lambda lp, o, a, m: losses.ppo_clip_loss(lp, o, a, m, eps_low=0.2).loss),
    ("gspo", naive_gspo, lambda lp, o, a, m: losses.gspo_loss(lp, o, a[:, 0], m).loss),
    ("gspo_token", naive_gspo_token, lambda lp, o, a, m: losses.gspo_token_loss(lp, o, a, m).loss),
    ("sapo", naive_sapo, lambda lp, o, a, m: losses.sapo_loss(lp, o, a, m).loss),
    ("sao_dis", naive_sao, lambda lp, o, a, m: losses.sao_dis_loss(lp, o, a, m).loss),
]


def _time(fn, inputs, repeats):
    logp, old, adv, mask = inputs
    ts = []
    val = None
    for i in range(repeats + 1):
        x = logp.clone().requires_grad_(True)
        t0 = time.perf_counter()
        loss = fn(x, old, adv, mask)
        loss.backward()
        dt = time.perf_counter() - t0
        if i:
            ts.append(dt)
        val = float(loss.detach())
    return statistics.median(ts), val


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/losses.md")
    a = ap.parse_args()
    inputs = _inputs()
    ntok = float(inputs[3].sum())
    rows = []
    for name, naive, ours in CASES:
        tb, vb = _time(naive, inputs, a.repeats)
        to, vo = _time(ours, inputs, a.repeats)
        with trajgrad.validation(False):
            tf, vf = _time(ours, inputs, a.repeats)
        assert abs(vb - vo) <= 1e-4 * max(1.0, abs(vb)), (name, vb, vo)
        rows.append((name, tb, to, tf))
        print(f"{name:<11} spec code {tb * 1e9 / ntok:7.1f} ns/tok   trajgrad {to * 1e9 / ntok:7.1f} ns/tok "
              f"({to / tb:.2f}x)   no value checks {tf * 1e9 / ntok:7.1f} ns/tok ({tf / tb:.2f}x)", flush=True)
    load = os.getloadavg()[0]
    md = [
        "## Policy losses: forward+backward cost per valid token (B=64, L=4,096, float32)",
        "",
        f"Command: `{sys.executable} bench/bench_losses.py --repeats {a.repeats}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{int(ntok):,} valid tokens of {B * L:,} (ragged lengths); median of {a.repeats} runs; "
        f"load average at the end {load:.1f} (shared machine).",
        "",
        "Baseline: the spec's minimal code for each estimator (no validation, mask by multiplication, no metrics).",
        "",
        "| loss | spec code ns/token | trajgrad ns/token | ratio | trajgrad, value checks off | ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, tb, to, tf in rows:
        md.append(f"| {name} | {tb * 1e9 / ntok:.1f} | {to * 1e9 / ntok:.1f} | {to / tb:.2f}x | {tf * 1e9 / ntok:.1f} | {tf / tb:.2f}x |")
    md.append("")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
