"""Task source "dataset": prompts from JSONL / JSON / Parquet / datasets directories, TRL-style reward
functions by import path (weighted), held-out splits, load-time errors naming the key, one-command training."""
import json

import pytest

from trajgrad.envs import get_task_source
from trajgrad.envs.dataset import DatasetSource
from trajgrad.train.config import load_config

ME = __name__
ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(30)]


def exact(prompts, completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    return [1.0 if len(c) <= 3 else 0.0 for c in completions]


def level_bonus(completions, level, **kwargs):  # reads another column, returns a plain float
    return 0.5 * level[0]


def chat_exact(prompts, completions, answer, **kwargs):
    return [float(c[0]["content"] == a) for c, a in zip(completions, answer)]


def raises(completions, **kwargs):
    raise ZeroDivisionError("bad reward")


def later_raises(completions, **kwargs):
    if completions[0] == "boom":
        raise KeyError("late")
    return [0.0]


def not_a_number(completions, **kwargs):
    return ["high"]


def nan_after_probe(completions, **kwargs):  # the load-time probe scores "" (the answer column is absent)
    return [0.0 if completions[0] == "" else float("nan")]


NOT_CALLABLE = 3


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_rows_weighted_trl_rewards_and_disjoint_splits(tmp_path):
    src = get_task_source("dataset", path=_jsonl(tmp_path / "p.jsonl", ROWS),
                          reward={f"{ME}:exact": 1.0, f"{ME}:short": 0.25, f"{ME}:level_bonus": 1.0})
    train, held = src.tasks("train", 40, 0), src.tasks("heldout", 3, 0)
    prompts = lambda ts: {t.metadata["row"]["prompt"] for t in ts}
    assert not prompts(train) & prompts(held) and len(prompts(train)) + len({r["prompt"] for r in src.rows["heldout"]}) == 30
    assert len(train) == 40 and len({t.id for t in train}) == 40  # cycles with distinct ids
    assert src.tasks("train", 40, 0) == train and src.tasks("train", 40, 1) != train
    t = train[0]
    env = src.make_env()
    assert env.reset(t) == [{"role": "user", "content": t.metadata["row"]["prompt"]}]
    r = env.step(t.answer)
    level = t.metadata["row"]["level"]
    want = 1.0 + 0.25 * float(len(t.answer) <= 3) + 0.5 * level
    assert r.terminated and not r.truncated and r.messages == [] and r.reward == pytest.approx(want)
    assert r.info["reward/reward[%s:exact]" % ME] == 1.0 and r.info["success"] is True
    env.reset(t)
    assert env.step("wrong answer").reward == pytest.approx(0.5 * level)
    assert src.demonstration(t) == [{"role": "assistant", "content": t.answer}]


def test_json_parquet_and_datasets_directories_give_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "p.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    seen = []
    for path in ["p.json", "p.parquet", "ds"]:
        src = DatasetSource(path=str(tmp_path / path), reward=f"{ME}:exact")
        seen.append(src.rows)
    assert seen[0] == seen[1] == seen[2]
    # a DatasetDict: its test split is the held-out set unless task.heldout says otherwise
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:20]),
                          "test": datasets.Dataset.from_list(ROWS[20:])}).save_to_disk(str(tmp_path / "dd"))
    src = DatasetSource(path=str(tmp_path / "dd"), reward=f"{ME}:exact")
    assert src.rows["train"] == ROWS[:20] and src.rows["heldout"] == ROWS[20:]


