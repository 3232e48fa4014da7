"""RL improves the ``tiny`` preset: GRPO and PPO raise held-out success and the training reward.

The preset's warm start leaves a model that mostly answers without the calculator (60% of
its demonstrations do) and so mostly guesses; RL has to teach it to call the tool and to
copy the operands and the result. Each slow test trains the preset end to end (random
char-level model, SFT, RL) on one thread with its fixed seeds, and compares the model after
the SFT warm start with the model after RL:

* held-out greedy success (128 tasks) rises by at least 25 points, and the two 95% Wilson
  intervals do not overlap;
* the mean training reward of the last 5 RL steps exceeds that of the first 5 by at least
  0.15 (a step's reward is the mean over 128 episodes; its step-to-step noise is ~0.07).

With a learning rate of 1e-9 the held-out success does not move and both checks fail.
"""
from __future__ import annotations

import math

import pytest

from trajgrad.envs import get_task_source
from trajgrad.train.config import load_config
from trajgrad.train.metrics import read_metrics
from trajgrad.train.trainer import Trainer

MIN_HELDOUT_GAIN = 0.25
MIN_REWARD_GAIN = 0.15
WINDOW = 5


def _train_tiny(run_dir, **overrides):
    cfg = load_config(preset="tiny", overrides={"log.progress": False, "checkpoint.every": 0, **overrides})
    Trainer(cfg, run_dir, console=lambda *_: None).run()
    rows = read_metrics(run_dir)
    (sft,) = [r for r in rows if r["kind"] == "eval_after_sft"]
    (after,) = [r for r in rows if r["kind"] == "eval_after"]
    rewards = [r["reward/mean"] for r in rows if r["kind"] == "train"]
    assert len(rewards) == cfg.train.steps
    return sft, after, rewards


def _assert_improves(sft, after, rewards):
    gain = after["eval/success"] - sft["eval/success"]
    first = sum(rewards[:WINDOW]) / WINDOW
    last = sum(rewards[-WINDOW:]) / WINDOW
    report = (f"held-out success after SFT {sft['eval/success']:.1%} "
              f"[{sft['eval/success_low']:.1%}, {sft['eval/success_high']:.1%}], after RL {after['eval/success']:.1%} "
              f"[{after['eval/success_low']:.1%}, {after['eval/success_high']:.1%}]; "
              f"training reward first {WINDOW} steps {first:.3f}, last {WINDOW} {last:.3f}")
    assert gain >= MIN_HELDOUT_GAIN, report
    assert after["eval/success_low"] > sft["eval/success_high"], report
    assert last - first >= MIN_REWARD_GAIN, report


@pytest.mark.slow
def test_grpo_improves_the_tiny_preset(tmp_path, one_thread):
    _assert_improves(*_train_tiny(tmp_path / "grpo"))


@pytest.mark.slow
def test_ppo_improves_the_tiny_preset(tmp_path, one_thread):
    _assert_improves(*_train_tiny(tmp_path / "ppo", **{"recipe.name": "ppo"}))


# ------------------------------------------------------------------ the task options it relies on
def test_direct_demonstrations_skip_the_tool_for_the_given_fraction():
    opts = dict(min_ops=1, max_ops=1, min_operand=10, max_operand=49, operators="+")
    plain = get_task_source("calculator", **opts)
    mixed = get_task_source("calculator", **opts, direct_demo_fraction=0.6)
    tasks = plain.tasks("train", 500, 0)
    assert all(plain.demonstration(t)[0]["content"].startswith("<calc>") for t in tasks)
    direct = [t for t in tasks if len(mixed.demonstration(t)) == 1]
    assert abs(len(direct) / len(tasks) - 0.6) < 0.07
    for t in direct[:20]:
        (msg,) = mixed.demonstration(t)
        assert msg == {"role": "assistant", "content": f"<answer>{t.answer}</answer>"}
        env = mixed.make_env()
        env.reset(t)
        result = env.step(msg["content"])
        assert result.terminated and result.reward == 1.0 and result.info["success"]
    # the same tasks skip the tool on every call (a hash of the expression)
    assert [len(mixed.demonstration(t)) for t in tasks] == [len(mixed.demonstration(t)) for t in tasks]
    for bad in (-0.1, 1.5, True, "half", math.nan):
        with pytest.raises(ValueError, match="direct_demo_fraction"):
            get_task_source("calculator", direct_demo_fraction=bad)


def test_running_out_of_turns_terminates_when_asked():
    for terminates in (False, True):
        source = get_task_source("calculator", min_ops=1, max_ops=1, max_turns=2,
                                 max_turns_terminates=terminates)
        task = source.tasks("train", 1, 0)[0]
        env = source.make_env()
        env.reset(task)
        first = env.step(f"<calc>{task.metadata['expression']}</calc>")
        assert not (first.terminated or first.truncated) and first.reward == pytest.approx(0.1)
        last = env.step("no action here")
        assert (last.terminated, last.truncated) == (terminates, not terminates)
        assert last.reward == 0.0 and last.info["success"] is False
        # a truncated state keeps its potential; a terminal state has potential 0 (§21)
        assert last.info["potential"] == (0.0 if terminates else source.config.correct_potential)
    with pytest.raises(ValueError, match="max_turns_terminates"):
        get_task_source("calculator", max_turns_terminates="yes")
