"""The learning signal is checked every step: ``train.no_signal_steps`` consecutive steps without
it print a warning and are logged; ``train.stop_on_no_signal`` ends the run with that message."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from trajgrad.objective import get_recipe
from trajgrad.train.config import load_config
from trajgrad.train.learning_signal import NoSignalWatch, signal_facts

ME = __name__


def zero(completions, **kwargs):
    """A reward that is always 0: no group ever has different rewards."""
    return [0.0 for _ in completions]


def spread(completions, **kwargs):
    """A reward that differs between samples (distinct characters)."""
    return [len(set(c)) / 10.0 for c in completions]


def _traj(task, reward, segment=0):
    return SimpleNamespace(task_id=task, segment=segment, total_reward=reward, metadata={})


def test_signal_facts_follow_the_recipe():
    grpo = get_recipe("grpo", group_size=2)
    equal = [_traj("a", 1.0), _traj("a", 1.0), _traj("b", 0.0), _traj("b", 0.0)]
    assert signal_facts(grpo, equal) == {"signal/present": 0.0, "signal/zero_variance_groups": 2.0,
                                         "signal/groups": 2.0}
    one_differs = equal[:2] + [_traj("b", 0.0), _traj("b", 0.5), _traj("b", 0.0, segment=1)]
    assert signal_facts(grpo, one_differs)["signal/present"] == 1.0
    # PPO (critic) and single rollouts: the variance of the rewards over the batch
    ppo = get_recipe("ppo", group_size=1)
    assert signal_facts(ppo, equal) == {"signal/present": 1.0, "signal/reward_var": 0.25}
    assert signal_facts(ppo, equal[:2])["signal/present"] == 0.0
    assert signal_facts(ppo, [])["signal/present"] == 0.0
    assert signal_facts(get_recipe("dpo"), equal) == {}  # no reward signal to test


def test_watch_counts_consecutive_steps_and_warns_once_per_streak():
    w = NoSignalWatch(get_recipe("grpo"), steps=2)
    seen = []
    for present in (0, 1, 0, 0, 0, 1):
        m = {"signal/present": float(present), "signal/zero_variance_groups": 4.0, "signal/groups": 4.0}
        seen.append((w.update(m), m["signal/no_signal_run"], m["signal/no_signal_warning"]))
    assert [r for _, r, _ in seen] == [1, 0, 1, 2, 3, 0]
    assert [f for _, _, f in seen] == [0, 0, 0, 1, 1, 0]
    assert [msg is not None for msg, _, _ in seen] == [False, False, False, True, False, False]
    assert "4 of 4 groups of 8 had equal rewards" in seen[3][0] and "train.stop_on_no_signal" in seen[3][0]
    with pytest.raises(ValueError, match="^train.no_signal_steps"):
        NoSignalWatch(get_recipe("grpo"), steps=0)


def _config(tmp_path, reward, **extra):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(20)))
    over = {"task.dataset": str(data), "task.reward": f"{ME}:{reward}", "train.prompts_per_step": 2,
            "train.group_size": 2, "train.micro_batch_size": 4, "sampling.max_new_tokens": 4, "sft.steps": 0,
            "eval.before": False, "eval.after": False, "checkpoint.every": 0, "task.n_train": 8, "task.n_heldout": 2,
            "log.progress": False, "train.no_signal_steps": 2, **extra}
    return over


def test_training_without_signal_warns_logs_and_can_stop(tmp_path, capsys):
    from trajgrad.train.metrics import read_metrics
    from trajgrad.train.run import main

    run = tmp_path / "warn"
    assert main(preset="tiny", overrides=_config(tmp_path, "zero", **{"train.steps": 3}), run_dir=run) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert out.count("no learning signal for 2 consecutive steps") == 1
    assert "step 2: warning: no learning signal for 2 consecutive steps: 2 of 2 groups of 2 had equal rewards" in out
    rows = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert [r["signal/no_signal_run"] for r in rows] == [1, 2, 3]
    assert [r["signal/no_signal_warning"] for r in rows] == [0, 1, 1]

    run = tmp_path / "stop"
    over = _config(tmp_path, "zero", **{"train.steps": 5, "train.stop_on_no_signal": True})
    assert main(preset="tiny", overrides=over, run_dir=run) == 3
    out = " ".join(capsys.readouterr().out.split())
    assert "the run ended at step 2 of 5: warning: no learning signal for 2 consecutive steps" in out
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [1, 2]
    assert json.loads((run / "summary.json").read_text())["stopped"].startswith("warning: no learning signal")


def test_training_with_signal_does_not_warn(tmp_path, capsys):
    from trajgrad.train.metrics import read_metrics
    from trajgrad.train.run import main

    over = _config(tmp_path, "spread", **{"train.steps": 3, "train.stop_on_no_signal": True,
                                          "sampling.temperature": 1.5})
    assert main(preset="tiny", overrides=over, run_dir=tmp_path / "run") == 0
    assert "no learning signal" not in capsys.readouterr().out
    assert all(r["signal/present"] == 1.0 for r in read_metrics(tmp_path / "run") if r["kind"] == "train")


def test_signal_keys_without_effect_are_refused():
    with pytest.raises(ValueError, match=r"^train\.stop_on_no_signal: has no effect: recipe 'dpo'"):
        load_config(preset="tiny", overrides={"recipe.name": "dpo", "recipe.overrides": {},
                                              "train.stop_on_no_signal": True})
