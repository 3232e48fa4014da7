"""`--preset chain` is exactly the learning benchmark's chain cell (bench/bench_learning.py --task chain)."""
from __future__ import annotations

import sys
from pathlib import Path

from trajgrad.train.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_learning  # noqa: E402


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, prefix + k + "."))
        else:
            out[prefix + k] = v
    return out


def test_chain_preset_is_the_benchmark_cell():
    over = bench_learning.cell_overrides("chain", "default", 0)
    for key in ("name", "log.progress", "train.seed"):
        over.pop(key)
    cell = _flat(load_config(preset=bench_learning.TASK_PRESETS.get("chain", "default"), overrides=over).model_dump())
    preset = _flat(load_config(preset="chain").model_dump())
    cell.pop("name"), preset.pop("name")
    assert {k: (preset.get(k), cell.get(k)) for k in set(cell) | set(preset) if preset.get(k) != cell.get(k)} == {}


def test_chain_preset_trains_the_chain_from_a_short_warm_start():
    cfg = load_config(preset="chain")
    assert (cfg.task.name, cfg.task.options) == ("chain", {"examples": 2})
    assert (cfg.sft.steps, cfg.sft.batch_size) == (3, 16)
    assert cfg.recipe.name == "grpo" and cfg.train.steps == 12
    assert cfg.model.name == "smollm2" and cfg.task.n_heldout == 64
