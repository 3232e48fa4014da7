"""Run directories under kills and corruption: every case ends in a run identical to an
uninterrupted one, or in one clear error line with every file left exactly as it was.

Kills are real: a child process runs ``trajgrad train`` and SIGKILLs itself at a chosen
point (during a step, half-way through a trajectory line, during a checkpoint write,
during the SFT warm start, during the final evaluation). Corruptions are made by hand on
a killed run: torn, garbage and missing log lines, truncated and same-size-corrupted
weights, optimizer and RNG state, a deleted or garbage ``latest``, foreign configs.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner
from safetensors.torch import load_file

from trajgrad.cli import app
from trajgrad.rollout import read_trajectories
from trajgrad.train.config import build_config
from trajgrad.train.metrics import read_metrics
from trajgrad.train.rundir import check_resume, config_diff, config_fingerprint
from trajgrad.train.runlock import LOCK_FILE

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()
STEPS = 4

_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    mode, at = sys.argv[1], int(sys.argv[2])
    count = [0]

    def hit():
        count[0] += 1
        return count[0] == at

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if mode in ("step", "torn"):
        from trajgrad.rollout.trajectory import TrajectoryLog
        orig_extend = TrajectoryLog.extend

        def extend(self, trajs):
            trajs = list(trajs)
            if hit():
                if mode == "torn":  # half a line on disk, then the kill
                    self._file.write(trajs[0].to_json().encode()[:40]); self._file.flush(); os.fsync(self._file.fileno())
                    die()
                out = orig_extend(self, trajs)
                die()  # the step's trajectories are logged, its update is not done
            return orig_extend(self, trajs)
        TrajectoryLog.extend = extend
    elif mode == "ckpt":  # inside a checkpoint write: weights written, optimizer state not yet
        import trajgrad.train._checkpoint_files as F
        orig_write = F._write_torch

        def write(path, obj):
            if hit():
                die()
            return orig_write(path, obj)
        F._write_torch = write
    elif mode in ("sft", "eval_after"):
        from trajgrad.train import trainer as T
        from trajgrad.train.trainer import Trainer
        orig_demo, orig_eval = T.demo_batch, Trainer.evaluate

        def demo(*args, **kwargs):
            if mode == "sft" and hit():
                die()
            return orig_demo(*args, **kwargs)

        def evaluate(self, tag):
            if mode == "eval_after" and tag == "after":
                die()
            return orig_eval(self, tag)
        T.demo_batch, Trainer.evaluate = demo, evaluate
    from trajgrad.cli import main
    sys.argv = ["trajgrad", "train", *sys.argv[3:]]
    main()
    """
)


def _config_data():
    data = {
        "name": "kill-test",
        "model": {"name": "tiny", "dtype": "float32", "lora": None,
                  "tiny": {"hidden_size": 32, "layers": 1, "heads": 2}},
        "task": {"name": "calculator", "n_train": 64, "n_heldout": 4,
                 "options": {"few_shot": False, "system_prompt": "", "max_turns": 2, "min_ops": 1, "max_ops": 1,
                             "max_operand": 9}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "recipe": {"name": "grpo"},
        "train": {"steps": STEPS, "prompts_per_step": 2, "group_size": 2, "micro_batch_size": 4},
        "sft": {"steps": 3, "batch_size": 4},  # checkpointed after SFT steps 1 and 2
        "eval": {"before": False, "after": True, "every": 0},
        "checkpoint": {"every": 1, "keep": 2},
        "log": {"tensorboard": False, "progress": False},
    }
    build_config(data)
    return data


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    cfg = root / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(_config_data()))
    child = root / "child.py"
    child.write_text(_CHILD)
    ref = root / "reference"
    _ok(["train", str(cfg), "--run-dir", str(ref)])
    return {"root": root, "cfg": cfg, "child": child, "ref": ref, "n": [0]}


def _fresh(env, name):
    env["n"][0] += 1
    return env["root"] / f"{name}-{env['n'][0]}"


def _ok(argv):
    res = runner.invoke(app, argv)
    assert res.exit_code == 0, (res.output[-3000:], res.exception)
    return res


def _error(argv, *needles):
    res = runner.invoke(app, argv)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (res.output[-3000:], res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _kill(env, run_dir, mode, at, *extra):
    proc = subprocess.run(
        [sys.executable, str(env["child"]), mode, str(at), str(env["cfg"]), "--run-dir", str(run_dir), *extra],
        env=dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"), capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-3000:]


def _files(run_dir):
    # the writer's lock file names its latest holder (trajgrad.train.runlock), not run data
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in ("time", "wall_time") and not k.startswith(("time/", "throughput/"))}
            for r in rows]


