"""Multi-process learners under torchrun (gloo, CPU): a killed learner stops the job, --resume continues.

The gradient equality of every loss and aggregation mode across ranks is proven in
tests/test_distributed.py; here the trainer itself runs under torchrun.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from trajgrad.rollout import read_trajectories
from trajgrad.train.metrics import read_metrics

sys.path.insert(0, os.path.dirname(__file__))
from test_train import micro_config  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args, env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           "-m", "trajgrad", "train", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


@pytest.mark.slow
def test_killed_learner_stops_job_and_resume_continues(tmp_path):
    cfg = micro_config("grpo", train={"steps": 4, "prompts_per_step": 4}, checkpoint={"every": 1})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump()))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    run = tmp_path / "run"
    job = _torchrun([str(path), "--run-dir", str(run)], env)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline:
        if metrics.exists() and sum('"train"' in line for line in metrics.read_text().splitlines()) >= 2:
            break
        assert job.poll() is None, job.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    workers = _children(job.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)  # one learner process dies
    rc = job.wait(timeout=120)  # torchrun tears the job down and reports the failure
    assert rc != 0
    done = [r["step"] for r in read_metrics(run) if r["kind"] == "train"]
    assert done and max(done) < 4

    resumed = _torchrun(["--resume", str(run)], env)
    assert resumed.wait(timeout=240) == 0, resumed.stderr.read().decode()[-3000:]
    steps = [r["step"] for r in read_metrics(run) if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4]  # no step lost, none repeated
    for rank in (0, 1):
        trajs = read_trajectories(run / f"trajectories.rank{rank}.jsonl")
        assert len(trajs) == 4 * (cfg.train.prompts_per_step // 2) * cfg.objective().group_size
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4
