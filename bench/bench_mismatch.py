"""Rollout correction under a sampler–learner mismatch, measured on the tiny preset (§7).

The mismatch is injected on purpose: the sampler draws (and records its behaviour
log-probs) at ``sampling.behaviour_temperature`` while the learner recomputes every
log-prob at ``sampling.temperature`` (the tiny preset's 0.7), so
:math:`\\pi_{old}\\ne\\mu` at every token, as with a rollout engine whose kernels, precision
or routing differ from the trainer's. Variants, all on the same seed and the same SFT warm
start (the runs are deterministic with ``OMP_NUM_THREADS=1``), GRPO with one on-policy
epoch:

* ``matched``      no mismatch (sampler at 0.7), no correction: the reference;
* ``mismatch``     sampler at ``--behaviour-temperature``, no correction (the baseline);
* ``tis``          the same samples, truncated IS at token level, cap 2 (decoupled);
* ``mis``          masked IS / IcePop at token level, bounds [0.5, 5] (decoupled);
* ``mis_bypass``   (optional) masked IS at geometric level in bypass mode.

Reported per variant: the mismatch KL(mu || pi_old) (k1 and k3, per token), the correction
weight's mean, min and max, the truncated and masked token fractions, the training reward
curve (under the sampler's distribution) and held-out greedy success before and after.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/bench_mismatch.py
    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/bench_mismatch.py --variants mismatch tis --steps 10

Writes bench/results/mismatch.md and bench/results/mismatch.png (``--name`` changes the stem).

``--experiment bf16``: the mismatch of a reduced-precision rollout engine. The sampler runs
the policy in bfloat16 (a bfloat16 copy of the learner's weights, refreshed from them
before every rollout; the behaviour log-probs are recorded from that copy), the learner in
float32, at the same temperature. Every variant starts from one shared SFT warm start
(run once) and uses the same seed:

* ``fp32``         the sampler in float32 (no mismatch), no correction: the reference;
* ``bf16``         the sampler in bfloat16, no correction (the baseline);
* ``bf16_tis``     truncated IS at token level, cap 2 (decoupled);
* ``bf16_mis``     masked IS / IcePop at token level, bounds [0.5, 5] (decoupled).

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/bench_mismatch.py --experiment bf16 \
        --steps 12 --sft-steps 150 --heldout 64

Writes bench/results/mismatch_bf16.md and .png.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent

VARIANTS = {
    "matched": (None, None),
    "mismatch": ("B", None),
    "tis": ("B", {"kind": "tis", "level": "token", "cap": 2.0}),
    "mis": ("B", {"kind": "mis", "level": "token", "bounds": [0.5, 5.0]}),
    "mis_bypass": ("B", {"kind": "mis", "level": "geometric", "bounds": [0.5, 2.0], "mode": "bypass"}),
}
# the bf16 experiment: (sampler dtype, correction)
BF16_VARIANTS = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "bf16_tis": ("bfloat16", {"kind": "tis", "level": "token", "cap": 2.0}),
    "bf16_mis": ("bfloat16", {"kind": "mis", "level": "token", "bounds": [0.5, 5.0]}),
}


def _overrides(variant: str, args) -> dict:
    beh, rc = VARIANTS[variant]
    out = {"train.steps": args.steps, "train.seed": args.seed, "checkpoint.every": 0, "log.progress": False}
    if beh is not None:
        out["sampling.behaviour_temperature"] = args.behaviour_temperature
    if rc is not None:
        out["recipe.overrides.rollout_correction"] = rc
    if args.sft_steps is not None:
        out["sft.steps"] = args.sft_steps
    if args.heldout is not None:
        out["task.n_heldout"] = args.heldout
    return out


def _run(variant: str, args, root: Path) -> dict:
    from trajgrad.train.metrics import read_metrics
    from trajgrad.train.run import main

    run_dir = root / variant
    t0 = time.perf_counter()
    main(preset="tiny", overrides=_overrides(variant, args), run_dir=run_dir, overwrite=True)
    seconds = time.perf_counter() - t0
    train = read_metrics(run_dir, kind="train")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"variant": variant, "seconds": seconds, "train": train, "summary": summary}


def _mean(records, key):
    vals = [r[key] for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else float("nan")


def _extreme(records, key, fn):
    vals = [r[key] for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return fn(vals) if vals else float("nan")


def _eval(summary, tag):
    e = summary.get(f"eval_{tag}") or {}
    return e.get("success", float("nan")), e.get("successes"), e.get("n")


def _fmt(v, spec=".3f"):
    return "—" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _table(results) -> str:
    rows = ["| variant | sampler T | correction | KL(mu‖pi_old) k1 | KL k3 | weight mean | weight min | weight max "
            "| truncated frac | masked frac | reward first 5 | reward last 5 | held-out before | held-out after | s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        tr = r["train"]
        beh, rc = VARIANTS[r["variant"]]
        rc_txt = "off" if rc is None else ", ".join(f"{k}={v}" for k, v in rc.items())
        k1, k3 = _mean(tr, "mismatch/kl_k1"), _mean(tr, "mismatch/kl_k3")  # logged by every variant
        b, bs, bn = _eval(r["summary"], "before")
        a, as_, an = _eval(r["summary"], "after")
        rows.append("| " + " | ".join([
            r["variant"], r["beh_t"], rc_txt, _fmt(k1, ".4f"), _fmt(k3, ".4f"),
            _fmt(_mean(tr, "correction/weight/mean")), _fmt(_extreme(tr, "correction/weight/min", min)),
            _fmt(_extreme(tr, "correction/weight/max", max)),
            _fmt(_mean(tr, "correction/truncated_frac"), ".4f"), _fmt(_mean(tr, "correction/masked_frac"), ".4f"),
            _fmt(_mean(tr[:5], "reward/mean")), _fmt(_mean(tr[-5:], "reward/mean")),
            f"{_fmt(b, '.1%')} ({bs}/{bn})", f"{_fmt(a, '.1%')} ({as_}/{an})", f"{r['seconds']:.0f}",
        ]) + " |")
    return "\n".join(rows)


def _per_turn(results) -> str:
    rows = []
    for r in results:
        tr = r["train"]
        keys = sorted({k for rec in tr for k in rec if k.startswith("correction/turn")})
        if not keys:
            continue
        turns = sorted({k.split("/")[1] for k in keys})
        for t in turns:
            rows.append("| " + " | ".join([
                r["variant"], t, _fmt(_mean(tr, f"correction/{t}/kl/k1"), ".4f"),
                _fmt(_mean(tr, f"correction/{t}/weight/mean")), _fmt(_mean(tr, f"correction/{t}/dropped_frac"), ".4f"),
                _fmt(_mean(tr, f"correction/{t}/truncated_frac"), ".4f")]) + " |")
    if not rows:
        return ""
    head = ["| variant | turn | KL k1 | weight mean | dropped frac | truncated frac |", "| --- | --- | --- | --- | --- | --- |"]
    return "\n".join(head + rows)


def _plot(results, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for i, r in enumerate(results):
        tr = r["train"]
        steps = [rec["step"] for rec in tr]
        style = dict(label=r["variant"], color=f"C{i}")  # one colour per variant in every panel
        axes[0].plot(steps, [rec.get("reward/mean", float("nan")) for rec in tr], **style)
        axes[1].plot(steps, [rec.get("mismatch/kl_k3", float("nan")) for rec in tr], **style)
        if any("correction/weight/mean" in rec for rec in tr):
            axes[2].plot(steps, [1.0 - rec.get("correction/kept_frac", float("nan")) for rec in tr], **style)
    axes[0].set_title("training reward (under the sampler's distribution)")
    axes[1].set_title("mismatch KL(mu || pi_old), k3 per token")
    axes[2].set_title("dropped token fraction (MIS) / 0 (TIS)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------- the bf16 experiment
class _Bf16Sampler:
    """The in-process sampler over a bfloat16 copy of the learner's weights.

    Before every rollout the copy is refreshed from the learner's float32 weights (cast to
    bfloat16), so the sampler runs the current policy in reduced precision and records its
    behaviour log-probs from that computation; everything else is the trainer's sampler.
    """

    def __init__(self, trainer):
        import copy

        import torch

        from trajgrad.rollout import HFSampler

        s = trainer.cfg.sampling
        self._learner = trainer.model
        self._copy = copy.deepcopy(trainer.model).to(torch.bfloat16)
        self._inner = HFSampler(self._copy, trainer.tokenizer, temperature=s.sampler_temperature, top_k=s.top_k,
                                top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                                policy_version=trainer.policy_version)
        self._inner.template_mismatch = trainer.sampler.template_mismatch

    def rollout(self, *args, **kwargs):
        import torch

        with torch.no_grad():
            self._copy.load_state_dict(self._learner.state_dict())  # copy_ casts float32 -> bfloat16
        return self._inner.rollout(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _bf16_config(variant: str, args, sft_steps: int):
    from trajgrad.train.config import load_config

    _, rc = BF16_VARIANTS[variant]
    over = {"train.steps": args.steps, "train.seed": args.seed, "checkpoint.every": 0, "log.progress": False,
            "sft.steps": sft_steps, "eval.before": False, "eval.after": sft_steps == 0}
    if args.heldout is not None:
        over["task.n_heldout"] = args.heldout
    if args.prompts is not None:
        over["train.prompts_per_step"] = args.prompts
    if rc is not None:
        over["recipe.overrides.rollout_correction"] = rc
    return load_config(None, preset="tiny", overrides=over)


def _shared_sft(args, root: Path):
    """One SFT warm start for every variant: the preset's, run once; its weights and held-out success."""
    from trajgrad.train.config import PRESETS
    from trajgrad.train.trainer import Trainer

    sft = PRESETS["tiny"]["sft"]
    steps = args.sft_steps if args.sft_steps is not None else sft["steps"]
    tr = Trainer(_bf16_config("fp32", args, steps), root / "sft", console=lambda *_: None)
    t0 = time.perf_counter()
    tr.sft(steps, sft["batch_size"], sft["lr"])
    ev = tr.evaluate("after_sft")
    state = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    return state, ev, steps, time.perf_counter() - t0