def _assert_same_run(a, b):
    ra, rb = _strip(read_metrics(a)), _strip(read_metrics(b))
    assert [(r["kind"], r["step"]) for r in ra] == [(r["kind"], r["step"]) for r in rb]
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], float):
                assert x[k] == y[k] or (math.isnan(x[k]) and math.isnan(y[k])), (x["kind"], x["step"], k, x[k], y[k])
            else:
                assert x[k] == y[k], (x["step"], k)
    ta = [(t.task_id, t.token_ids()) for t in read_trajectories(a / "trajectories.jsonl")]
    tb = [(t.task_id, t.token_ids()) for t in read_trajectories(b / "trajectories.jsonl")]
    assert ta == tb  # no duplicate, no missing trajectory
    wa = load_file(str(a / "checkpoints" / f"step-{STEPS:06d}" / "modules" / "policy.safetensors"))
    wb = load_file(str(b / "checkpoints" / f"step-{STEPS:06d}" / "modules" / "policy.safetensors"))
    assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)  # bitwise
    assert json.loads((a / "summary.json").read_text()) == json.loads((b / "summary.json").read_text())


@pytest.fixture(scope="module")
def killed(env):
    """A run killed during step 3 (checkpoints of steps 1 and 2 on disk, step 3's trajectories logged)."""
    run = env["root"] / "killed-base"
    _kill(env, run, "step", 3)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000002"
    return run


def _copy(env, killed, name):
    dst = _fresh(env, name)
    shutil.copytree(killed, dst)
    return dst




# ------------------------------------------------------------------ kills: resume gives the same run


# ("ckpt", 5): inside the second SFT checkpoint (each SFT checkpoint writes the RL and SFT
# optimizers and the RNG state); ("ckpt", 10): inside step 1's checkpoint, after the RL one
# of step 0; ("sft", 2) / ("sft", 3): during SFT steps 2 / 3, resumed from the SFT checkpoint
@pytest.mark.parametrize("mode,at", [("step", 3), ("torn", 2), ("ckpt", 5), ("ckpt", 10), ("eval_after", 1),
                                     ("sft", 2), ("sft", 3)])
def test_kill_then_resume_is_identical(env, mode, at):
    run = _fresh(env, f"kill-{mode}")
    _kill(env, run, mode, at)
    _ok(["train", "--resume", str(run)])
    _assert_same_run(env["ref"], run)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # leftovers swept


def test_kill_before_the_first_sft_checkpoint_then_restart(env):
    run = _fresh(env, "kill-sft")
    _kill(env, run, "sft", 1)
    before = _files(run)
    _error(["train", "--resume", str(run)], "no checkpoint", "--overwrite")
    _error(["train", str(env["cfg"]), "--run-dir", str(run)], "run_dir", "--resume", "--overwrite")
    assert _files(run) == before
    _ok(["train", str(env["cfg"]), "--run-dir", str(run), "--overwrite"])
    _assert_same_run(env["ref"], run)  # no record of the dead attempt is kept


# ------------------------------------------------------------------ log damage


