"""SAO kill-and-resume on Ray (§20): 2 rollout workers, the tiny model, one Ray cluster.

One run, killed twice with SIGKILL and resumed twice:

A. ``trajgrad train`` (a child process) checkpoints step 2 with a non-empty buffer (it waits
   for one episode to finish before that checkpoint) and is killed inside update 3, after
   that update's trajectories were logged;
B. ``trajgrad train --resume`` (a child process) continues from step 2 and is killed while it
   writes the checkpoint of step 4 (after the buffer file, before the manifest);
C. an in-process resume from step 3 trains to step 5.

The child processes stop at their kill point and print a line; the test then sends SIGKILL.
The kill points are test-only wrappers in the child's script (no hook in trajgrad).
Checked: nothing lost (every data position drawn is trained, dropped with a reason, or still
buffered or in flight in the last checkpoint, exactly once), nothing trained twice (log and
ledger), the lag of every trained trajectory within ``max_lag`` of the restored versions, the
in-flight episodes re-run and counted (``faults/rerun_on_resume``), none lost on resume.
"""
from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter

import pytest

from trajgrad.rollout import read_trajectories
from trajgrad.train.async_state import episode_index, load_async_state
from trajgrad.train.asynchronous import AsyncTrainer
from trajgrad.train.checkpoint import latest_checkpoint
from trajgrad.train.config import build_config
from trajgrad.train.metrics import read_metrics

STEPS = 5

_CHILD = textwrap.dedent(
    """
    import sys, time
    from trajgrad.train import _checkpoint_files as F, run
    from trajgrad.train.async_trainer import AsyncTrainer
    from trajgrad.train.trainer import Trainer

    mode, run_dir, config, k = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

    def stop_here(what):
        print("KILL-POINT", what, flush=True)
        time.sleep(300)  # the test sends SIGKILL now

    if mode == "buffer":
        save, learn = AsyncTrainer.save, Trainer.learn

        def save_after_a_finish(self):  # step k's checkpoint: a full queue, one episode finished on a worker
            if self.trainer.step == k:  # (the episodes queued behind it on its worker are still running)
                import ray
                self._fill()
                ray.wait(list(self.pool.jobs), num_returns=1, timeout=60)
            return save(self)

        def learn_or_stop(self, trajs):  # update k+1: its trajectories are logged, the update not done
            if self.step == k:
                stop_here("update")
            return learn(self, trajs)

        AsyncTrainer.save, Trainer.learn = save_after_a_finish, learn_or_stop
        run.main(config=config, run_dir=run_dir)
    else:
        write = F._write_bytes

        def write_or_stop(path, data):  # step k's checkpoint: every file written but the manifest
            if path.name == "manifest.json" and f"step-{k:06d}" in path.parent.name:
                stop_here("checkpoint")
            return write(path, data)

        F._write_bytes = write_or_stop
        run.main(resume=run_dir)
    """
)


def _data(address):
    return {
        "name": "async-resume-test",
        "model": {"name": "tiny", "dtype": "float32", "lora": None, "tiny": {"hidden_size": 32, "layers": 1, "heads": 2}},
        "task": {"name": "guess", "n_train": 64, "n_heldout": 2,
                 "options": {"upper": 8, "max_turns": 2, "few_shot": False}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 6},
        "recipe": {"name": "sao"},
        "train": {"steps": STEPS, "prompts_per_step": 1, "micro_batch_size": 4},
        "critic": {"warmup_steps": 0},
        "sft": {"steps": 0},
        "eval": {"before": False, "after": False, "every": 0},
        "checkpoint": {"every": 1},
        "log": {"tensorboard": False, "progress": False},
        "asynchronous": {"enabled": True, "workers": 2, "max_lag": 1, "batch_trajectories": 2, "queue_size": 4,
                         "ray_address": address, "env_latency": {"mu": math.log(0.15), "sigma": 0.0}},
    }


