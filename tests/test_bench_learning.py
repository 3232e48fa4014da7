"""bench/bench_learning.py: one cell end to end on a tiny model, the report, the matrix's configs."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from trajgrad.train.config import load_config
from trajgrad.stats import mcnemar_exact_test, wilson_interval

_PATH = Path(__file__).resolve().parents[1] / "bench" / "bench_learning.py"
_spec = importlib.util.spec_from_file_location("bench_learning", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY = {"model": {"name": "tiny", "dtype": "float32", "lora": None,
                  "tiny": {"hidden_size": 32, "layers": 1, "heads": 2, "seed": 0}},
        "sampling.max_new_tokens": 6, "checkpoint.every": 0, "train.prompts_per_step": 4, "train.group_size": 2}


@pytest.fixture()
def restore_sys_path(monkeypatch):
    """bench.cell_config puts an example's directory on sys.path: undone after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_every_cell_of_the_matrix_is_a_valid_config(restore_sys_path):
    for task in bench.TASKS:
        for recipe in bench.RECIPES:
            if (task, recipe) in bench.REFUSED:
                with pytest.raises(ValueError, match=f"--recipe: '{recipe}' cannot run --task '{task}'"):
                    bench.cell_config(task, recipe, 2)
                continue
            cfg = bench.cell_config(task, recipe, 2)
            preset = bench.TASK_PRESETS.get(task, "default")
            assert cfg.train.seed == 2 and cfg.model.name == ("tiny" if preset == "tiny" else "smollm2")
            assert cfg.task.n_heldout >= bench.MIN_HELDOUT
            assert cfg.recipe.name == ("grpo" if recipe == "default" else recipe)
            if task not in bench.TASK_CONFIGS:  # a preset's cell: the preset with the cell's overrides
                assert cfg == load_config(preset=preset, overrides=bench.cell_overrides(task, recipe, 2))
    assert set(bench.REFUSED) == {("openai_agent", "sao")}
    # the example's own recipe changes (kb_agent's KL term) belong to its default recipe; another recipe replaces them
    assert bench.cell_config("kb_agent", "default", 0).recipe.overrides == {"kl_coef": 0.04, "kl_placement": "loss"}
    assert not bench.cell_config("kb_agent", "grpo", 0).recipe.overrides
    with pytest.raises(ValueError, match="--task"):
        bench.cell_overrides("nope", "default", 0)
    with pytest.raises(ValueError, match="--recipe"):
        bench.cell_overrides("chain", "nope", 0)


def test_one_cell_end_to_end_and_the_report(tmp_path):
    results = tmp_path / "learning.jsonl"
    # 3 steps planned, a budget already spent after the first: the run ends after step 1
    rec = bench.run_cell("calculator", "default", 0, steps=3, minutes=1e-6, sets=dict(TINY),
                         run_root=tmp_path / "runs", results=results, console=lambda *a, **k: None)
    lines = results.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == json.loads(json.dumps(rec))
    assert rec["steps"] == 1 and rec["steps_planned"] == 3
    assert rec["heldout_distinct"] >= 64 and rec["before"]["n"] == rec["after"]["n"] == 64
    for side in ("before", "after"):
        s = rec[side]
        assert (s["low"], s["high"]) == wilson_interval(s["successes"], s["n"])
    m = rec["mcnemar"]
    assert m["improved"] - m["worsened"] == rec["after"]["successes"] - rec["before"]["successes"]
    assert m["p"] == mcnemar_exact_test(m["improved"], m["worsened"])
    assert rec["tokens_sampled"] > 0 and rec["wall_s"] >= 0 and rec["eval_before_s"] >= 0 and rec["setup_s"] > 0
    assert rec["sft_s"] == 0 and rec["task_name"] == "calculator" and len(rec["load_start"]) == 3
    # the run directory is a normal trajgrad run
    assert (Path(rec["run_dir"]) / "summary.json").exists()

    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n\n## Another section\n\ntext\n")
    for _ in range(2):  # rebuilding replaces the section, never duplicates it
        text = bench.report(results, tmp_path / "learning_base.jsonl", results_md)
    md = results_md.read_text()
    assert md.count(bench.SECTION) == 1 and "## Another section" in md and md.index("Another") < md.index(bench.SECTION)
    assert "| default | 0 | 1 |" in text and "(results/learning.png)" in md
    assert (tmp_path / "learning.png").stat().st_size > 1000 and (tmp_path / "learning.md").exists()


