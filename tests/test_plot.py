"""plot_run / plot_compare on synthetic metrics logs."""
from __future__ import annotations

import math

import pytest

from trajgrad.view import plot as plotmod
from trajgrad.train.metrics import METRICS_FILE, MetricsLogger
from trajgrad.view.plot import plot_compare, plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0  # something was drawn


def _synthetic_run(run_dir, steps=30, eval_every=10, speed=1.0):
    with MetricsLogger(run_dir, tensorboard=False) as logger:
        for step in range(steps):
            logger.log(
                step,
                {
                    "loss": 1.0 / (step + 1),
                    "reward/mean": math.tanh(step / 10),
                    "success": step / steps,
                    "kl/k3": 0.01 * step,
                    "clip_frac/pos_high": 0.02,
                    "clip_frac/neg_low": 0.01,
                    "len/mean": 100 + step,
                    "len/max": 200,
                    "entropy": 2.0 - step / steps,
                    "tokens_per_s": 1500.0 * speed,
                    "lagrange/lambda": 0.1,
                    "grad_norm": 1.0,
                    "phase": "rl",
                },
            )
            if step % eval_every == 0:
                s = step / steps
                logger.log(
                    step,
                    {"success": s, "success_low": max(0.0, s - 0.1), "success_high": min(1.0, s + 0.1)},
                    kind="eval",
                )


def test_plot_run_writes_one_png_per_group(tmp_path):
    _synthetic_run(tmp_path)
    paths = plot_run(tmp_path)
    names = [p.name for p in paths]
    assert names == [
        "reward.png",
        "success.png",
        "kl.png",
        "clip.png",
        "length.png",
        "loss.png",
        "entropy.png",
        "throughput.png",
        "other-1.png",
    ]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        _assert_png(path)
    assert not list((tmp_path / "plots").glob(".*"))  # no temporary files left


def test_grouping_of_keys():
    series = {
        k: [(0.0, 1.0)]
        for k in [
            "reward/mean",
            "eval/success",
            "eval/success_low",
            "eval/success_high",
            "kl",
            "policy/approx_kl",
            "kl_k3",
            "clip_frac/pos_high",
            "policy/clip_frac_low",
            "len/mean",
            "response_length",
            "loss",
            "value_loss",
            "entropy",
            "tokens_per_s",
            "grad_norm",
            "kline",
        ]
    }
    bands = plotmod._bands(series)
    assert bands == {"eval/success": ("eval/success_low", "eval/success_high")}

    def group_of(label):
        for stem, _, _, predicate in plotmod.GROUPS:
            if predicate(plotmod._base(label)):
                return stem
        return "other"

    assert group_of("reward/mean") == "reward"
    assert group_of("eval/success") == "success"
    assert group_of("kl") == group_of("policy/approx_kl") == group_of("kl_k3") == "kl"
    assert group_of("kline") == "other"
    assert group_of("clip_frac/pos_high") == group_of("policy/clip_frac_low") == "clip"
    assert group_of("len/mean") == group_of("response_length") == "length"
    assert group_of("loss") == group_of("value_loss") == group_of("sft/nll") == "loss"
    assert group_of("entropy") == "entropy"
    assert group_of("tokens_per_s") == "throughput"
    assert group_of("grad_norm") == "other"