def _kill_at_point(tmp_path, mode, run_dir, config, k, timeout=120.0):
    """Run the child until it prints its kill point, then SIGKILL it."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TQDM_DISABLE="1")
    proc = subprocess.Popen([sys.executable, str(script), mode, str(run_dir), str(config), str(k)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline().decode(errors="replace") if ready else ""
            if not line and proc.poll() is not None:
                break
            out.append(line)
            if line.startswith("KILL-POINT"):
                os.kill(proc.pid, signal.SIGKILL)
                assert proc.wait(timeout=30) == -signal.SIGKILL
                return
        pytest.fail(f"the {mode} run never reached its kill point:\n" + "".join(out)[-4000:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.fixture(scope="module")
def ray_address():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _trained_lines(run_dir):
    return [t for t in read_trajectories(run_dir / "trajectories.jsonl") if t.metadata["async"]["status"] == "trained"]


@pytest.fixture(scope="module")
def killed_twice(ray_address, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    run_dir, config = tmp / "run", tmp / "config.json"
    config.write_text(json.dumps(_data(ray_address)))
    t0 = time.perf_counter()
    rec = {}
    # A: killed inside update 3; the checkpoint of step 2 holds a non-empty buffer
    _kill_at_point(tmp, "buffer", run_dir, config, 2)
    rec["phase_seconds"] = {"A": time.perf_counter() - t0}
    ck2 = latest_checkpoint(run_dir)
    rec["A"] = load_async_state(ck2)
    rec["A_logged_after_ckpt"] = len(read_trajectories(run_dir / "trajectories.jsonl")) - \
        json.loads((ck2 / "extra.json").read_text())["trajectory_offset"]
    # B: resumed from step 2, killed while writing the checkpoint of step 4
    _kill_at_point(tmp, "checkpoint", run_dir, config, 4)
    rec["phase_seconds"]["B"] = time.perf_counter() - t0 - rec["phase_seconds"]["A"]
    ck3 = latest_checkpoint(run_dir)
    rec["B"] = load_async_state(ck3)
    rec["torn"] = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-step-000004")]
    rec["torn_files"] = sorted(f.name for p in rec["torn"] for f in p.iterdir())
    # C: resumed in-process from step 3, trains to the end
    lines = []
    at = AsyncTrainer(build_config(_data(ray_address)), run_dir, resume=True, console=lines.append)
    rec["C_resumed_from"] = at.trainer.resumed_from.name
    rec["C_rerun"] = [f.key for f, _task in at._rerun]
    rec["C_pending"] = [i.key for i in at.gate.pending]
    rec["C_console"] = lines
    rec["summary"] = at.run()
    rec["final"] = load_async_state(latest_checkpoint(run_dir))
    rec["cursor"] = at.trainer.cursor
    rec["seconds"] = time.perf_counter() - t0
    rec["phase_seconds"]["C"] = rec["seconds"] - rec["phase_seconds"]["A"] - rec["phase_seconds"]["B"]
    print("kill-and-resume seconds:", {k: round(v, 1) for k, v in rec["phase_seconds"].items()},
          "total", round(rec["seconds"], 1), "load", os.getloadavg())  # shown with pytest -s
    return run_dir, ck2, ck3, rec


def test_kill_with_a_non_empty_buffer_then_resume(killed_twice):
    run_dir, ck2, _, rec = killed_twice
    A, B = rec["A"], rec["B"]
    assert ck2.name == "step-000002" and A.step == 2
    assert len(A.buffer) >= 1  # finished but untrained episodes at the kill
    assert len(A.in_flight) + len(B.in_flight) >= 1  # and episodes in flight (the queue was full at step 2's)
    assert rec["A_logged_after_ckpt"] >= 1  # the killed update had logged trajectories: cut on resume, trained again
    # B trained step 3 from that checkpoint: each buffered episode trained or dropped for its lag, once
    logged = read_trajectories(run_dir / "trajectories.jsonl")
    for key, raw in A.buffer:
        statuses = [t.metadata["async"]["status"] for t in logged if t.metadata["async"]["key"] == key]
        assert statuses in (["trained"] * len(raw), ["dropped_lag"] * len(raw)), (key, statuses)
    # A's in-flight episodes ran again in B (counted), none lost
    assert B.counters["rerun_on_resume"] == len(A.in_flight) and B.counters["lost_on_resume"] == 0
    assert {f.key for f in A.in_flight} <= {t.metadata["async"]["key"] for t in logged} | \
        {k for k, _ in B.buffer} | {f.key for f in B.in_flight} | {k for k, _ in rec["final"].buffer} | \
        {f.key for f in rec["final"].in_flight}


def test_kill_during_a_checkpoint_write_leaves_the_previous_one(killed_twice):
    run_dir, _, ck3, rec = killed_twice
    # the checkpoint of step 4 was torn (its async_state.json written, no manifest) and not used
    assert ck3.name == "step-000003" and rec["C_resumed_from"] == "step-000003"
    assert len(rec["torn"]) == 1 and "async_state.json" in rec["torn_files"] and "manifest.json" not in rec["torn_files"]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]  # swept by C's saves
    assert rec["C_rerun"] == [f.key for f in rec["B"].in_flight]
    assert any("run again from their tasks" in ln for ln in rec["C_console"])


def test_nothing_lost_nothing_trained_twice_lag_bounded(killed_twice):
    run_dir, _, _, rec = killed_twice
    final, summary = rec["final"], rec["summary"]
    assert summary["steps"] == STEPS and final.step == STEPS
    logged = read_trajectories(run_dir / "trajectories.jsonl")
    status = Counter()
    settled = {}
    for t in logged:
        a = t.metadata["async"]
        status[a["status"]] += 1
        prev = settled.setdefault(a["key"], a["status"])
        assert prev == a["status"], f"{a['key']} logged as {prev} and {a['status']}"
    trained = _trained_lines(run_dir)
    pairs = [(t.metadata["async"]["key"], t.segment) for t in trained]
    assert len(pairs) == len(set(pairs))  # 0 duplicated
    assert {episode_index(k) for k, _ in pairs} == set(range(rec["cursor"])) & _members(final.trained)  # the ledger agrees
    # 0 lost: every data position drawn is settled in the log, or buffered / in flight in the last checkpoint, once
    rest = [k for k, _ in final.buffer] + [f.key for f in final.in_flight]
    positions = [episode_index(k) for k in settled] + [episode_index(k) for k in rest]
    assert sorted(positions) == list(range(rec["cursor"]))
    assert summary["lost_episodes"] == 0 and summary["lost_on_resume"] == 0
    # the staleness limit after each restore: lags recomputed from the turns, against versions that continue
    for t in trained:
        a = t.metadata["async"]
        assert a["lag"] == a["learner_version"] - min(x.policy_version for x in t.turns) <= 1
    assert sorted({t.metadata["async"]["learner_version"] for t in trained}) == list(range(STEPS))
    rows = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    expected_rerun = len(rec["A"].in_flight) + len(rec["B"].in_flight)
    assert rows[-1]["faults/rerun_on_resume"] == summary["rerun_on_resume"] == expected_rerun >= 1
    assert rows[-1]["faults/lost_on_resume"] == 0 and rows[-1]["lag/max"] <= 1


def _members(index_set):
    return {i for a, b in index_set.ranges() for i in range(a, b)}