def test_an_sao_cell_runs_its_ray_learner_and_is_timed(tmp_path):
    """SAO's cell: the Ray learner drives its own Trainer, which is the timed one (evaluations, updates,
    the minutes budget); the sampled tokens are the asynchronous workers'."""
    pytest.importorskip("ray")
    sets = {**{k: v for k, v in TINY.items() if k != "train.group_size"}, "asynchronous.batch_trajectories": 4,
            "asynchronous.queue_size": 2}
    rec = bench.run_cell("calculator", "sao", 0, steps=3, minutes=1e-6, sets=sets, run_root=tmp_path / "runs",
                         results=tmp_path / "learning.jsonl", console=lambda *a, **k: None)
    # the budget (already spent) ends the run after its first update, as for the synchronous trainer
    assert rec["recipe_name"] == "sao" and rec["steps"] == 1 and rec["steps_planned"] == 3
    assert rec["before"]["n"] == rec["after"]["n"] == 64 and rec["tokens_sampled"] > 0 and rec["wall_s"] > 0
    assert json.loads(Path(rec["run_dir"], "summary.json").read_text())["mode"] == "async"


def test_a_tiny_preset_cell_records_the_gain_over_the_sft_warm_start(tmp_path):
    results = tmp_path / "learning.jsonl"
    sets = {**TINY, "sft.steps": 2, "sft.batch_size": 4, "task.n_heldout": 64}
    rec = bench.run_cell("tiny", "default", 0, steps=1, sets=sets, run_root=tmp_path / "runs", results=results,
                         console=lambda *a, **k: None)
    # two SFT steps of a tiny model may round to 0.0 s; the warm start ran when its evaluation is there
    assert rec["task_name"] == "calculator" and rec["sft_s"] >= 0 and rec["after_sft"]["n"] == 64
    m = rec["mcnemar_rl"]  # paired: after the warm start -> after RL
    assert m["improved"] - m["worsened"] == rec["after"]["successes"] - rec["after_sft"]["successes"]
    assert m["p"] == mcnemar_exact_test(m["improved"], m["worsened"])
    assert json.loads(Path(rec["run_dir"], "config.json").read_text())["task"]["options"]["min_operand"] == 10
    # a second seed's line (made up) for the summary over seeds
    k = 32 if rec["after"]["successes"] != 32 else 16
    low, high = wilson_interval(k, 64)
    other = {**rec, "seed": 1, "after": {"successes": k, "n": 64, "success": k / 64, "low": low, "high": high}}
    with open(results, "a") as f:
        f.write(json.dumps(other) + "\n")
    text = bench.report(results, tmp_path / "learning_base.jsonl", None)
    assert "after SFT → after RL" in text and "| default | 1 |" in text
    x, y = 100 * rec["after"]["success"], 100 * k / 64
    s = bench.seed_summary([rec, other])
    assert s["n"] == 2 and s["mean"] == pytest.approx((x + y) / 2) and s["sd"] == pytest.approx(abs(x - y) / 2 ** 0.5)
    assert (s["min"], s["max"]) == pytest.approx((min(x, y), max(x, y)))
    assert "over 2 seeds (0, 1)" in text and f"; after {s['mean']:.1f}% ± {s['sd']:.1f} (range" in text


