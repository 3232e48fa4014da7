"""Tests for trajgrad.envs: the env/rollout contract and the built-in task sources."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.envs import (
    CalculatorSource,
    Environment,
    GuessSource,
    StepResult,
    Task,
    TaskSource,
    available_task_sources,
    extract_tag,
    get_task_source,
    register_task_source,
)
from trajgrad.envs.calculator import _split_of
from trajgrad.envs.sandbox import safe_eval_arithmetic


def replay(env, task, demonstration):
    """Feed the assistant turns of a demonstration; check the observations match it."""
    env.reset(task)
    results = []
    for i, message in enumerate(demonstration):
        if message["role"] != "assistant":
            continue
        result = env.step(message["content"])
        results.append(result)
        expected_next = demonstration[i + 1 : i + 2]
        if expected_next and expected_next[0]["role"] == "user":
            assert result.messages == expected_next
    return results


# --- registry and protocol ----------------------------------------------------------------


def test_builtin_sources_are_registered_and_follow_the_protocols():
    assert {"calculator", "guess"} <= set(available_task_sources())
    for name in ("calculator", "guess"):
        source = get_task_source(name)
        assert source.name == name
        assert isinstance(source, TaskSource)
        env = source.make_env()
        assert isinstance(env, Environment)
        assert env.name == name and env.max_turns >= 1


def test_unknown_source_raises_value_error():
    with pytest.raises(ValueError, match="name"):
        get_task_source("no-such-source")
    with pytest.raises(ValueError, match="name"):
        get_task_source(3)


def test_register_task_source_decorator():
    @register_task_source("test-constant")
    class ConstantSource:
        name = "test-constant"

        def __init__(self, answer=7):
            self.answer = answer

        def tasks(self, split, n, seed):
            return [Task(f"c-{split}-{i}", split, "say 7", self.answer) for i in range(n)]

        def make_env(self, **kwargs):
            raise NotImplementedError

        def demonstration(self, task):
            return [{"role": "assistant", "content": str(task.answer)}]

    source = get_task_source("test-constant", answer=9)
    assert isinstance(source, ConstantSource) and source.answer == 9
    assert "test-constant" in available_task_sources()

    with pytest.raises(ValueError, match="name"):

        @register_task_source("test-constant")
        class Other:  # a different factory under a taken name
            pass

    with pytest.raises(ValueError, match="name"):
        register_task_source("")


def test_registered_task_source_and_is_task_source():
    from trajgrad.envs import base, task
    from trajgrad.envs.adapters import is_task_source

    @register_task_source("test-lookup")
    def factory(**kwargs):
        return get_task_source("calculator", **kwargs)

    assert base.registered_task_source("test-lookup") is factory
    assert base.registered_task_source("test-never-registered") is None
    assert is_task_source(factory()) and not is_task_source(factory)

    class TasksOnly:
        def tasks(self, split, n, seed):
            return []

    assert not is_task_source(TasksOnly())
    # the contract's types are one set of classes, whichever module names them
    assert (base.Task, base.StepResult, base.TaskError, base.TaskSource) == (
        task.Task, task.StepResult, task.TaskError, task.TaskSource)


def test_kwargs_reach_the_configuration():
    source = get_task_source("calculator", ops_per_call=1, max_turns=5, max_operand=9)
    assert source.config.ops_per_call == 1
    env = source.make_env()
    assert env.max_turns == 5
    assert source.make_env(max_turns=2).max_turns == 2  # per-env override
    assert get_task_source("guess", upper=64).make_env().config.upper == 64


def test_extract_tag():
    assert extract_tag("x <calc> 1 + 2 </calc> y", "calc") == "1 + 2"
    assert extract_tag("<a>1</a><a>2</a>", "a") == "1"
    assert extract_tag("<calc>unclosed", "calc") is None
    assert extract_tag("no tags", "calc") is None


def test_task_and_step_result_shapes():
    task = Task("t-1", "train", "q?", 3)
    assert task.metadata == {}
    with pytest.raises(Exception):
        task.answer = 4  # frozen
    result = StepResult([], 1.0, True, False, {"success": True})
    assert result.terminated and not result.truncated and result.info["success"]


# --- calculator: tasks ----------------------------------------------------------------------


def test_calculator_tasks_are_deterministic_by_seed():
    source = CalculatorSource()
    a = source.tasks("train", 20, seed=3)
    assert a == source.tasks("train", 20, seed=3)
    assert a[:5] == source.tasks("train", 5, seed=3)
    assert a != source.tasks("train", 20, seed=4)
    # A fresh source instance gives the same tasks (no hidden global state).
    assert CalculatorSource().tasks("heldout", 10, seed=3) == source.tasks("heldout", 10, seed=3)


def test_calculator_splits_are_disjoint():
    source = CalculatorSource()
    train = [t for seed in range(3) for t in source.tasks("train", 150, seed)]
    heldout = [t for seed in range(3) for t in source.tasks("heldout", 150, seed)]
    train_expr = {t.metadata["expression"] for t in train}
    heldout_expr = {t.metadata["expression"] for t in heldout}
    assert train_expr and heldout_expr and not train_expr & heldout_expr
    assert not {t.id for t in train} & {t.id for t in heldout}
    assert all(t.split == "train" and t.id.startswith("calc-train-") for t in train)
    assert all(t.split == "heldout" and t.id.startswith("calc-heldout-") for t in heldout)
    # The split is a function of the expression alone.
    assert all(_split_of(e, 0.2) == "train" for e in train_expr)
    assert all(_split_of(e, 0.2) == "heldout" for e in heldout_expr)


def test_calculator_tasks_within_one_call_are_distinct():
    tasks = CalculatorSource().tasks("train", 200, seed=0)
    assert len({t.id for t in tasks}) == 200
    assert len({t.metadata["expression"] for t in tasks}) == 200


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    min_ops=st.integers(1, 3),
    extra=st.integers(0, 2),
    max_operand=st.integers(10, 999),
)
def test_calculator_task_contents(seed, min_ops, extra, max_operand):
    source = CalculatorSource(min_ops=min_ops, max_ops=min_ops + extra, max_operand=max_operand)
    for task in source.tasks("train", 5, seed):
        expression = task.metadata["expression"]
        tokens = expression.split()
        operands = [int(tok) for tok in tokens[::2]]
        assert all(1 <= v <= max_operand for v in operands)
        assert all(op in "+-*" for op in tokens[1::2])
        assert min_ops <= task.metadata["n_ops"] == len(tokens) // 2 <= min_ops + extra
        assert task.answer == safe_eval_arithmetic(expression)
        assert task.prompt == f"What is {expression}?"


def test_calculator_bad_arguments():
    source = CalculatorSource()
    with pytest.raises(ValueError, match="split"):
        source.tasks("test", 1, 0)
    with pytest.raises(ValueError, match="n"):
        source.tasks("train", -1, 0)
    with pytest.raises(ValueError, match="seed"):
        source.tasks("train", 1, "zero")
    for kwargs, name in [
        ({"max_turns": 0}, "max_turns"),
        ({"ops_per_call": 0}, "ops_per_call"),
        ({"operators": "/"}, "operators"),
        ({"min_ops": 3, "max_ops": 2}, "min_ops"),
        ({"min_operand": 5, "max_operand": 5}, "min_operand"),
        ({"heldout_fraction": 1.0}, "heldout_fraction"),
        ({"format_bonus": float("nan")}, "format_bonus"),
    ]:
        with pytest.raises(ValueError, match=name):
            CalculatorSource(**kwargs)
    env = source.make_env()
    with pytest.raises(ValueError, match="task"):
        env.reset("What is 1 + 1?")
    with pytest.raises(ValueError, match="task"):
        env.reset(Task("x", "train", "q", 1))  # no expression
    env.reset(source.tasks("train", 1, 0)[0])
    with pytest.raises(ValueError, match="action_text"):
        env.step(None)


# --- calculator: episodes -------------------------------------------------------------------


def test_calculator_reset_has_system_one_shot_and_question():
    source = CalculatorSource()
    task = source.tasks("train", 1, 0)[0]
    messages = source.make_env().reset(task)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "<calc>" in messages[0]["content"] and "<answer>" in messages[0]["content"]
    assert messages[1]["content"] == "What is 17 + 25 * 2?"
    assert messages[2]["content"] == "<calc>17 + 25 * 2</calc>"
    assert messages[3]["content"] == "<result>67</result>"  # 25 * 2 = 50, 17 + 50 = 67
    assert messages[4]["content"] == "<answer>67</answer>"
    assert messages[5]["content"] == task.prompt
    bare = source.make_env(few_shot=False).reset(task)
    assert [m["role"] for m in bare] == ["system", "user"]
    # One operation per call: the example is a single operation (23 * 4 = 92).
    single = CalculatorSource(ops_per_call=1).make_env().reset(task)
    assert single[2]["content"] == "<calc>23 * 4</calc>" and single[3]["content"] == "<result>92</result>"
    assert "1 operation per call" in single[0]["content"]


def test_calculator_example_is_never_a_task():
    source = CalculatorSource(max_operand=30)
    expressions = {t.metadata["expression"] for s in ("train", "heldout") for t in source.tasks(s, 300, 0)}
    assert "17 + 25 * 2" not in expressions and "23 * 4" not in expressions


@pytest.mark.parametrize("ops_per_call", [None, 1])
@pytest.mark.parametrize("split", ["train", "heldout"])
def test_calculator_demonstrations_reach_reward_one(ops_per_call, split):
    source = CalculatorSource(ops_per_call=ops_per_call)
    for task in source.tasks(split, 15, seed=1):
        demo = source.demonstration(task)
        n_calls = sum(m["role"] == "assistant" for m in demo) - 1
        assert n_calls == (1 if ops_per_call is None else task.metadata["n_ops"])
        results = replay(source.make_env(), task, demo)
        last = results[-1]
        assert last.terminated and not last.truncated and last.messages == []
        assert last.reward == 1.0 and last.info["success"] is True
        assert all(not r.terminated and not r.truncated for r in results[:-1])
        assert sum(r.reward for r in results) == pytest.approx(1.1)  # answer + one format bonus
        assert len(results) <= source.config.max_turns


def test_calculator_hand_worked_episode_with_one_operation_per_call():
    source = CalculatorSource(ops_per_call=1)
    task = Task("hand", "train", "What is 12 + 7 * 31 - 5?", 224, {"expression": "12 + 7 * 31 - 5"})
    demo = source.demonstration(task)
    # 7 * 31 = 217; 12 + 217 = 229; 229 - 5 = 224.
    assert [m["content"] for m in demo] == [
        "<calc>7 * 31</calc>",
        "<result>217</result>",
        "<calc>12 + 217</calc>",
        "<result>229</result>",
        "<calc>229 - 5</calc>",
        "<result>224</result>",
        "<answer>224</answer>",
    ]
    env = source.make_env()
    env.reset(task)
    too_many = env.step("<calc>12 + 7 * 31 - 5</calc>")
    assert too_many.messages[0]["content"] == (
        "<result>error: the calculator accepts at most 1 operation per call, got 3</result>"
    )
    assert too_many.reward == 0.0 and too_many.info["tool_error"] is not None


def test_calculator_negative_intermediate_values_are_demonstrated():
    source = CalculatorSource(ops_per_call=1)
    task = Task("neg", "train", "What is 3 - 500 * 2?", -997, {"expression": "3 - 500 * 2"})
    demo = source.demonstration(task)
    # 500 * 2 = 1000; 3 - 1000 = -997.
    assert [m["content"] for m in demo if m["role"] == "assistant"] == [
        "<calc>500 * 2</calc>",
        "<calc>3 - 1000</calc>",
        "<answer>-997</answer>",
    ]
    results = replay(source.make_env(), task, demo)
    assert results[-1].reward == 1.0


def test_calculator_tool_errors_are_visible_and_do_not_crash():
    source = CalculatorSource()
    env = source.make_env(max_turns=10)
    env.reset(source.tasks("train", 1, 0)[0])
    cases = {
        "<calc>1 / 0</calc>": "<result>error: division by zero</result>",
        "<calc>abs(-1)</calc>": "<result>error: function calls are not allowed</result>",
        "<calc>__import__('os')</calc>": "<result>error: '_' is not allowed</result>",
        "<calc></calc>": "<result>error: empty expression</result>",
        "<calc>2 +</calc>": "<result>error: not a valid arithmetic expression: '2 +'</result>",
    }
    for action, observation in cases.items():
        result = env.step(action)
        assert result.messages == [{"role": "user", "content": observation}]
        assert result.reward == 0.0 and not result.terminated and not result.truncated
        assert result.info["tool"] == "calculator" and result.info["tool_error"]
    result = env.step("I think it is big.")
    assert result.messages[0]["content"].startswith("<result>error: no action found")
    assert result.info["tool_error"] == "no action"
    assert [c.ok for c in env.tools.calls] == [False] * 5


def test_calculator_rewards_bonus_once_and_costs_every_call():
    source = CalculatorSource(cost_per_call=0.25, format_bonus=0.1)
    task = Task("t", "train", "What is 2 + 3 * 4?", 14, {"expression": "2 + 3 * 4"})
    env = source.make_env()
    env.reset(task)
    first = env.step("<calc>3 * 4</calc>")
    second = env.step("<calc>2 + 12</calc>")
    assert first.reward == 0.1 and second.reward == 0.0  # the bonus is paid once
    assert first.info["cost"] == 0.25 and second.info["cost"] == 0.25
    wrong = env.step("<answer>15</answer>")
    assert wrong.terminated and wrong.reward == 0.0 and wrong.info["success"] is False
    with pytest.raises(RuntimeError):
        env.step("<answer>14</answer>")


def test_calculator_first_tag_decides_and_answers_are_parsed():
    source = CalculatorSource()
    task = Task("t", "train", "What is 1000 + 234?", 1234, {"expression": "1000 + 234"})
    env = source.make_env()
    env.reset(task)
    # A calculator call written before an answer is a call (the answer is ignored).
    result = env.step("<calc>1000 + 234</calc> <answer>1</answer>")
    assert result.messages == [{"role": "user", "content": "<result>1234</result>"}]
    result = env.step("The answer is <answer>1,234</answer>.")
    assert result.terminated and result.reward == 1.0
    env.reset(task)
    assert env.step("<answer>1234.0</answer>").reward == 1.0
    env.reset(task)
    garbled = env.step("<answer>twelve</answer>")
    assert garbled.terminated and garbled.reward == 0.0 and garbled.info["answer"] is None


def test_calculator_require_call():
    task = Task("t", "train", "What is 2 + 3 * 4?", 14, {"expression": "2 + 3 * 4"})
    lenient, strict = CalculatorSource().make_env(), CalculatorSource(require_call=True).make_env()
    lenient.reset(task)
    assert lenient.step("<answer>14</answer>").reward == 1.0
    strict.reset(task)
    blind = strict.step("<answer>14</answer>")
    assert blind.reward == 0.0 and blind.info["success"] is False
    strict.reset(task)
    strict.step("<calc>1 / 0</calc>")  # a failed call does not count
    assert strict.step("<answer>14</answer>").reward == 0.0
    strict.reset(task)
    strict.step("<calc>2 + 3 * 4</calc>")
    assert strict.step("<answer>14</answer>").reward == 1.0


def test_calculator_truncates_at_max_turns():
    source = CalculatorSource(max_turns=3)
    env = source.make_env()
    task = source.tasks("train", 1, 0)[0]
    env.reset(task)
    r1, r2 = env.step("hmm"), env.step("<calc>1 + 1</calc>")
    assert not r1.truncated and not r2.truncated and r2.messages
    r3 = env.step("<calc>2 + 2</calc>")
    assert r3.truncated and not r3.terminated and r3.messages == []
    assert r3.info["success"] is False
    with pytest.raises(RuntimeError):
        env.step("<answer>1</answer>")
    # An answer on the last allowed turn still counts.
    env.reset(task)
    env.step("a")
    env.step("b")
    last = env.step(f"<answer>{task.answer}</answer>")
    assert last.terminated and not last.truncated and last.reward == 1.0


def test_calculator_tool_authorization_comes_from_the_task():
    source = CalculatorSource()
    task = Task("t", "train", "What is 2 + 2 * 2?", 6, {"expression": "2 + 2 * 2", "allowed_tools": ()})
    env = source.make_env()
    env.reset(task)
    result = env.step("<calc>2 + 2 * 2</calc>")
    assert result.messages[0]["content"] == "<result>error: tool 'calculator' is not authorized for this task</result>"
    assert result.reward == 0.0


def test_calculator_potential():
    source = CalculatorSource()
    task = Task("t", "train", "What is 2 + 3 * 4?", 14, {"expression": "2 + 3 * 4"})  # sub-values 12, 14
    env = source.make_env(max_turns=10)
    env.reset(task)
    assert env.potential() == 0.0
    off = env.step("<calc>2 + 3</calc>")  # 5 is not a sub-expression value
    assert off.info["potential"] == 0.0 == env.potential()
    bad = env.step("<calc>1 / 0</calc>")
    assert bad.info["potential"] == 0.0
    on = env.step("<calc>3 * 4</calc>")  # 12 is
    assert on.info["potential"] == 0.5 == env.potential()
    again = env.step("<calc>1 + 1</calc>")  # the potential stays once reached
    assert again.info["potential"] == 0.5
    end = env.step("<answer>14</answer>")
    assert end.info["potential"] == 0.0 == env.potential()  # terminal state

    truncating = source.make_env(max_turns=1)
    truncating.reset(task)
    cut = truncating.step("<calc>2 + 3 * 4</calc>")
    assert cut.truncated and cut.info["potential"] == 0.5 == truncating.potential()


# --- guess ----------------------------------------------------------------------------------


def test_guess_splits_are_disjoint_and_cover_the_range():
    source = GuessSource()
    train, heldout = set(source.split_values("train")), set(source.split_values("heldout"))
    assert not train & heldout
    assert train | heldout == set(range(1, 33))
    assert len(heldout) == 7  # ceil(0.2 * 32)
    for seed in range(3):
        assert {t.answer for t in source.tasks("train", 50, seed)} <= train
        assert {t.answer for t in source.tasks("heldout", 50, seed)} <= heldout


def test_guess_tasks_are_deterministic_and_ids_unique():
    source = GuessSource()
    a = source.tasks("train", 30, seed=5)
    assert a == source.tasks("train", 30, seed=5)
    assert [t.answer for t in a] != [t.answer for t in source.tasks("train", 30, seed=6)]
    ids = [t.id for seed in range(3) for split in ("train", "heldout") for t in source.tasks(split, 30, seed)]
    assert len(ids) == len(set(ids))


def test_guess_demonstration_is_binary_search_and_reaches_reward_one():
    source = GuessSource()
    for target in range(1, 33):
        task = Task(f"g{target}", "train", "guess", target, {"upper": 32})
        demo = source.demonstration(task)
        results = replay(source.make_env(), task, demo)
        assert results[-1].terminated and results[-1].reward == 1.0 and results[-1].info["success"]
        assert len(results) <= 6
    # Hand-worked: secret 6 -> guesses 16 (lower), 8 (lower), 4 (higher), 6.
    demo = source.demonstration(Task("g", "train", "guess", 6, {"upper": 32}))
    assert [m["content"] for m in demo] == [
        "<guess>16</guess>", "lower", "<guess>8</guess>", "lower", "<guess>4</guess>", "higher", "<guess>6</guess>",
    ]


def test_guess_reset_and_few_shot():
    source = GuessSource()
    task = source.tasks("train", 1, 0)[0]
    messages = source.make_env().reset(task)
    assert messages[0]["role"] == "system" and messages[-1] == {"role": "user", "content": task.prompt}
    example = [m["content"] for m in messages[1:-1]]
    # Example game: N = 8, secret 5 -> 4 (higher), 6 (lower), 5.
    assert example == ["I am thinking of an integer between 1 and 8. Guess it.",
                       "<guess>4</guess>", "higher", "<guess>6</guess>", "lower", "<guess>5</guess>"]
    assert len(source.make_env(few_shot=False).reset(task)) == 2


def test_guess_malformed_actions_and_truncation():
    source = GuessSource(max_turns=4)
    env = source.make_env()
    env.reset(Task("g", "train", "guess", 20, {"upper": 32}))
    for action, what in [
        ("I guess twenty", "no <guess>K</guess> found"),
        ("<guess>abc</guess>", "no <guess>K</guess> found"),
        ("<guess>99</guess>", "99 is out of range"),
    ]:
        result = env.step(action)
        assert result.messages[0]["content"].startswith(f"error: {what}")
        assert result.reward == 0.0 and not result.terminated and not result.truncated
        assert result.info["potential"] == -1.0  # nothing learned
    last = env.step("<guess>10</guess>")
    assert last.truncated and not last.terminated and last.messages == []
    assert last.info["success"] is False
    with pytest.raises(RuntimeError):
        env.step("<guess>20</guess>")


def test_guess_turn_cost():
    env = GuessSource(turn_cost=0.05).make_env()
    env.reset(Task("g", "train", "guess", 3, {"upper": 32}))
    assert env.step("<guess>16</guess>").reward == pytest.approx(-0.05)
    assert env.step("<guess>3</guess>").reward == pytest.approx(0.95)


def test_guess_potential_hand_values():
    env = GuessSource().make_env()
    env.reset(Task("g", "train", "guess", 6, {"upper": 32}))
    assert env.potential() == -1.0  # -log2(32) / log2(32)
    r = env.step("<guess>16</guess>")  # [1, 15]: -log2(15) / 5 = -3.9068906 / 5
    assert r.info["potential"] == pytest.approx(-0.78137812, abs=1e-8)
    r = env.step("<guess>8</guess>")  # [1, 7]: -log2(7) / 5 = -2.8073549 / 5
    assert r.info["potential"] == pytest.approx(-0.56147098, abs=1e-8)
    r = env.step("<guess>4</guess>")  # [5, 7]: -log2(3) / 5 = -1.5849625 / 5
    assert r.info["potential"] == pytest.approx(-0.31699250, abs=1e-8)
    r = env.step("<guess>6</guess>")
    assert r.info["potential"] == 0.0 == env.potential()


@settings(max_examples=40, deadline=None)
@given(
    upper=st.integers(2, 64),
    data=st.data(),
)
def test_guess_potential_tracks_the_consistent_set(upper, data):
    target = data.draw(st.integers(1, upper))
    guesses = data.draw(st.lists(st.integers(1, upper), min_size=1, max_size=8))
    env = GuessSource(upper=upper, max_turns=20).make_env()
    env.reset(Task("g", "train", "guess", target, {"upper": upper}))
    consistent = set(range(1, upper + 1))
    previous = env.potential()
    for k in guesses:
        result = env.step(f"<guess>{k}</guess>")
        if k == target:
            assert result.terminated and result.info["potential"] == 0.0
            break
        reply = result.messages[0]["content"]
        assert reply == ("higher" if target > k else "lower")
        consistent = {v for v in consistent if (v > k if reply == "higher" else v < k)}
        assert target in consistent
        assert env.interval == (min(consistent), max(consistent))
        expected = -math.log2(len(consistent)) / math.log2(upper)
        assert result.info["potential"] == pytest.approx(expected)
        assert result.info["potential"] >= previous - 1e-12  # information never decreases
        previous = result.info["potential"]


def test_guess_compaction_every_k_turns():
    source = GuessSource(compact_every=2, max_turns=6)
    env = source.make_env()
    task = Task("g", "train", "I am thinking of an integer between 1 and 32. Guess it.", 6, {"upper": 32})
    env.reset(task)
    results = [env.step(f"<guess>{k}</guess>") for k in (16, 8, 4)]
    assert ["compact" in r.info for r in results] == [False, True, False]
    # After 16 (lower) and 8 (lower) the secret is in [1, 7].
    assert results[1].info["compact"] == "Summary of the game so far: after 2 guesses, the secret is between 1 and 7."
    context = env.compacted_messages(results[1].info["compact"])
    assert context[0]["role"] == "system" and context[-1]["role"] == "user"
    assert context[-1]["content"].endswith("the secret is between 1 and 7.")
    assert context[-1]["content"].startswith(task.prompt)
    # The episode continues unchanged after a compaction point.
    final = env.step("<guess>6</guess>")
    assert final.terminated and final.reward == 1.0 and "compact" not in final.info
    # Without the option there is never a compaction.
    plain = GuessSource().make_env()
    plain.reset(task)
    assert all("compact" not in plain.step(f"<guess>{k}</guess>").info for k in (16, 8, 4))


def test_guess_bad_arguments():
    source = GuessSource()
    with pytest.raises(ValueError, match="split"):
        source.tasks("validation", 1, 0)
    with pytest.raises(ValueError, match="n"):
        source.tasks("train", -2, 0)
    for kwargs, name in [
        ({"upper": 1}, "upper"),
        ({"max_turns": 0}, "max_turns"),
        ({"compact_every": 0}, "compact_every"),
        ({"turn_cost": -1.0}, "turn_cost"),
    ]:
        with pytest.raises(ValueError, match=name):
            GuessSource(**kwargs)
    env = source.make_env()
    with pytest.raises(ValueError, match="task"):
        env.reset(Task("g", "train", "guess", 40, {"upper": 32}))
    with pytest.raises(RuntimeError):
        env.step("<guess>1</guess>")  # no episode yet


def test_calculator_system_prompt_option():
    from trajgrad.envs import get_task_source

    src = get_task_source("calculator", few_shot=False, system_prompt="")
    task = src.tasks("train", 1, 0)[0]
    msgs = src.make_env().reset(task)
    assert [m["role"] for m in msgs] == ["user"]
    src2 = get_task_source("calculator", few_shot=False, system_prompt="Use <calc>.")
    assert src2.make_env().reset(task)[0] == {"role": "system", "content": "Use <calc>."}
    with pytest.raises(ValueError, match="system_prompt"):
        get_task_source("calculator", system_prompt=3)
