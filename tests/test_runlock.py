"""One writer per run directory (trajgrad.train.runlock): real processes hold and contend
for the flock; a second writer is refused with one line naming the holder; a holder
killed with SIGKILL leaves nothing stale."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trajgrad.train.runlock import LOCK_FILE, RunDirLocked, lock_run_dir

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")

# The lock module alone, loaded from its file (without the package's heavy imports).
LOAD = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("runlock", {SRC + '/trajgrad/train/runlock.py'!r})
runlock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runlock)
"""
HOLD = LOAD + """
lock = runlock.lock_run_dir(sys.argv[1])
print('locked', flush=True)
time.sleep(120)
"""


def _holder(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, env=ENV, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _train(*args):
    return subprocess.run([sys.executable, "-m", "trajgrad", "train", *args], capture_output=True, text=True,
                          env=ENV, timeout=120)


def test_a_second_writer_is_refused_with_one_line_and_a_killed_holder_leaves_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = _holder(run)
    try:
        record = json.loads((run / LOCK_FILE).read_text())
        assert record["pid"] == holder.pid
        res = _train("--resume", str(run))
        lines = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
        assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
        expected = f"error: run_dir: {run} is being written by another trajgrad process (pid {holder.pid} on "
        assert lines[0].startswith(expected)
        assert "started " in lines[0] and " UTC)" in lines[0] and "Traceback" not in res.stderr
        # A new run with --overwrite into the live run is refused the same way.
        from trajgrad.train.run import main

        with pytest.raises(RunDirLocked, match=f"pid {holder.pid} on "):
            main(preset="tiny", run_dir=run, overwrite=True)
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]
        with pytest.raises(RunDirLocked, match=f"pid {holder.pid} on "):
            lock_run_dir(run)  # another open file description, even in this process
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The kernel released the dead holder's lock: the next writer takes it at once.
    second = _holder(run)
    try:
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == second.pid
    finally:
        second.kill()
        second.wait()


def test_the_lock_is_released_when_the_holder_lets_go(tmp_path):
    with lock_run_dir(tmp_path) as lock:
        assert lock.held
    again = lock_run_dir(tmp_path)
    assert again.held
    again.release()
    assert lock_run_dir(tmp_path / "missing") is None  # nothing to lock yet


def test_the_training_process_holds_the_lock_while_it_trains(tmp_path, monkeypatch):
    """trajgrad train's own process holds the lock while the trainer runs (checked from
    another process), and lets it go when it ends."""
    import trajgrad.train.run as run_mod  # where run.main looks the trainer up
    from trajgrad.train.run import main

    seen = {}

    class Probe:
        def __init__(self, cfg, out_dir, **kwargs):
            self.out_dir = out_dir

        def run(self):
            probe = LOAD + "runlock.lock_run_dir(sys.argv[1])"
            res = subprocess.run([sys.executable, "-c", probe, str(self.out_dir)], capture_output=True, text=True,
                                 env=ENV, timeout=60)
            seen["stderr"] = res.stderr

    monkeypatch.setattr(run_mod, "Trainer", Probe)
    run = tmp_path / "run"
    assert main(preset="tiny", run_dir=run) == 0
    assert f"is being written by another trajgrad process (pid {os.getpid()} on " in seen["stderr"]
    assert lock_run_dir(run).held  # released at the end


def test_two_processes_racing_for_one_directory_get_one_lock(tmp_path):
    racer = LOAD + """
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
try:
    lock = runlock.lock_run_dir(sys.argv[1])
    print('won', flush=True)
except runlock.RunDirLocked:
    print('lost', flush=True)
time.sleep(60)  # the winner holds the lock until the test ends it
"""
    at = str(time.time() + 1.0)
    procs = [subprocess.Popen([sys.executable, "-c", racer, str(tmp_path), at], stdout=subprocess.PIPE, text=True,
                              env=ENV) for _ in range(3)]
    try:
        outcomes = sorted(p.stdout.readline().strip() for p in procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert outcomes == ["lost", "lost", "won"]
