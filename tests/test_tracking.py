"""Experiment trackers next to metrics.jsonl: wandb (offline), MLflow (local file store), trackio.

Each backend is driven through :class:`trajgrad.train.metrics.MetricsLogger` with the network
blocked in this process, and what it stored is read back from its own files and compared
with the JSONL records. A backend that fails at run time is disabled while JSONL keeps
every record; a backend whose package is missing is refused at config load.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import sqlite3
import struct
import uuid

import pytest

from trajgrad.train.config import load_config
from trajgrad.train.metrics import MetricsLogger, read_metrics
from trajgrad.train import tracking

RECORDS = [(1, {"loss": 0.5, "reward": {"mean": 0.25}, "note": "x"}, "train"),
           (2, {"loss": 0.375, "reward": {"mean": 0.5}}, "train"),
           (2, {"success": 0.75}, "eval"),
           (3, {"loss": 0.125, "reward": {"mean": 1.0}, "flag": None}, "train")]


@pytest.fixture
def no_network(monkeypatch):
    """Refuse any connection of this process to a non-loopback address."""
    real, real_ex = socket.socket.connect, socket.socket.connect_ex

    def check(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"network access to {address!r}")

    monkeypatch.setattr(socket.socket, "connect", lambda s, a: (check(s, a), real(s, a))[1])
    monkeypatch.setattr(socket.socket, "connect_ex", lambda s, a: (check(s, a), real_ex(s, a))[1])
    monkeypatch.setenv("WANDB_MODE", "offline")


def _expected(run_dir) -> list:
    """(step, {name: value}) per JSONL record, with eval keys under eval/ (the sinks' naming)."""
    out = []
    for r in read_metrics(run_dir):
        kind = r["kind"]
        vals = {(k if kind == "train" else f"{kind}/{k}"): float(v) for k, v in r.items()
                if k not in ("step", "kind", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        out.append((r["step"], vals))
    return out


def _read_wandb(run_dir) -> list:
    """History rows of the offline run: the .wandb file is a log of 32 KiB blocks of
    [crc u32][length u16][type u8][data] chunks (after a 7-byte header) holding Record protos."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    raw = open(path, "rb").read()
    assert raw[:4] == b":W&B"
    pos, block, chunks, rows = 7, 32768, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0 and n == 0:
            break
        chunks += raw[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(chunks)
            chunks = b""
            if rec.WhichOneof("record_type") == "history":
                item = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                step = item.pop("trainer/step")
                rows.append((step, {k: float(v) for k, v in item.items() if not k.startswith("_")}))
    return rows


def _read_mlflow(run_dir, project) -> list:
    client = tracking.mlflow_client(run_dir)
    exp = client.get_experiment_by_name(project)
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "30"  # the config went along as parameters
    got = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            got.setdefault(m.step, {})[key] = m.value
    return got


def _read_trackio(project) -> list:
    import trackio.utils

    db = sqlite3.connect(str(trackio.utils.TRACKIO_DIR / f"{project}.db"))
    rows = db.execute("SELECT step, metrics FROM metrics ORDER BY id").fetchall()
    return [(step, {k: float(v) for k, v in json.loads(m).items()}) for step, m in rows]


@pytest.mark.parametrize("backend", ["wandb", "mlflow", "trackio"])
def test_backend_offline_receives_every_record(tmp_path, no_network, backend):
    project = f"p{uuid.uuid4().hex[:8]}"
    cfg = load_config(preset="tiny", overrides={"log.backends": ["jsonl", backend], "log.project": project})
    run = tmp_path / "run"
    with MetricsLogger.for_config(run, cfg) as log:
        assert [s.name for s in log.sinks] == [backend]
        for step, metrics, kind in RECORDS:
            log.log(step, metrics, kind=kind)
        assert all(s.error is None for s in log.sinks)
    expected = _expected(run)
    assert len(expected) == 4 and expected[2] == (2, {"eval/wall_time": expected[2][1]["eval/wall_time"],
                                                      "eval/success": 0.75})
    if backend == "wandb":
        assert _read_wandb(run) == expected
    elif backend == "mlflow":
        merged = {}
        for step, vals in expected:
            merged.setdefault(step, {}).update(vals)
        assert _read_mlflow(run, project) == merged
    else:
        assert _read_trackio(project) == expected


class _Flaky(tracking.Sink):
    name = "flaky"

    def __init__(self):
        super().__init__()
        self.seen = []

    def _log(self, step, values, timestamp):
        if step == 2:
            raise OSError("disk full")
        self.seen.append(step)

    def _close(self):
        raise RuntimeError("already gone")


def test_failing_sink_is_disabled_and_jsonl_keeps_everything(tmp_path):
    flaky = _Flaky()
    with pytest.warns(UserWarning, match="log.backends: flaky disabled"):
        log = MetricsLogger(tmp_path, tensorboard=False, sinks=[flaky])
        for step, metrics, kind in RECORDS:
            log.log(step, metrics, kind=kind)
    with pytest.warns(UserWarning, match="closing flaky failed"):
        log.close()
    assert flaky.seen == [1] and flaky.error == "OSError: disk full"
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 2, 3]


def test_mlflow_store_removed_mid_run_loses_no_jsonl_record(tmp_path, no_network):
    """A real backend failing at run time: its file store disappears after the first record."""
    project = f"p{uuid.uuid4().hex[:8]}"
    cfg = load_config(preset="tiny", overrides={"log.backends": ["mlflow"], "log.project": project})
    log = MetricsLogger.for_config(tmp_path, cfg)
    log.log(*RECORDS[0][:2])
    shutil.rmtree(tmp_path / "mlruns")
    (tmp_path / "mlruns").write_text("not a directory")  # the store cannot be recreated
    with pytest.warns(UserWarning, match="log.backends: mlflow disabled"):
        for step, metrics, kind in RECORDS[1:]:
            log.log(step, metrics, kind=kind)
    assert log.sinks[0].error is not None
    with pytest.warns(UserWarning, match="closing mlflow failed"):
        log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 2, 3]


@pytest.mark.parametrize("backend, package", [("wandb", "wandb"), ("mlflow", "mlflow"), ("trackio", "trackio")])
def test_missing_package_is_refused_at_config_load(monkeypatch, backend, package):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ValueError, match=rf"^log\.backends: '{backend}' needs the '{package}' package"):
        load_config(preset="tiny", overrides={"log.backends": ["jsonl", backend]})
    with pytest.raises(ValueError, match=r"^log\.backends"):
        tracking.build_sinks([backend], "unused")


def test_bad_backend_lists_are_refused():
    with pytest.raises(ValueError, match=r"^log\.backends"):
        load_config(preset="tiny", overrides={"log.backends": ["jsonl", "neptune"]})
    with pytest.raises(ValueError, match=r"^log\.backends: lists a backend twice"):
        load_config(preset="tiny", overrides={"log.backends": ["jsonl", "jsonl"]})
    with pytest.raises(ValueError, match=r"^log\.backends: unknown backend 'neptune'"):
        tracking.build_sinks(["neptune"], "unused")


def test_tensorboard_backend_turns_tensorboard_on(tmp_path):
    cfg = load_config(preset="tiny", overrides={"log.backends": ["jsonl", "tensorboard"]})
    assert cfg.log.tensorboard is False  # the tiny preset turns the flag off
    with MetricsLogger.for_config(tmp_path, cfg) as log:
        log.log(1, {"loss": 1.0})
        assert log._tb is not None and log.sinks == []
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))


def test_trackers_are_finished_at_exit_without_close(tmp_path):
    """A run that never calls close() (a crash, a missing close) still finishes its MLflow run."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        from trajgrad.train.config import load_config
        from trajgrad.train.metrics import MetricsLogger
        cfg = load_config(preset="tiny", overrides={{"log.backends": ["mlflow"], "log.project": "atexit"}})
        log = MetricsLogger.for_config({str(tmp_path)!r}, cfg)
        log.log(1, {{"loss": 0.5}})
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    client = tracking.mlflow_client(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("atexit").experiment_id])
    assert run.info.status == "FINISHED" and run.data.metrics == {"loss": 0.5, "wall_time": run.data.metrics["wall_time"]}
