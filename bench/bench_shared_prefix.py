"""Benchmark: decoding with a group's prompt keys/values kept once against one copy per row.

``sample_actions`` on ``P`` prompts x ``G`` rows, each row handed its prompt's keys/values as
``past_kv``: the same :class:`~trajgrad.model.kv.RowKV` object for the rows of a group (what
``HFBackend`` hands over; the decode buffers keep it once, model/shared_prefix.py) against a
copy per row (the buffers hold it ``G`` times). Same rows, seed and model, alternating the two
``--rounds`` times: the median time of each, and the bytes of the decode step's key/value
buffers. Both must sample the same tokens (checked) with log-probs within 1e-5.

Model: the tiny Llama of ``bench_trl.py`` (hidden 128, 2 layers, 4 heads), random prompts of
``--prompt-len`` tokens.

Usage::

    .venv/bin/python bench/bench_shared_prefix.py --threads 1 --rounds 7                    # bench_trl's shape
    .venv/bin/python bench/bench_shared_prefix.py --threads 1 --rounds 5 --prompt-len 512 --group 16 --new 64
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def _kv_bytes(buffers) -> int:
    n = sum(t.numel() * t.element_size() for t in buffers.k + buffers.v)
    if buffers.shared is not None:
        n += sum(t.numel() * t.element_size() for t in buffers.shared.k + buffers.shared.v)
    return n


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=36)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from trajgrad.model import decode
    from trajgrad.model.kv import RowKV
    from trajgrad.model.tiny import build_tiny_model
    from trajgrad.model.tokenizer import build_char_tokenizer
    from trajgrad.rollout.generation import sample_actions

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=128, layers=2, heads=4, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 90, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    with torch.no_grad():  # each prompt's keys/values but its last token, from the model's forward
        _, kv = sample_actions(model, [p[:-1] + [p[-1]] for p in prompts], eos_ids=[1], pad_id=0, temperature=0.0,
                               max_new_tokens=1, return_kv=True)
    heads = [RowKV([k[:, :len(p) - 1] for k in r.keys], [v[:, :len(p) - 1] for v in r.values])
             for p, r in zip(prompts, kv)]
    seqs = [p for p in prompts for _ in range(args.group)]
    shared_past = [h for h in heads for _ in range(args.group)]
    copied_past = [RowKV([k.clone() for k in h.keys], [v.clone() for v in h.values]) for h in shared_past]
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    seen = {}
    real_init = decode.KVBuffers.__init__

    def recording_init(self, *a, **k):
        real_init(self, *a, **k)
        seen["buffers"] = self

    decode.KVBuffers.__init__ = recording_init
    load_before = os.getloadavg()
    times, bytes_, outs = {"shared": [], "copied": []}, {}, {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for key, past in (("copied", copied_past), ("shared", shared_past)):
            t0 = time.perf_counter()
            with torch.no_grad():
                outs[key] = sample_actions(model, seqs, eos_ids=eos, pad_id=0, temperature=1.0, max_new_tokens=args.new,
                                           past_kv=past, generator=torch.Generator().manual_seed(r))
            if r:
                times[key].append(time.perf_counter() - t0)
            bytes_[key] = _kv_bytes(seen["buffers"])
            assert (seen["buffers"].shared is not None) == (key == "shared")
        assert [a for a, _, _ in outs["shared"]] == [a for a, _, _ in outs["copied"]], "different tokens"
        dev = max((abs(x - y) for (_, a, _), (_, b, _) in zip(outs["shared"], outs["copied"]) for x, y in zip(a, b)),
                  default=0.0)
        assert dev < 1e-5, f"log-probs differ by {dev}"
    decode.KVBuffers.__init__ = real_init
    med = {k: statistics.median(v) for k, v in times.items()}
    n_tok = sum(len(a) for a, _, _ in outs["shared"])
    out = args.out or Path(__file__).resolve().parent / "results" / "shared_prefix.md"
    cmd = f".venv/bin/python bench/bench_shared_prefix.py {' '.join(sys.argv[1:] if argv is None else argv)}"
    mib = lambda b: b / 2**20  # noqa: E731
    section = "\n".join([
        f"## {args.prompts} prompts x G = {args.group}, prompts of {args.prompt_len} tokens, up to {args.new} new tokens",
        "",
        f"- command: `{cmd.strip()}`",
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M:%S')}; torch "
        f"{torch.__version__}, threads {args.threads}, load average {load_before[0]:.1f} before / "
        f"{os.getloadavg()[0]:.1f} after",
        f"- workload: tiny Llama (hidden 128, 2 layers, 4 heads), as in bench_trl.py; {len(seqs)} rows, temperature 1 "
        f"({n_tok} tokens in the last round); median of {args.rounds} alternating rounds",
        "",
        "| prompt keys/values | median (s) | rounds (s) | decode buffers (MiB) |",
        "|---|---:|---|---:|",
        f"| one copy per row | {med['copied']:.3f} | " + ", ".join(f"{t:.3f}" for t in times["copied"])
        + f" | {mib(bytes_['copied']):.2f} |",
        f"| once per group (`model/shared_prefix.py`) | {med['shared']:.3f} | "
        + ", ".join(f"{t:.3f}" for t in times["shared"]) + f" | {mib(bytes_['shared']):.2f} |",
        f"| **ratio** | **{med['copied'] / med['shared']:.2f}x** faster | same tokens, log-probs within 1e-5 | "
        f"**{bytes_['copied'] / bytes_['shared']:.1f}x** less |",
        "",
    ])
    print(section)
    # one section per workload shape: this run's replaces the one with the same heading
    head = "# Decoding with a group's prompt keys/values kept once vs one copy per row (tiny model)\n"
    sections = {}
    if out.exists():
        for block in out.read_text().split("\n## ")[1:]:
            sections["## " + block.splitlines()[0]] = "## " + block.rstrip() + "\n"
    sections[section.splitlines()[0]] = section
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(head + "\n" + "\n".join(sections.values()))

if __name__ == "__main__":
    main()