def test_torn_metrics_line_resumes_identically(env, killed):
    run = _copy(env, killed, "torn-metrics")
    with open(run / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"step": 3, "kind": "tr')
    _ok(["train", "--resume", str(run)])
    _assert_same_run(env["ref"], run)


@pytest.mark.parametrize("log", ["trajectories.jsonl", "metrics.jsonl"])
@pytest.mark.parametrize("damage", ["garbage", "missing", "not-an-object"])
def test_damaged_log_is_refused_and_left_alone(env, killed, log, damage):
    run = _copy(env, killed, f"{damage}-{log}")
    path = run / log
    lines = path.read_bytes().splitlines(keepends=True)
    if damage == "garbage":
        lines[1] = b"\x00garbage{{\n"
    elif damage == "not-an-object":
        lines[1] = b"[1, 2, 3]\n"
    else:
        lines = lines[:1]
    path.write_bytes(b"".join(lines))
    before = _files(run)
    _error(["train", "--resume", str(run)], log, "left as it is")
    assert _files(run) == before


# ------------------------------------------------------------------ checkpoint damage


@pytest.mark.parametrize("target", ["modules/policy.safetensors", "optimizers/policy.pt", "rng.pt", "extra.json"])
@pytest.mark.parametrize("damage", ["same-size", "truncated"])
def test_damaged_checkpoint_is_named_and_the_older_one_resumes_identically(env, killed, target, damage):
    run = _copy(env, killed, f"ckpt-{damage}")
    path = run / "checkpoints" / "step-000002" / target
    data = bytearray(path.read_bytes())
    if damage == "same-size":
        i = len(data) - 3 if target == "extra.json" else len(data) // 2
        data[i] = (data[i] + 1) % 256
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(bytes(data[: len(data) // 2]))
    before = _files(run)
    _error(["train", "--resume", str(run)], target.split("/")[-1], "--checkpoint step-000001")
    assert _files(run) == before  # nothing truncated or rewritten
    _ok(["train", "--resume", str(run), "--checkpoint", "step-000001"])
    _assert_same_run(env["ref"], run)


def test_missing_latest_resumes_from_the_newest_checkpoint(env, killed):
    run = _copy(env, killed, "no-latest")
    (run / "checkpoints" / "latest").unlink()
    plan = check_resume(run)
    assert plan.repoint and plan.checkpoint.name == "step-000002"
    assert any("latest is missing" in n and "step-000002" in n for n in plan.notes)
    _ok(["train", "--resume", str(run)])
    assert (run / "checkpoints" / "latest").exists()
    _assert_same_run(env["ref"], run)


def test_garbage_latest_is_refused_offering_the_newest_intact(env, killed):
    run = _copy(env, killed, "bad-latest")
    (run / "checkpoints" / "latest").write_bytes(b"../../etc\n")
    before = _files(run)
    _error(["train", "--resume", str(run)], "latest", "--checkpoint step-000002")
    assert _files(run) == before


def test_every_checkpoint_damaged_says_start_again(env, killed):
    run = _copy(env, killed, "all-bad")
    for step in (1, 2):
        (run / "checkpoints" / f"step-{step:06d}" / "rng.pt").write_bytes(b"x")
    before = _files(run)
    _error(["train", "--resume", str(run)], "rng.pt", "no intact checkpoint", "--overwrite")
    assert _files(run) == before


# ------------------------------------------------------------------ foreign configs and occupied directories


def test_resume_with_another_config_is_refused_listing_the_keys(env, killed):
    run = _copy(env, killed, "foreign")
    before = _files(run)
    _error(["train", "--resume", str(run), "--set", "optim.lr=0.01"], "optim.lr: 0.0005 -> 0.01",
           "--allow-config-change")
    _error(["train", "--resume", str(run), "--preset", "tiny"], "model.tiny.hidden_size: 32 -> 96")
    cfg = json.loads((run / "config.json").read_text())
    cfg["sampling"]["temperature"] = 0.5
    (run / "config.json").write_text(json.dumps(cfg))  # edited by hand
    _error(["train", "--resume", str(run)], "sampling.temperature: 1.0 -> 0.5")
    assert {k: v for k, v in _files(run).items() if k != "config.json"} == \
        {k: v for k, v in before.items() if k != "config.json"}


def test_allowed_config_change_is_recorded(env, killed):
    run = _copy(env, killed, "allowed")
    _ok(["train", "--resume", str(run), "--set", "train.steps=5", "--allow-config-change"])
    record = json.loads((run / "run.json").read_text())
    assert record["config"]["train"]["steps"] == 5 and record["config_sha256"] == config_fingerprint(record["config"])
    assert record["history"][-1]["changed"] == ["train.steps: 4 -> 5"]
    assert [r["step"] for r in read_metrics(run, kind="train")] == [1, 2, 3, 4, 5]
    # the run continues under its new config from now on
    _error(["train", "--resume", str(run), "--set", "train.steps=4"], "train.steps: 5 -> 4")


def test_new_run_into_an_existing_run_is_refused_then_overwritten(env, killed):
    run = _copy(env, killed, "occupied")
    before = _files(run)
    _error(["train", str(env["cfg"]), "--run-dir", str(run)], "not empty", "--resume", "--overwrite")
    _error(["train", "--preset", "tiny", "--run-dir", str(run)], "not empty")
    assert _files(run) == before
    _ok(["train", str(env["cfg"]), "--run-dir", str(run), "--overwrite"])
    _assert_same_run(env["ref"], run)
    assert not list(run.parent.glob(f".{run.name}.overwritten-*"))


def test_resume_checks_the_world_size_before_anything(env, killed):
    with pytest.raises(ValueError, match="used 1 process.*not 2"):
        check_resume(killed, world_size=2)
    plan = check_resume(killed)
    assert plan.step == 2 and plan.checkpoint.name == "step-000002" and not plan.repoint
    assert any("dropped from the log and sampled again" in n for n in plan.notes)


def test_config_diff_names_dotted_keys():
    a = {"train": {"steps": 3, "seed": 0}, "task": {"options": {"max_turns": 2}}}
    b = {"train": {"steps": 4, "seed": 0}, "task": {"options": {"max_turns": 2, "few_shot": False}}}
    assert config_diff(a, b) == ["task.options.few_shot: (absent) -> False", "train.steps: 3 -> 4"]
    assert config_diff(a, a) == []
    assert config_fingerprint(a) != config_fingerprint(b)


class _Boom(Exception):
    pass


def _failing_trainer(monkeypatch):
    import trajgrad.train.run as run_mod  # where run.main looks the trainer up

    def boom(*args, **kwargs):
        raise _Boom("the trainer could not start")

    monkeypatch.setattr(run_mod, "Trainer", boom)


def test_a_start_that_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    from trajgrad.train.run import main

    _failing_trainer(monkeypatch)
    with pytest.raises(_Boom):
        main(preset="tiny", run_dir=tmp_path / "new")
    assert list(tmp_path.iterdir()) == []


def test_an_overwrite_that_fails_to_start_puts_the_old_run_back(env, killed, monkeypatch):
    from trajgrad.train.run import main

    run = _copy(env, killed, "overwrite-fails")
    before = _files(run)
    _failing_trainer(monkeypatch)
    with pytest.raises(_Boom):
        main(config=env["cfg"], run_dir=run, overwrite=True)
    assert _files(run) == before
    assert not list(run.parent.glob(f".{run.name}.overwritten-*"))
