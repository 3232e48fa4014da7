"""MetricsLogger / read_metrics: round trip, torn lines, resume truncation, bad input."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.train.metrics import METRICS_FILE, MetricsLogger, read_metrics


def test_round_trip_converts_values(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        assert logger.offset == 0
        logger.log(
            0,
            {
                "loss": torch.tensor(0.25),
                "tokens": torch.tensor(12),
                "reward": {"mean": np.float32(0.5), "max": 1},
                "done": True,
                "phase": "warmup",
                "nothing": None,
                "arr": np.array([3.5]),
            },
        )
        logger.log(1, {"loss": 0.125})
        logger.log(1, {"success": 0.75}, kind="eval")
        assert logger.offset == 3
    records = read_metrics(tmp_path)
    assert len(records) == 3
    first = records[0]
    assert first["step"] == 0 and first["kind"] == "train"
    assert first["loss"] == 0.25 and isinstance(first["loss"], float)
    assert first["tokens"] == 12 and isinstance(first["tokens"], int)
    assert first["reward/mean"] == 0.5 and first["reward/max"] == 1
    assert first["done"] is True and first["phase"] == "warmup" and first["nothing"] is None
    assert first["arr"] == 3.5
    assert records[1]["loss"] == 0.125
    assert [r["success"] for r in read_metrics(tmp_path, kind="eval")] == [0.75]
    assert [r["step"] for r in read_metrics(tmp_path, kind="train")] == [0, 1]
    # time and wall_time are recorded and non-decreasing
    walls = [r["wall_time"] for r in records]
    assert walls == sorted(walls) and walls[0] >= 0.0
    assert all(r["time"] > 1.6e9 for r in records)
    # read_metrics also accepts the file itself
    assert read_metrics(tmp_path / METRICS_FILE) == records


def test_each_line_is_on_disk_when_log_returns(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(3, {"x": 1.0})
    # Read by a second reader while the logger is still open.
    lines = (tmp_path / METRICS_FILE).read_bytes().splitlines(keepends=True)
    assert len(lines) == 1 and lines[0].endswith(b"\n") and json.loads(lines[0])["x"] == 1.0
    logger.close()
    assert logger.closed


def test_nan_and_inf_values_round_trip(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(0, {"loss": float("nan"), "ratio_max": float("inf")})
    (record,) = read_metrics(tmp_path)
    assert math.isnan(record["loss"]) and record["ratio_max"] == math.inf


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.dictionaries(
            st.text(alphabet="abcdefghij_/", min_size=1, max_size=8).filter(
                lambda k: k not in ("step", "kind", "time", "wall_time") and "//" not in k
            ),
            st.floats(allow_nan=False, allow_infinity=False, width=64),
            max_size=5,
        ),
        min_size=1,
        max_size=6,
    )
)
def test_property_float_values_round_trip_exactly(tmp_path_factory, rows):
    run_dir = tmp_path_factory.mktemp("prop")
    with MetricsLogger(run_dir, tensorboard=False) as logger:
        for step, row in enumerate(rows):
            logger.log(step, row)
    records = read_metrics(run_dir)
    assert len(records) == len(rows)
    for step, (row, record) in enumerate(zip(rows, records)):
        assert record["step"] == step
        for key, value in row.items():
            assert record[key] == value  # repr of a float64 round-trips exactly


def test_torn_last_line_is_ignored_and_repaired(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(3):
            logger.log(step, {"loss": float(step)})
    path = tmp_path / METRICS_FILE
    with open(path, "ab") as fh:
        fh.write(b'{"step": 3, "kind": "train", "lo')  # a crash in the middle of a write
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]

    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        assert logger.offset == 3
        logger.log(3, {"loss": 3.0})
        assert logger.offset == 4
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert path.read_bytes().count(b"\n") == 4


def test_resume_offset_truncates_to_the_checkpointed_lines(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(4):
            logger.log(step, {"loss": float(step)})
        saved_offset = logger.offset  # what a checkpoint at step 3 stores
        for step in range(4, 7):
            logger.log(step, {"loss": float(step)})
    with open(tmp_path / METRICS_FILE, "ab") as fh:
        fh.write(b'{"step": 7')
    kept_wall = read_metrics(tmp_path)[saved_offset - 1]["wall_time"]

    with MetricsLogger(tmp_path, tensorboard=False, resume_offset=saved_offset) as logger:
        assert logger.offset == 4
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
        record = logger.log(4, {"loss": 40.0})
        assert record["wall_time"] >= kept_wall  # wall-clock continues, it does not restart
        assert logger.offset == 5
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[-1]["loss"] == 40.0

    with MetricsLogger(tmp_path, tensorboard=False, resume_offset=0) as logger:
        assert logger.offset == 0
    assert read_metrics(tmp_path) == []


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        for step in range(4):
            logger.log(step, {"loss": float(step), "phase": "a"})
        logger.log(3, {"success": 0.5}, kind="eval")
        offset = logger.offset - 3  # resume after step 1 (lines 0 and 1 kept)
    with MetricsLogger(tmp_path, resume_offset=offset) as logger:
        logger.log(2, {"loss": 20.0})
    acc = EventAccumulator(str(tmp_path / "tb"), purge_orphaned_data=True)
    acc.Reload()
    if "eval/success" in acc.Tags()["scalars"]:  # logged at step 3, after the resume point
        assert acc.Scalars("eval/success") == []
    loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert loss == {0: 0.0, 1: 1.0, 2: 20.0}


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="run_dir"):
        read_metrics(tmp_path / "missing")
    with pytest.raises(ValueError, match="run_dir"):
        MetricsLogger(None)
    with pytest.raises(ValueError, match="resume_offset"):
        MetricsLogger(tmp_path, tensorboard=False, resume_offset=-1)
    with pytest.raises(ValueError, match="resume_offset"):
        MetricsLogger(tmp_path / "fresh", tensorboard=False, resume_offset=2)

    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(0, {"a": 1.0})
    with pytest.raises(ValueError, match="step"):
        logger.log(-1, {"a": 1.0})
    with pytest.raises(ValueError, match="step"):
        logger.log(1.5, {"a": 1.0})
    with pytest.raises(ValueError, match="step"):
        logger.log(True, {"a": 1.0})
    with pytest.raises(ValueError, match="kind"):
        logger.log(1, {"a": 1.0}, kind="")
    with pytest.raises(ValueError, match="metrics"):
        logger.log(1, [("a", 1.0)])
    with pytest.raises(ValueError, match="metrics"):
        logger.log(1, {"step": 3})
    with pytest.raises(ValueError, match="metrics"):
        logger.log(1, {"v": torch.ones(2)})
    with pytest.raises(ValueError, match="metrics"):
        logger.log(1, {"v": object()})
    with pytest.raises(ValueError, match="metrics"):
        logger.log(1, {3: 1.0})
    assert logger.offset == 1  # nothing was written by the rejected calls
    logger.close()
    with pytest.raises(ValueError, match="close"):
        logger.log(2, {"a": 1.0})
    with pytest.raises(ValueError, match="resume_offset"):
        MetricsLogger(tmp_path, tensorboard=False, resume_offset=5)
    assert len(read_metrics(tmp_path)) == 1  # the failed resume did not truncate


def test_corrupt_middle_line_raises_naming_run_dir(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_bytes(b'{"step": 0, "kind": "train", "a": 1}\nnot json\n{"step": 1, "kind": "train"}\n')
    with pytest.raises(ValueError, match="run_dir.*line 2"):
        read_metrics(tmp_path)
    path.write_bytes(b'[1, 2]\n')
    with pytest.raises(ValueError, match="run_dir"):
        read_metrics(tmp_path)