def _run_bf16(variant: str, args, root: Path, sft_state) -> dict:
    from trajgrad.train.metrics import read_metrics
    from trajgrad.train.trainer import Trainer

    run_dir = root / variant
    t0 = time.perf_counter()
    tr = Trainer(_bf16_config(variant, args, 0), run_dir, console=lambda *_: None)
    tr.model.load_state_dict(sft_state)
    if BF16_VARIANTS[variant][0] == "bfloat16":
        tr.sampler = _Bf16Sampler(tr)
    tr.run()
    seconds = time.perf_counter() - t0
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"variant": variant, "seconds": seconds, "train": read_metrics(run_dir, kind="train"), "summary": summary}


def _bf16_table(results) -> str:
    rows = ["| variant | sampler | correction | KL(mu‖pi_old) k1 | KL k3 | max abs log-ratio | weight mean | weight min "
            "| weight max | truncated frac | masked frac | reward first 3 | reward last 3 | held-out after | s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        tr = r["train"]
        dtype, rc = BF16_VARIANTS[r["variant"]]
        rc_txt = "off" if rc is None else ", ".join(f"{k}={v}" for k, v in rc.items())
        a, as_, an = _eval(r["summary"], "after")
        rows.append("| " + " | ".join([
            r["variant"], dtype, rc_txt, _fmt(_mean(tr, "mismatch/kl_k1"), ".2e"), _fmt(_mean(tr, "mismatch/kl_k3"), ".2e"),
            _fmt(_extreme(tr, "mismatch/max_abs_log_ratio", max), ".3f"),
            _fmt(_mean(tr, "correction/weight/mean"), ".4f"), _fmt(_extreme(tr, "correction/weight/min", min)),
            _fmt(_extreme(tr, "correction/weight/max", max)),
            _fmt(_mean(tr, "correction/truncated_frac"), ".2e"), _fmt(_mean(tr, "correction/masked_frac"), ".2e"),
            _fmt(_mean(tr[:3], "reward/mean")), _fmt(_mean(tr[-3:], "reward/mean")),
            f"{_fmt(a, '.1%')} ({as_}/{an})", f"{r['seconds']:.0f}",
        ]) + " |")
    return "\n".join(rows)


def _bf16_per_turn(results) -> str:
    rows = []
    for r in results:
        tr = r["train"]
        turns = sorted({k.split("/")[1] for rec in tr for k in rec if k.startswith("mismatch/turn")})
        for t in turns:
            rows.append("| " + " | ".join([
                r["variant"], t, _fmt(_mean(tr, f"mismatch/{t}/kl_k1"), ".2e"), _fmt(_mean(tr, f"mismatch/{t}/kl_k3"), ".2e"),
                _fmt(_mean(tr, f"correction/{t}/weight/mean"), ".4f"),
                _fmt(_mean(tr, f"correction/{t}/truncated_frac"), ".2e"),
                _fmt(_mean(tr, f"correction/{t}/masked_frac"), ".2e")]) + " |")
    head = ["| variant | turn | mismatch k1 | mismatch k3 | weight mean | truncated frac | masked frac |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    return "\n".join(head + rows) if rows else ""


def _bf16_main(args, argv) -> int:
    root = Path(tempfile.mkdtemp(prefix="bench-mismatch-bf16-"))
    results = []
    t_all = time.perf_counter()
    try:
        print("== shared SFT warm start", flush=True)
        state, ev, sft_steps, sft_s = _shared_sft(args, root)
        print(f"   {sft_s:.0f} s; held-out after SFT {ev.success:.3f}", flush=True)
        for v in args.variants:
            print(f"== {v}", flush=True)
            r = _run_bf16(v, args, root, state)
            results.append(r)
            print(f"   {r['seconds']:.0f} s; held-out after {_eval(r['summary'], 'after')[0]}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - t_all
    name = args.name if args.name != "mismatch" else "mismatch_bf16"
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"{name}.png"
    plotted = _plot(results, png)
    cmd = "OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/bench_mismatch.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    from trajgrad.train.config import PRESETS

    tiny = PRESETS["tiny"]
    prompts = args.prompts or tiny["train"]["prompts_per_step"]
    base = next((r for r in results if r["variant"] == "bf16"), None)
    lines = []
    if base is not None:
        b = _eval(base["summary"], "after")[0]
        for r in results:
            a = _eval(r["summary"], "after")[0]
            lines.append(f"- {r['variant']}: held-out success after / bf16 baseline's = "
                         f"{_fmt(a / b if b else float('nan'), '.2f')}")
    text = "\n".join([
        "# Rollout correction under a bfloat16 sampler and a float32 learner (tiny preset)",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on a shared 2-core CPU, one "
        f"process, variants one after the other ({wall:.0f} s in all). One shared SFT warm start ({sft_steps} steps, "
        f"held-out greedy success after it {ev.success:.1%}), then per variant seed {args.seed}, {args.steps} GRPO "
        f"steps of {prompts} prompts × {tiny['train']['group_size']} rollouts at temperature "
        f"{tiny['sampling']['temperature']:g}. The sampler of the bf16 variants runs a bfloat16 copy of the "
        "current weights (refreshed before every rollout) and records the behaviour log-probs from it; the "
        "learner recomputes in float32.",
        "",
        f"    {cmd.strip()}",
        "",
        _bf16_table(results),
        "",
        "Baseline: `bf16` (the bfloat16 sampler without correction); reference: `fp32` (no mismatch).",
        *lines,
        "",
        "KL columns: the sampled estimates of KL(mu‖pi_old) per token on the sampler's tokens (`mismatch/kl_k1`, "
        "`mismatch/kl_k3`), means over steps; max abs log-ratio: the largest |log pi_old − log mu| of any action "
        "token over the steps. Weight columns: mean of the step means, min / max over all steps. Fractions are of "
        "valid action tokens. Training reward is under the sampler's distribution; held-out success is greedy, "
        "by the float32 learner.",
        "",
        "Per turn (means over steps):",
        "",
        _bf16_per_turn(results),
        "",
        f"![curves]({png.name})" if plotted else "",
        "",
    ])
    (args.out / f"{name}.md").write_text(text)
    print(text)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experiment", choices=("temperature", "bf16"), default="temperature")
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS) + list(BF16_VARIANTS))
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (bf16 experiment; default the preset's)")
    p.add_argument("--behaviour-temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=None, help="override the preset's SFT warm start (smoke runs)")
    p.add_argument("--heldout", type=int, default=None, help="override the preset's held-out task count (smoke runs)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--name", default="mismatch", help="writes OUT/NAME.md and OUT/NAME.png")
    args = p.parse_args(argv)
    if args.experiment == "bf16":
        args.variants = args.variants or list(BF16_VARIANTS)
        bad = [v for v in args.variants if v not in BF16_VARIANTS]
        if bad:
            p.error(f"--variants: {bad[0]!r} is not a variant of the bf16 experiment ({', '.join(BF16_VARIANTS)})")
        return _bf16_main(args, argv)
    args.variants = args.variants or ["matched", "mismatch", "tis", "mis"]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: {bad[0]!r} is not a variant of the temperature experiment ({', '.join(VARIANTS)})")
    from trajgrad.train.config import PRESETS

    learner_t = PRESETS["tiny"]["sampling"]["temperature"]
    root = Path(tempfile.mkdtemp(prefix="bench-mismatch-"))
    results = []
    try:
        for v in args.variants:
            print(f"== {v}", flush=True)
            r = _run(v, args, root)
            r["beh_t"] = f"{args.behaviour_temperature:g}" if VARIANTS[v][0] else f"{learner_t:g}"
            results.append(r)
            print(f"   {r['seconds']:.0f} s; held-out after {_eval(r['summary'], 'after')[0]}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"{args.name}.png"
    plotted = _plot(results, png)
    cmd = "OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/bench_mismatch.py " + " ".join(
        a for a in (sys.argv[1:] if argv is None else argv))
    base = next((r for r in results if r["variant"] == "mismatch"), None)
    ratio_lines = []
    if base is not None:
        b_after = _eval(base["summary"], "after")[0]
        for r in results:
            a = _eval(r["summary"], "after")[0]
            ratio_lines.append(f"- {r['variant']}: held-out success after / mismatch baseline's = "
                               f"{_fmt(a / b_after if b_after else float('nan'), '.2f')}")
    text = "\n".join([
        "# Rollout correction under an injected sampler–learner mismatch (tiny preset)",
        "",
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, one process, variants one "
        f"after the other, seed {args.seed}, {args.steps} GRPO steps of 16 prompts × 8 rollouts after the preset's "
        f"SFT warm start. The learner recomputes at temperature {learner_t:g}; the sampler draws at "
        f"`sampling.behaviour_temperature` = {args.behaviour_temperature:g} (a deliberate mismatch).",
        "",
        f"    {cmd.strip()}",
        "",
        _table(results),
        "",
        "Baseline: `mismatch` (the same mismatched samples without correction).",
        *ratio_lines,
        "",
        "KL columns: the sampled estimates of KL(mu‖pi_old) per token on the sampler's tokens "
        "(`mismatch/kl_k1`, `mismatch/kl_k3`, logged by every variant; equal to the correction's "
        "`correction/kl/*`), means over steps. Weight columns: mean of the step means, and the "
        "min / max over all steps. Fractions are of valid action tokens. Training reward is measured under the "
        "sampler's distribution (so the mismatched variants' rewards are those of temperature "
        f"{args.behaviour_temperature:g} samples); held-out success is greedy (128 tasks).",
        "",
        _per_turn(results),
        "",
        f"![curves]({png.name})" if plotted else "",
        "",
    ])
    (args.out / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