def test_series_labels_eval_records_and_keeps_last_duplicate():
    records = [
        {"step": 0, "kind": "train", "time": 1.0, "wall_time": 0.0, "loss": 1.0, "note": "x"},
        {"step": 1, "kind": "train", "time": 2.0, "wall_time": 1.0, "loss": 2.0},
        {"step": 1, "kind": "train", "time": 3.0, "wall_time": 2.0, "loss": 3.0},  # re-logged
        {"step": 1, "kind": "eval", "time": 4.0, "wall_time": 3.0, "success": 0.5, "eval/reward": 0.2},
    ]
    series = plotmod._series(records)
    assert series == {"loss": [(0.0, 1.0), (1.0, 3.0)], "eval/success": [(1.0, 0.5)], "eval/reward": [(1.0, 0.2)]}
    # Evaluations under several kinds at the same step stay separate series.
    more = [
        {"step": 0, "kind": "eval_before", "eval/success": 0.1, "eval/success_low": 0.0, "eval/success_high": 0.3},
        {"step": 0, "kind": "eval_after_sft", "eval/success": 0.4},
        {"step": 0, "kind": "sft", "sft/nll": 2.0},
    ]
    labels = set(plotmod._series(more))
    assert labels == {
        "eval_before/success", "eval_before/success_low", "eval_before/success_high",
        "eval_after_sft/success", "sft/nll",
    }
    assert plotmod._is_eval("eval_before/success") and plotmod._is_eval("eval/x") and plotmod._is_eval("test/x")
    assert not plotmod._is_eval("value/loss") and not plotmod._is_eval("evaluation_time")
    by_wall = plotmod._series(records, x="wall_time")
    assert by_wall["loss"] == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]


def test_only_present_groups_are_drawn(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(3):
            logger.log(step, {"loss": float(step), "note": "text is ignored"})
    paths = plot_run(tmp_path, out_dir=tmp_path / "figs", smoothing=0.5)
    assert [p.name for p in paths] == ["loss.png"] and paths[0].parent == tmp_path / "figs"
    _assert_png(paths[0])


def test_many_other_keys_are_split_over_figures(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(2):
            logger.log(step, {f"misc_{i:02d}": float(i * step) for i in range(10)})
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["other-1.png", "other-2.png"]
    for path in paths:
        _assert_png(path)


def test_plot_compare_by_wall_time_and_step(tmp_path):
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    _synthetic_run(fast, steps=12, eval_every=4, speed=2.0)
    _synthetic_run(slow, steps=8, eval_every=4, speed=1.0)
    out = plot_compare({"gspo": fast, "grpo": slow}, "reward/mean", tmp_path / "cmp" / "reward.png")
    assert out == tmp_path / "cmp" / "reward.png"
    _assert_png(out)
    out = plot_compare({"gspo": fast, "grpo": slow}, "eval/success", tmp_path / "succ.png", x="step", smoothing=0.3)
    _assert_png(out)


def test_smoothing_is_a_debiased_moving_average():
    # weight 0.5: s1 = 0.5*2/0.5 = 2; s2 = (0.25*2 + 0.5*4) / 0.75 = 10/3
    assert plotmod._smooth([2.0, 4.0], 0.5) == pytest.approx([2.0, 10.0 / 3.0])
    assert plotmod._smooth([1.0, 5.0], 0.0) == [1.0, 5.0]


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="run_dir"):
        plot_run(tmp_path / "missing")
    with pytest.raises(ValueError, match="run_dir"):
        plot_run(tmp_path)  # no metrics.jsonl
    (tmp_path / METRICS_FILE).write_text("")
    with pytest.raises(ValueError, match="run_dir"):
        plot_run(tmp_path)  # no records
    (tmp_path / METRICS_FILE).write_text('{"step": 0, "kind": "train", "phase": "x"}\n')
    with pytest.raises(ValueError, match="run_dir"):
        plot_run(tmp_path)  # nothing numeric
    with pytest.raises(ValueError, match="smoothing"):
        plot_run(tmp_path, smoothing=1.0)

    run = tmp_path / "run"
    _synthetic_run(run, steps=3)
    with pytest.raises(ValueError, match="runs"):
        plot_compare({}, "loss", tmp_path / "x.png")
    with pytest.raises(ValueError, match="runs"):
        plot_compare({"a": run}, "no_such_metric", tmp_path / "x.png")
    with pytest.raises(ValueError, match="runs"):
        plot_compare({"a": run, "b": tmp_path / "missing"}, "loss", tmp_path / "x.png")
    with pytest.raises(ValueError, match="x"):
        plot_compare({"a": run}, "loss", tmp_path / "x.png", x="epoch")
    with pytest.raises(ValueError, match="key"):
        plot_compare({"a": run}, "", tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
