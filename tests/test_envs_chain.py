"""Task source "chain": three dependent tool calls, reward only for the final answer."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.envs import available_task_sources, get_task_source
from trajgrad.envs.chain import ChainConfig, ChainSource


def _play(env, task, replies):
    env.reset(task)
    out = []
    for text in replies:
        out.append(env.step(text))
        if out[-1].terminated or out[-1].truncated:
            break
    return out


def test_registered_and_heldout_distinct_and_disjoint():
    assert "chain" in available_task_sources()
    src = get_task_source("chain")
    held = src.tasks("heldout", 128, 0)
    train = src.tasks("train", 500, 3)
    key = lambda t: (t.metadata["item"], t.metadata["code"], t.metadata["value"], t.metadata["op"],  # noqa: E731
                     t.metadata["operand"])
    assert len({key(t) for t in held}) == 128
    assert not {key(t) for t in held} & {key(t) for t in train}
    assert [t.id for t in src.tasks("heldout", 64, 0)] == [t.id for t in held[:64]]  # deterministic prefix
    assert {t.split for t in held} == {"heldout"}


def test_values_cannot_be_read_from_the_question():
    src = ChainSource()
    tasks = src.tasks("heldout", 64, 0)
    for t in tasks:
        m = t.metadata
        assert str(m["code"]) not in t.prompt and str(m["value"]) not in t.prompt
        assert t.answer == {"+": m["value"] + m["operand"], "-": m["value"] - m["operand"],
                            "*": m["value"] * m["operand"]}[m["op"]]
    assert len({t.answer for t in tasks}) > 50  # answers spread: nothing to guess


def test_demonstration_solves_with_reward_only_at_the_end():
    src = ChainSource()
    for task in src.tasks("heldout", 16, 1):
        env = src.make_env()
        steps = _play(env, task, [m["content"] for m in src.demonstration(task) if m["role"] == "assistant"])
        assert [s.reward for s in steps] == [0.0, 0.0, 0.0, 1.0]
        assert steps[-1].terminated and steps[-1].info["success"] is True
        assert [k for k, _ in env.calls] == ["lookup", "fetch", "calc"]
        # each result is what the next call needs
        assert steps[0].messages[0]["content"] == f"<result>{task.metadata['code']}</result>"
        assert steps[1].messages[0]["content"] == f"<result>{task.metadata['value']}</result>"


def test_wrong_item_wrong_code_and_bad_calls():
    src = ChainSource()
    task = src.tasks("heldout", 1, 0)[0]
    m = task.metadata
    other = next(k for k in m["directory"] if k != m["item"])
    env = src.make_env()
    steps = _play(env, task, [f"<lookup>{other}</lookup>", f"<fetch>{m['directory'][other]}</fetch>"])
    assert steps[1].messages[0]["content"] == f"<result>{m['records'][str(m['directory'][other])]}</result>"
    errors = _play(env, task, ["<lookup>nothing</lookup>", "<fetch>abc</fetch>", "<calc>1 + 2 * 3</calc>",
                               "I think it is 5"])
    assert [s.info["tool_error"] is not None for s in errors] == [True, True, True, True]
    assert all(s.reward == 0.0 for s in errors)
    assert "no item" in errors[0].messages[0]["content"]
    assert "at most 1 operation" in errors[2].messages[0]["content"]
    last = env.step("still no action")  # the fifth turn: out of turns is a failure (terminated)
    assert last.terminated and not last.truncated and last.info["success"] is False and last.reward == 0.0
    with pytest.raises(RuntimeError):
        env.step("<answer>1</answer>")


def test_a_guess_is_wrong_and_the_first_tag_decides():
    src = ChainSource()
    task = src.tasks("heldout", 1, 2)[0]
    env = src.make_env()
    wrong = _play(env, task, [f"<answer>{task.answer + 1}</answer>"])
    assert wrong[0].terminated and wrong[0].reward == 0.0 and wrong[0].info["success"] is False
    step = _play(env, task, [f"<lookup>{task.metadata['item']}</lookup><answer>{task.answer}</answer>"])[0]
    assert step.info["tool"] == "lookup" and not step.terminated


def test_reset_prompt_has_the_example_as_chat_turns():
    src = ChainSource()
    task = src.tasks("train", 1, 0)[0]
    msgs = src.make_env().reset(task)
    assert [m["role"] for m in msgs] == ["user"] + ["assistant", "user"] * 3 + ["assistant", "user"]
    assert msgs[-1]["content"] == task.prompt
    two = get_task_source("chain", examples=2).make_env().reset(task)
    assert len(two) == len(msgs) + 8 and two[:8] == msgs[:8] and "pear" in two[8]["content"]
    assert get_task_source("chain", system_prompt=None).make_env().reset(task)[0]["role"] == "system"
    assert get_task_source("chain", few_shot=False).make_env().reset(task) == [{"role": "user", "content": task.prompt}]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["train", "heldout"]))
def test_tasks_distinct_for_any_seed(seed, split):
    tasks = ChainSource().tasks(split, 40, seed)
    assert len({t.id for t in tasks}) == 40 and len({(t.prompt, t.metadata["code"]) for t in tasks}) == 40


def test_bad_options_and_arguments():
    with pytest.raises(ValueError, match="max_turns"):
        ChainConfig(max_turns=3)
    with pytest.raises(ValueError, match="examples"):
        ChainConfig(examples=3)
    with pytest.raises(ValueError, match="distractors"):
        get_task_source("chain", distractors=9)
    with pytest.raises(ValueError, match="heldout_fraction"):
        ChainConfig(heldout_fraction=1.0)
    with pytest.raises(ValueError, match="split"):
        ChainSource().tasks("test", 1, 0)
    with pytest.raises(ValueError, match="n"):
        ChainSource().tasks("train", -1, 0)
    with pytest.raises(ValueError, match="task"):
        ChainSource().make_env().reset(get_task_source("calculator").tasks("train", 1, 0)[0])
