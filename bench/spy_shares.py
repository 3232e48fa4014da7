"""Shares of a sampled profile: which part of a trainer step the samples fall in.

Reads py-spy's raw (collapsed-stack) output, keeps the samples whose stack passes through
``--root`` (default: ``train_step``) and prints, for each ``--part NAME=SUBSTRING``, the
share of those samples whose stack contains the substring (parts may nest: the decode step
inside the sampler). A sampling profiler adds no per-call cost, so Python-heavy parts are not
inflated as under cProfile. Example (py-spy is not a trajgrad dependency: ``pip install py-spy``)::

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src py-spy record -r 200 -f raw -o /tmp/spy.txt -- \\
        .venv-peers/bin/python bench/bench_trl.py --side trajgrad --threads 1 --steps 30 --warmup 3
    python bench/spy_shares.py /tmp/spy.txt
"""
from __future__ import annotations

import argparse
from typing import Dict, Iterable, Tuple

# the parts of trajgrad's group-synchronous step (train/trainer.py), by the frames they run in
DEFAULT_PARTS = (
    ("collect (sampling, environments)", "Trainer._collect"),
    ("  shared prompt prefixes, run once per group", "_shared_prefix ("),
    ("  sample_actions", "sample_actions ("),
    ("    decode steps", "decode_step ("),
    ("update (learn)", "Trainer.learn ("),
    ("  forward (learner_logprobs)", "learner_logprobs ("),
    ("  backward", "_engine_run_backward ("),
    ("  optimizer (finish_step)", "finish_step ("),
    ("  per-token log", "tokenlog.py"),
    ("  collate", "collate ("),
)


def shares(lines: Iterable[str], parts: Iterable[Tuple[str, str]],
           root: str = "train_step") -> Tuple[int, Dict[str, float], int]:
    """(samples under ``root``, {part name: share of them whose stack contains the part's
    substring}, lines skipped). A line that is not ``stack count`` (a frame name holding a
    line break splits its line) is skipped and counted."""
    parts = list(parts)
    total, skipped, hits = 0, 0, {name: 0 for name, _ in parts}
    for line in lines:
        line = line.strip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            skipped += 1
            continue
        if root not in stack:
            continue
        n = int(count)
        total += n
        for name, needle in parts:
            if needle in stack:
                hits[name] += n
    return total, {name: (h / total if total else 0.0) for name, h in hits.items()}, skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="py-spy record -f raw output")
    ap.add_argument("--root", default="train_step")
    ap.add_argument("--part", action="append", default=None, metavar="NAME=SUBSTRING",
                    help="a part to report (repeatable); default: the trainer step's parts")
    a = ap.parse_args()
    parts = DEFAULT_PARTS
    if a.part:
        if any("=" not in p for p in a.part):
            raise SystemExit("--part: expected NAME=SUBSTRING")
        parts = tuple(tuple(p.split("=", 1)) for p in a.part)
    with open(a.raw) as fh:
        total, got, skipped = shares(fh, parts, a.root)
    print(f"{total} samples under {a.root!r} ({skipped} unreadable lines skipped)")
    for name, share in got.items():
        print(f"{100 * share:6.1f}%  {name}")


if __name__ == "__main__":
    main()
