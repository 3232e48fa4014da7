"""Held-out success of the shop agent before and after training it through the proxy.

    PYTHONPATH=examples/openai_agent python examples/openai_agent/train_and_evaluate.py \
        examples/openai_agent/shop_smollm2.yaml [--set key=value ...]

Builds the run of the YAML file (``rollout.backend: proxy``), runs the unchanged agent on the
held-out questions at temperature 0 through the served policy, trains, and runs them again on
the trained policy (the same server, the updated weights). Prints and writes
``<run_dir>/heldout.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trajgrad.train.config import load_config, parse_overrides  # noqa: E402
from trajgrad.stats import wilson_interval  # noqa: E402
from trajgrad.train.trainer import Trainer  # noqa: E402


def heldout(trainer, temperature: float) -> dict:
    trajs = trainer.sampler.evaluate(trainer.heldout_tasks, temperature=temperature, seed=0)
    n = len(trainer.heldout_tasks)
    wins = sum(1 for t in trajs if t.success)
    lo, hi = wilson_interval(wins, n)
    return {"successes": wins, "n": n, "success": wins / n, "low": lo, "high": hi,
            "not_finished": n - len(trajs), "counters": dict(trainer.sampler.counters)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--run-dir", default=None)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, overrides=parse_overrides(args.overrides))
    run_dir = Path(args.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    t0 = time.perf_counter()
    trainer = Trainer(cfg, run_dir, console=print)
    try:
        before = heldout(trainer, cfg.eval.temperature)
        print(f"held-out success before: {before['successes']}/{before['n']} = {before['success']:.1%}", flush=True)
        trainer.run()
        after = heldout(trainer, cfg.eval.temperature)
        print(f"held-out success after:  {after['successes']}/{after['n']} = {after['success']:.1%}", flush=True)
    finally:
        trainer.sampler.close()
    out = {"config": str(args.config), "overrides": args.overrides, "before": before, "after": after,
           "seconds": time.perf_counter() - t0, "policy_version": trainer.policy_version}
    (run_dir / "heldout.json").write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("seconds", "policy_version")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
