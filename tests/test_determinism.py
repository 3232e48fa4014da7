"""Same seed, same run, with two intra-op threads (the default on a two-core machine).

* the learner's gradient through the shared-prefix forward pass (rows of a batch grouped by
  a common prompt, the prefix run once and gathered per row) is the same bits every time:
  its backward once added the gathered rows with atomic float adds in the order the
  threads reached them;
* two short ``tiny``-preset runs (SFT warm start, GRPO steps, held-out evaluation) give
  bitwise identical metrics (timings aside), trajectories and held-out results, and a run
  resumed from a middle checkpoint ends identical to them;
* the run records its thread counts and deterministic-algorithm settings in ``run.json``.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from trajgrad.cli import app
from trajgrad.model.positions import prefix_groups
from trajgrad.train import updates
from trajgrad.train.config import load_config
from trajgrad.train.demos import demo_batch
from trajgrad.train.seeding import determinism_settings
from trajgrad.train.setup import build_learner, build_tasks

runner = CliRunner()


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def test_shared_prefix_gradient_is_the_same_bits_every_time(two_threads):
    # sizes that take the multi-threaded path of the gather's backward (over 32768 elements)
    cfg = load_config(None, preset="tiny", overrides={"model.tiny.hidden_size": 64, "model.tiny.layers": 1})
    source, train, _ = build_tasks(cfg)
    st, tok = build_learner(cfg, cfg.objective())
    batch = demo_batch(tok, source, train[:32], tok.pad_token_id)
    groups = prefix_groups(batch.input_ids, batch.attention_mask)
    # the case that was not repeatable: several groups, rows of a group gathered more than once
    assert groups is not None and 1 < groups.rows.numel() < len(batch)

    def grads():
        st.model.zero_grad(set_to_none=True)
        lp = updates.logprobs(st, batch).logp
        loss = torch.where(batch.action_mask.bool(), -lp, 0.0).sum() / batch.action_mask.sum()
        loss.backward()
        return [p.grad.clone() for p in st.model.parameters() if p.grad is not None]

    first = grads()
    for _ in range(12):
        again = grads()
        assert all(torch.equal(a, b) for a, b in zip(first, again))


_SETS = ["sft.steps=3", "sft.batch_size=16", "train.steps=3", "train.prompts_per_step=3", "train.group_size=6",
         "task.n_heldout=8", "eval.before=false", "checkpoint.every=1", "checkpoint.keep=3", "log.progress=false"]


def _train(*argv):
    res = runner.invoke(app, ["train", *argv])
    assert res.exit_code == 0, (res.output[-3000:], res.exception)
    return res.output


def _metrics(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("time", "wall_time") and not k.startswith(("time/", "throughput/"))}
            for r in rows]


def _trajectories(run):
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k != "created_at" and not k.endswith("seconds")}
        return [clean(v) for v in x] if isinstance(x, list) else x

    return [clean(json.loads(line)) for line in (run / "trajectories.jsonl").read_text().splitlines()]


def _heldout(run):
    s = json.loads((run / "summary.json").read_text())
    return s["eval_after"]


@pytest.mark.slow  # about 80 s on a loaded two-core machine
def test_same_seed_same_run_with_two_threads(tmp_path, two_threads):
    sets = [a for s in _SETS for a in ("--set", s)]
    a, b = tmp_path / "a", tmp_path / "b"
    out = _train("--preset", "tiny", "--run-dir", str(a), *sets)
    assert "threads: torch intra-op 2" in out
    _train("--preset", "tiny", "--run-dir", str(b), *sets)
    ma = _metrics(a)
    assert [r["kind"] for r in ma].count("train") == 3 and any(r["kind"] == "sft" for r in ma)
    assert ma == _metrics(b)
    ta = _trajectories(a)
    assert len(ta) >= 3 * 3 * 6  # every RL rollout of the 3 steps
    assert ta == _trajectories(b)
    assert _heldout(a) == _heldout(b)
    rec = json.loads((a / "run.json").read_text())["determinism"]
    assert rec == determinism_settings() and rec["torch_threads"] == 2

    # resumed from the checkpoint after the first RL step: the remaining steps are replayed
    c = tmp_path / "c"
    shutil.copytree(a, c)
    _train("--resume", str(c), "--checkpoint", "step-000001")
    assert _metrics(c) == ma
    assert _trajectories(c) == ta
    assert _heldout(c) == _heldout(a)
