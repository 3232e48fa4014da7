"""The Python API: trajgrad.train(...) returns the run summary; Trainer stays usable from code."""
import json

import pytest

import trajgrad
from trajgrad.api import build_config

ME = __name__
FAST = {"train.steps": 2, "train.prompts_per_step": 2, "train.group_size": 2, "sft.steps": 2, "sft.batch_size": 4,
        "task.n_heldout": 4, "sampling.max_new_tokens": 4, "log.progress": False, "checkpoint.every": 0}


def exact(prompts, completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def test_train_with_a_dataset_and_reward_objects_returns_the_summary(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    import trajgrad.train.trainer  # noqa: F401  (the package stays callable once imported)

    fast = {**FAST, "task.n_heldout": 1}  # the one held-out row of these 20 (heldout 0.1, by hash)
    s = trajgrad.train(model="tiny", dataset=path, rewards={exact: 1.0}, recipe="rloo", overrides=fast,
                       run_dir=tmp_path / "run", console=lambda m: None)
    assert s["steps"] == 2 and s["recipe"] == "rloo" and s["run_dir"] == str(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["task"]["reward"] == {f"{ME}:exact": 1.0} and cfg["task"]["name"] == "dataset"
    with pytest.raises(ValueError, match="^run_dir"):  # an existing run is never overwritten silently
        trajgrad.train(model="tiny", dataset=path, rewards=[exact], overrides=fast, run_dir=tmp_path / "run")


def test_train_with_a_task_source_object_and_the_trainer_from_code(tmp_path):
    from trajgrad.envs import get_task_source
    from trajgrad.train.trainer import Trainer

    source = get_task_source("calculator", min_ops=1, max_ops=1, max_turns=2, few_shot=False, system_prompt="")
    s = trajgrad.train(model="tiny", env=source, overrides=FAST, run_dir=tmp_path / "a", console=lambda m: None)
    assert s["steps"] == 2 and "eval_after" in s
    # the same config, driven step by step from code
    cfg = build_config(model="tiny", env=source, overrides=FAST)
    trainer = Trainer(cfg, tmp_path / "b", console=lambda m: None)
    metrics = trainer.train_step()
    assert "reward/mean" in metrics and metrics["reward/mean"] >= 0
    trainer.finish({"steps": 1})


def test_build_config_maps_arguments_to_keys():
    cfg = build_config(model="tiny", env="guess", recipe="ppo", overrides={"train.steps": 3})
    assert (cfg.model.name, cfg.task.name, cfg.recipe.name, cfg.train.steps, cfg.task.options) == \
        ("tiny", "guess", "ppo", 3, {})
    assert build_config(model="tiny", overrides={"task.options.max_turns": 3}).task.options["max_turns"] == 3


def test_api_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="^env: give an environment or a dataset"):
        build_config(env="guess", dataset="x.jsonl", rewards=[exact])
    with pytest.raises(ValueError, match="^rewards: reward functions score"):
        build_config(rewards=[exact])
    with pytest.raises(ValueError, match="^rewards: required"):
        build_config(dataset="x.jsonl")
    with pytest.raises(ValueError, match=r"^rewards\.0: a reward function object must be defined at module level"):
        build_config(model="tiny", dataset="x.jsonl", rewards=[lambda completions, **k: [0.0]])
    with pytest.raises(ValueError, match="^env: expected"):
        build_config(env=3)
    with pytest.raises(ValueError, match=r"^task\.dataset: no such file"):
        build_config(model="tiny", dataset=tmp_path / "missing.jsonl", rewards=[exact])
    with pytest.raises(ValueError, match=r"^recipe\.name: unknown recipe"):
        build_config(model="tiny", recipe="nope")
