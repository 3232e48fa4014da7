"""Multi-process learners under torchrun (gloo, CPU): a killed learner stops the job, --resume continues.

The gradient equality of every loss and aggregation mode across ranks is proven in
tests/test_distributed.py; here the trainer itself runs under torchrun.
"""
import json
import math
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


@pytest.mark.slow
def test_dpo_on_two_ranks_with_unequal_shards_matches_one_process(tmp_path):
    """3 pairs per step over 2 ranks (2 + 1) and an SFT batch of 1 (one rank holds none): the
    first DPO step's loss and pair metrics equal the single-process run's (§13: the pair count
    of the whole step is the denominator; no rank trains a duplicated pair)."""
    from trajgrad.train.trainer import Trainer

    cfg = micro_config("dpo", train={"steps": 2, "prompts_per_step": 3}, sft={"steps": 2, "batch_size": 1},
                       checkpoint={"every": 0})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump()))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    job = _torchrun([str(path), "--run-dir", str(tmp_path / "two")], env)
    assert job.wait(timeout=300) == 0, job.stderr.read().decode()[-3000:]
    Trainer(cfg, tmp_path / "one", console=lambda *_: None).run()
    two = [r for r in read_metrics(tmp_path / "two") if r["kind"] == "train"]
    one = [r for r in read_metrics(tmp_path / "one") if r["kind"] == "train"]
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2]
    keys = [k for k in one[0] if k == "loss" or k.startswith("rewards/")]
    assert "loss" in keys and "rewards/margin" in keys
    for k in keys:
        assert two[0][k] == pytest.approx(one[0][k], rel=1e-5, abs=1e-6), k
    assert all(math.isfinite(r["loss"]) for r in two)


_OWNERSHIP = """
import sys
from pathlib import Path

import torch.distributed as dist

from trajgrad.train.config import load_config
from trajgrad.train.trainer import Trainer

cfg, out = load_config(sys.argv[1]), Path(sys.argv[2])
rank = int(__import__("os").environ["RANK"])
Trainer(cfg, out / f"own{rank}", console=lambda *_: None).run()
assert not dist.is_initialized(), "the group the trainer created outlived its run"
# a group the caller made is the caller's (on a port of its own: torchrun's store keeps the
# first rendezvous's keys, so a second env:// group in one process is not a clean start)
store = dist.TCPStore("127.0.0.1", int(sys.argv[3]), 2, is_master=rank == 0)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
Trainer(cfg, out / f"caller{rank}", console=lambda *_: None).run()
assert dist.is_initialized(), "the trainer destroyed the caller's group"
dist.barrier()
dist.destroy_process_group()
(out / f"ok{rank}").write_text("ok")
from trajgrad.train.run import end_distributed_worker

end_distributed_worker(0)
"""


@pytest.mark.slow
def test_trainer_destroys_the_process_group_it_created(tmp_path):
    """The group a trainer creates under torchrun is destroyed at the end of its run; a group
    that existed before the trainer is left alone. (Each process then ends with
    ``end_distributed_worker``, as ``trajgrad train``'s do.)"""
    cfg = micro_config("grpo", train={"steps": 1, "prompts_per_step": 2}, checkpoint={"every": 0})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump()))
    script = tmp_path / "own.py"
    script.write_text(_OWNERSHIP)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(script), str(path), str(tmp_path), str(_free_port())]
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def test_end_distributed_worker_flushes_and_exits_with_the_code():
    """The worker ends without the interpreter's teardown (no atexit handler runs), after
    flushing what it printed and logged."""
    code = ("import atexit, logging, sys\n"
            "from trajgrad.train.run import end_distributed_worker\n"
            "logging.basicConfig(stream=sys.stderr, level=logging.INFO)\n"
            "atexit.register(lambda: print('teardown ran'))\n"
            "sys.stdout.write('buffered, no newline')\n"
            "logging.getLogger('x').info('logged')\n"
            "end_distributed_worker(3)\n"
            "print('not reached')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3
    assert out.stdout == "buffered, no newline"
    assert "logged" in out.stderr