def test_base_rate_of_the_game_through_the_trainer(tmp_path):
    results = tmp_path / "learning.jsonl"
    sets = {**TINY, "sampling.max_new_tokens": 4, "task.options": {"max_turns": 2}}
    rec = bench.run_cell("game", "default", 0, sets=sets, run_root=tmp_path / "runs", results=results,
                         base_only=True, console=lambda *a, **k: None)
    assert not results.exists()
    base = [json.loads(x) for x in (tmp_path / "learning_base.jsonl").read_text().splitlines()]
    assert len(base) == 1 and base[0]["task_name"] == "higher_lower" and "after" not in base[0]
    assert rec["before"]["n"] == 64 and rec["heldout_distinct"] == 64
    assert "### Base rates" in bench.report(results, tmp_path / "learning_base.jsonl", None)


def test_too_few_distinct_heldout_tasks_is_refused(tmp_path, capsys):
    # 64 held-out guessing tasks drawn (with replacement) from the 7 held-out secrets of 1..32
    args = ["--task", "chain", "--base", "--results", str(tmp_path / "l.jsonl"), "--run-root", str(tmp_path / "r"),
            "--set", "model=" + json.dumps(TINY["model"]), "--set", "task.name=guess", "--set", "task.options={}"]
    assert bench.main(args) == 2
    err = capsys.readouterr().err
    assert "task.n_heldout" in err and "7 distinct held-out tasks" in err
    assert not (tmp_path / "l_base.jsonl").exists()
    assert bench.main(["--task", "chain", "--minutes", "0", "--results", str(tmp_path / "l.jsonl")]) == 2
    assert "--minutes" in capsys.readouterr().err


# ------------------------------------------------------------------ the example tasks (kb_agent, openai_agent)


def test_the_example_tasks_start_from_their_yaml_and_hold_out_64_distinct_questions(restore_sys_path):
    from trajgrad.train.setup import build_tasks

    for task, name, backend in (("kb_agent", "kb_env:KBSource", "hf"), ("openai_agent", "shop_tasks:ShopTasks", "proxy")):
        cfg = bench.cell_config(task, "default", 0)
        assert cfg.task.name == name and cfg.rollout.backend == backend and cfg.model.lora is not None
        assert cfg.eval.before and cfg.eval.after and cfg.eval.temperature == 0.0
        source, train, held = build_tasks(cfg, lambda m: None)
        assert len(held) == 64 and bench._distinct_heldout(held) == 64
        assert not {t.prompt for t in held} & {t.prompt for t in train}
    assert bench.cell_config("kb_agent", "default", 0).sft.steps == 16  # the example's warm start
    base = bench.cell_config("kb_agent", "default", 0, base_only=True)  # its sft section left out
    assert base.sft.steps == 0 and base.train.steps == 0 and not base.eval.after


def test_the_examples_question_sets_grow_by_option_and_keep_their_own(restore_sys_path):
    bench.cell_config("kb_agent", "default", 0)
    bench.cell_config("openai_agent", "default", 0)
    import kb_env
    import shop_tasks

    held = lambda qs, split, f: [q["q"] for q in qs if split(q["q"], f) == "heldout"]  # noqa: E731
    assert len(kb_env._questions(True)) == 48 and len(held(kb_env._questions(True), kb_env._split, 0.25)) == 18
    assert len(held(kb_env._questions(True, 64), kb_env._split, 0.4)) == 77
    assert kb_env._questions(True) == kb_env._questions(True, 16)  # the example's own 16 entities
    with pytest.raises(ValueError, match="task.options.entities"):
        kb_env.KBSource(entities=65)
    source = kb_env.KBSource(entities=64, heldout_fraction=0.4)
    for t in source.tasks("heldout", 77, 0):  # every new question is answered by the tools
        assert kb_env.score(source.demonstration(t)[-1]["content"], t) == 1.0
    assert shop_tasks.questions(25)[:90] == shop_tasks.questions() and len(shop_tasks.questions(25)) == 250
    small, large = shop_tasks.ShopTasks().tasks("heldout", 24, 0), shop_tasks.ShopTasks(max_count=25).tasks("heldout", 24, 0)
    assert [t.prompt for t in small] == [t.prompt for t in large]  # the example's held-out questions come first
    with pytest.raises(ValueError, match="task.options.max_count"):
        shop_tasks.ShopTasks(max_count=3)


