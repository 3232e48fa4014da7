"""``trajgrad doctor``: the base policy sampled as the run would, the recipe's signal, a verdict.

Tiny model, a dataset task: a reward that is always 0 has no signal (group and critic
recipes alike); a reward that differs between samples has one."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from trajgrad.cli import app
from trajgrad.train.config import parse_overrides
from trajgrad.train.doctor import doctor
from trajgrad.train.doctor_report import format_report, mixed_probability, verdict

ME = __name__
runner = CliRunner()


def zero(completions, **kwargs):
    """Always 0: every group has equal rewards."""
    return [0.0 for _ in completions]


def spread(completions, **kwargs):
    """Distinct characters of the reply: differs between samples."""
    return [len(set(c)) / 10.0 for c in completions]


def _sets(tmp_path, reward, **extra):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(20)))
    over = {"task.dataset": str(data), "task.reward": f"{ME}:{reward}", "train.group_size": 2,
            "sampling.max_new_tokens": 4, "sft.steps": 0, "task.n_train": 8, "task.n_heldout": 2, **extra}
    return [f"{k}={v}" for k, v in over.items()]


def test_a_reward_that_is_always_zero_has_no_signal(tmp_path):
    sets = [a for s in _sets(tmp_path, "zero") for a in ("--set", s)]
    res = runner.invoke(app, ["doctor", "--preset", "tiny", "--groups", "3", *sets])
    assert res.exit_code == 1, res.output
    out = res.output
    assert "verdict: NO SIGNAL" in out
    assert "groups without signal 3/3 = 100.0% (95% CI 43.9% to 100.0%)" in out
    assert "success               0/6 = 0.0% (95% CI 0.0% to 39.0%)" in out
    assert "3 of 3 groups have equal rewards: with group size 2 and base success 0%" in out
    assert "there is no GRPO gradient" in out and "a partial-credit reward" in out and "dynamic sampling" in out
    assert "thresholds: no signal = every group has equal rewards" in out


def test_a_critic_recipe_checks_the_reward_variance_of_the_batch(tmp_path):
    f = doctor(preset="tiny", groups=4, progress=False, console=lambda *_: None,
               overrides={"recipe.name": "ppo", "recipe.overrides": {},
                          **parse_overrides(_sets(tmp_path, "zero", **{"train.group_size": 1}))})
    assert f["signal_kind"] == "batch" and f["reward_var"] == 0.0 and verdict(f) == "no signal"
    text, v = format_report(f)
    assert "reward variance       0 over the batch" in text and "every episode has the same reward" in text


def test_a_reward_that_differs_has_signal(tmp_path):
    over = parse_overrides(_sets(tmp_path, "spread", **{"sampling.temperature": 1.5}))
    f = doctor(preset="tiny", groups=4, progress=False, console=lambda *_: None, overrides=over)
    assert f["episodes"] == 8 and f["groups"] == 4
    assert f["zero_variance_groups"]["k"] < 3 and verdict(f) == "ok"
    text, v = format_report(f)
    assert v == "ok" and "verdict: OK" in text and "no GRPO gradient" not in text
    assert f["seconds"] < f["budget_s"] == 120.0


def test_mixed_probability():
    assert mixed_probability(0.0, 8) == 0.0 and mixed_probability(1.0, 8) == 0.0
    assert abs(mixed_probability(0.5, 2) - 0.5) < 1e-12


def test_the_time_budget_stops_sampling_between_batches(tmp_path):
    f = doctor(preset="tiny", groups=8, max_seconds=1e-3, progress=False, console=lambda *_: None,
               overrides=parse_overrides(_sets(tmp_path, "zero")))
    assert (f["groups_asked"], f["groups"], f["episodes"]) == (8, 4, 8)  # one batch of 4 prompts, then the budget
    assert "sampled 4 of 8 groups (8 episodes)" in format_report(f)[0]


def test_the_sft_warm_start_runs_as_the_run_within_the_budget(tmp_path):
    over = parse_overrides(_sets(tmp_path, "zero", **{"sft.steps": 50, "sft.batch_size": 2}))
    f = doctor(preset="tiny", groups=1, max_seconds=1e-3, progress=False, console=lambda *_: None, overrides=over)
    assert (f["sft_steps"], f["sft_configured"]) == (1, 50)  # stopped after its first step: out of time
    text = format_report(f)[0]
    assert "after 1 of the 50 SFT warm-start steps (stopped at the time budget" in text
    assert "the policy sampled had 1 of the run's 50 SFT warm-start steps" in text and "--max-seconds" in text