def test_heldout_by_fraction_or_file_and_chat_prompts(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", ROWS)
    assert len(DatasetSource(path=path, reward=f"{ME}:exact", heldout=0.5).rows["heldout"]) > 8
    src = DatasetSource(path=path, reward=f"{ME}:exact", heldout=_jsonl(tmp_path / "h.jsonl", ROWS[:2]))
    assert src.rows == {"train": ROWS, "heldout": ROWS[:2]}
    chat = [{"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "1+1="}],
             "answer": "2"}] * 3
    src = DatasetSource(path=_jsonl(tmp_path / "c.jsonl", chat), reward=f"{ME}:chat_exact", heldout=0.0)
    env = src.make_env()
    t = src.tasks("train", 1, 0)[0]
    assert env.reset(t) == chat[0]["prompt"] and env.step("2").reward == 1.0


@pytest.mark.parametrize("sets, key, words", [
    ({"task.dataset": "/nonexistent/p.jsonl"}, "task.dataset", ["no such file"]),
    ({"task.reward": "no_such_module_xyz:f"}, "task.reward", ["cannot import module 'no_such_module_xyz'"]),
    ({"task.reward": f"{ME}:missing"}, "task.reward", ["has no attribute 'missing'"]),
    ({"task.reward": f"{ME}:NOT_CALLABLE"}, "task.reward", ["not a function"]),
    ({"task.reward": "not an import string"}, "task.reward", ["expected an import string"]),
    ({"task.reward": [f"{ME}:exact", f"{ME}:raises"]}, "task.reward.1", ["raised ZeroDivisionError: bad reward"]),
    ({"task.reward": [f"{ME}:not_a_number"]}, "task.reward.0", ["returned ['high']"]),
    ({"task.reward": {f"{ME}:exact": 1.0}, "task.heldout": 1.5}, "task.heldout", ["[0, 1)"]),
    ({"task.heldout": "/nonexistent/h.jsonl"}, "task.heldout", ["no such file"]),
    ({"task.reward": {f"{ME}:exact": 1.0, f"{ME}:raises": 0.5}}, f"task.reward[{ME}:raises]", ["raised"]),
])
def test_load_time_errors_name_the_key(tmp_path, sets, key, words):
    base = {"task.dataset": _jsonl(tmp_path / "p.jsonl", ROWS), "task.reward": f"{ME}:exact", "sft.steps": 0}
    with pytest.raises(ValueError) as e:
        load_config(preset="tiny", overrides={**base, **sets})
    msg = str(e.value)
    assert msg.startswith(f"{key}:") and msg.count(": ") >= 1, msg
    for w in words:
        assert w in msg, msg


def test_inconsistent_dataset_keys(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"^task\.reward: needs task\.dataset"):
        load_config(preset="tiny", overrides={"task.reward": f"{ME}:exact"})
    with pytest.raises(ValueError, match=r"^task\.reward: is required with task\.dataset"):
        load_config(preset="tiny", overrides={"task.dataset": path})
    with pytest.raises(ValueError, match=r"^task\.dataset: .*task\.name 'guess'"):
        load_config(preset="tiny", overrides={"task.dataset": path, "task.reward": f"{ME}:exact", "task.name": "guess",
                                              "task.options": {}})
    with pytest.raises(ValueError, match=r"^task\.options\.bogus: unknown option of task 'dataset'"):
        load_config(preset="tiny", overrides={"task.name": "dataset", "task.options": {"path": path, "bogus": 1,
                                                                                      "reward": f"{ME}:exact"}})


def test_a_reward_that_raises_during_training_is_an_error_naming_it(tmp_path):
    src = DatasetSource(path=_jsonl(tmp_path / "p.jsonl", ROWS), reward=[f"{ME}:exact", f"{ME}:later_raises"])
    env = src.make_env()
    env.reset(src.tasks("train", 1, 0)[0])
    with pytest.raises(RuntimeError, match=r"^task\.reward\.1: reward function 'later_raises' raised KeyError"):
        env.step("boom")


def test_a_nan_reward_mid_run_is_one_line_naming_the_function_and_the_task(tmp_path):
    from typer.testing import CliRunner

    from trajgrad.cli import app

    path = _jsonl(tmp_path / "q.jsonl", [{"prompt": f"{i}+1="} for i in range(30)])
    res = CliRunner().invoke(app, ["train", "--preset", "tiny", "--run-dir", str(tmp_path / "run"),
                                   "--set", f"task.dataset={path}", "--set", f"task.reward={ME}:nan_after_probe",
                                   "--set", "sft.steps=0", "--set", "task.n_heldout=3", "--set", "eval.before=false",
                                   "--set", "train.prompts_per_step=2", "--set", "train.group_size=2",
                                   "--set", "sampling.max_new_tokens=4", "--set", "log.progress=false"])
    assert res.exit_code == 1, res.output
    err = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "Traceback" not in res.output, res.output
    assert err[0].startswith("error: task.reward: reward function 'nan_after_probe' returned [nan]"), err
    assert "; task 'ds-train-" in err[0] and "(prompt '" in err[0], err


def test_one_command_dataset_and_rewards_trains(tmp_path):
    """The TRL workflow: a dataset plus reward functions, one `trajgrad train` command."""
    from typer.testing import CliRunner

    from trajgrad.cli import app

    path = _jsonl(tmp_path / "p.jsonl", ROWS)
    args = ["train", "--preset", "tiny", "--run-dir", str(tmp_path / "run"),
            "--set", f"task.dataset={path}", "--set", f"task.reward=[{ME}:exact, {ME}:short]",
            "--set", "train.steps=2", "--set", "train.prompts_per_step=2", "--set", "train.group_size=2",
            "--set", "sft.steps=2", "--set", "sft.batch_size=4", "--set", "task.n_heldout=3",
            "--set", "sampling.max_new_tokens=4", "--set", "log.progress=false", "--set", "checkpoint.every=0"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_after"]["n"] == 3  # the 3 distinct held-out rows
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/mean" in l for l in lines)


def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


def untyped(a) -> str:
    """No hint."""


def test_a_tool_dataset_runs_tool_turns_then_scores_the_answer(tmp_path):
    from trajgrad.envs import format_tool_call

    path = _jsonl(tmp_path / "p.jsonl", ROWS)
    src = DatasetSource(path=path, reward=f"{ME}:exact", tools=[f"{ME}:add"], max_turns=3)
    t = src.tasks("train", 1, 0)[0]
    env = src.make_env()
    msgs = env.reset(t)
    assert msgs[0]["role"] == "system" and '"name": "add"' in msgs[0]["content"] and msgs[1]["role"] == "user"
    n = int(t.metadata["row"]["prompt"].split("+")[0])
    r = env.step(format_tool_call("add", {"a": n, "b": 1}))
    assert r.messages == [{"role": "tool", "content": str(n + 1)}] and not r.terminated
    r = env.step(str(n + 1))
    assert r.terminated and r.reward == 1.0
    with pytest.raises(ValueError, match=r"^task\.options\.tools\.0: fn: untyped, parameter 'a': has no type hint"):
        load_config(preset="tiny", overrides={"task.name": "dataset", "task.options": {
            "path": path, "reward": f"{ME}:exact", "tools": [f"{ME}:untyped"], "max_turns": 2}})