def test_base_rate_of_the_kb_agent_through_the_trainer(tmp_path, restore_sys_path):
    results = tmp_path / "learning.jsonl"
    rec = bench.run_cell("kb_agent", "default", 0, sets={**TINY, "sampling.max_new_tokens": 4}, run_root=tmp_path / "runs",
                         results=results, base_only=True, console=lambda *a, **k: None)
    base = [json.loads(x) for x in (tmp_path / "learning_base.jsonl").read_text().splitlines()]
    assert len(base) == 1 and base[0]["task_name"] == "kb_env:KBSource" and base[0]["task_options"]["entities"] == 64
    assert rec["before"]["n"] == 64 and rec["heldout_distinct"] == 64 and "eval_unfinished" not in rec
    assert not results.exists() and not Path(rec["run_dir"], "sft").exists()


def test_the_openai_agent_cell_runs_the_agent_through_the_recording_proxy(tmp_path, restore_sys_path):
    """One GRPO step of the tiny model through the proxy; the held-out evaluations run the agent (the
    openai client) through the same proxy and pair 64 outcomes."""
    pytest.importorskip("openai")
    results = tmp_path / "learning.jsonl"
    sets = {**TINY, "sampling.max_new_tokens": 8, "train.prompts_per_step": 2}
    rec = bench.run_cell("openai_agent", "default", 0, steps=1, sets=sets, run_root=tmp_path / "runs",
                         results=results, console=lambda *a, **k: None)
    assert rec["task_name"] == "shop_tasks:ShopTasks" and rec["steps"] == 1
    assert rec["before"]["n"] == rec["after"]["n"] == 64 and "eval_unfinished" not in rec
    m = rec["mcnemar"]
    assert m["improved"] - m["worsened"] == rec["after"]["successes"] - rec["before"]["successes"]
    assert rec["tokens_sampled"] > 0
    cfg = json.loads(Path(rec["run_dir"], "config.json").read_text())
    assert cfg["rollout"]["backend"] == "proxy" and cfg["rollout"]["proxy"]["agent"] == "shop_tasks:episode"
    trajs = [json.loads(x) for x in Path(rec["run_dir"], "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 4 and all(t["task_id"].startswith("shop-train-") for t in trajs)


def failing_episode(task, base_url, session):
    """An agent that ends only the held-out tasks with an even number (the others raise)."""
    from shop_tasks import episode

    if int(task.id.rsplit("-", 1)[1]) % 2:
        raise RuntimeError("no answer")
    return episode(task, base_url, session)


def test_held_out_episodes_without_a_reward_are_counted(tmp_path, restore_sys_path):
    pytest.importorskip("openai")
    sets = {**TINY, "sampling.max_new_tokens": 4, "rollout.proxy.agent": "test_bench_learning:failing_episode"}
    rec = bench.run_cell("openai_agent", "default", 0, sets=sets, run_root=tmp_path / "runs",
                         results=tmp_path / "l.jsonl", base_only=True, console=lambda *a, **k: None)
    from trajgrad.train.setup import build_tasks

    _, _, held = build_tasks(bench.cell_config("openai_agent", "default", 0), lambda m: None)
    odd = sum(int(t.id.rsplit("-", 1)[1]) % 2 for t in held)
    # the unfinished episodes are failures of their tasks: n stays 64, every success is an even task
    assert 0 < odd < 64 and rec["before"]["n"] == 64 and rec["heldout_distinct"] == 64
    assert rec["eval_unfinished"] == {"before": odd}
    trainer_evals = [json.loads(x) for x in Path(rec["run_dir"], "metrics.jsonl").read_text().splitlines()
                     if '"eval_before"' in x]
    assert trainer_evals and trainer_evals[0]["eval/unfinished"] == odd and trainer_evals[0]["eval/n"] == 64
    with pytest.raises(ValueError, match="--recipe: 'sao' cannot run --task 'openai_agent'"):
        bench.run_cell("openai_agent", "sao", 0, results=tmp_path / "l.jsonl")
