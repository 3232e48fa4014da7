"""Task source "higher_lower": a gymnasium number-guessing game run through the gymnasium adapter."""
from __future__ import annotations

import pytest

pytest.importorskip("gymnasium")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trajgrad.envs import available_task_sources, get_task_source  # noqa: E402
from trajgrad.envs.adapters.gym import GymEnvironment, GymSource  # noqa: E402
from trajgrad.envs.games import GameConfig, game_of_seed, make_higher_lower_env  # noqa: E402


def _play(env, task, replies):
    first = env.reset(task)
    steps = []
    for text in replies:
        steps.append(env.step(text))
        if steps[-1].terminated or steps[-1].truncated:
            break
    return first, steps


def test_is_a_gymnasium_env_driven_by_the_adapter():
    import gymnasium

    src = get_task_source("higher_lower")
    assert "higher_lower" in available_task_sources()
    assert isinstance(src, GymSource)
    env = src.make_env()
    assert isinstance(env, GymEnvironment) and isinstance(env.env, gymnasium.Env)
    task = src.tasks("heldout", 1, 0)[0]
    first, _ = _play(env, task, [])
    assert first == [{"role": "user", "content": task.prompt}]
    from gymnasium.utils.env_checker import check_env

    check_env(make_higher_lower_env(), skip_render_check=True)


def test_heldout_distinct_games_disjoint_from_train():
    src = get_task_source("higher_lower")
    game = lambda t: (t.metadata["low"], t.answer)  # noqa: E731
    held = src.tasks("heldout", 128, 0)
    train = src.tasks("train", 1000, 5)
    assert len({game(t) for t in held}) == 128
    assert not {game(t) for t in held} & {game(t) for t in train}
    assert [t.metadata["seed"] for t in src.tasks("heldout", 64, 7)] == [t.metadata["seed"] for t in held[:64]]
    for t in held[:10]:
        assert game_of_seed(t.metadata["seed"], 20, 80) == game(t)


def test_binary_search_wins_and_feedback_each_turn():
    src = get_task_source("higher_lower")
    for task in src.tasks("heldout", 20, 0):
        demo = [m["content"] for m in src.demonstration(task) if m["role"] == "assistant"]
        assert len(demo) <= 5
        _, steps = _play(src.make_env(), task, demo)
        assert steps[-1].terminated and steps[-1].reward == 1.0 and steps[-1].info["success"] is True
        for s, guess in zip(steps[:-1], demo):
            want = "higher" if int(guess) < task.answer else "lower"
            assert want in s.messages[0]["content"] and s.reward == 0.0


def test_out_of_guesses_and_bad_replies():
    src = get_task_source("higher_lower")
    task = src.tasks("heldout", 1, 0)[0]
    low = task.metadata["low"]
    wrong = low if task.answer != low else low + 1
    _, steps = _play(src.make_env(), task, ["no idea", str(low - 5), "é", str(wrong), str(wrong)])
    assert "Reply with one number" in steps[0].messages[0]["content"]
    assert "is not between" in steps[1].messages[0]["content"]
    # outside the Text space's charset: the adapter passes it to step all the same, and the game answers it
    assert "Reply with one number" in steps[2].messages[0]["content"] and "tool_error" not in steps[2].info
    assert steps[-1].truncated and not steps[-1].terminated and steps[-1].info["success"] is False
    assert len(steps) == 5 and all(s.reward == 0.0 for s in steps)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10**7))
def test_seed_to_game_is_a_bijection_on_consecutive_seeds(start):
    games = {game_of_seed(s, 20, 80) for s in range(start, start + 1600)}
    assert len(games) == 1600
    assert all(1 <= low <= 80 and low <= secret < low + 20 for low, secret in games)


def test_bad_options():
    with pytest.raises(ValueError, match="width"):
        GameConfig(width=1)
    with pytest.raises(ValueError, match="max_turns"):
        get_task_source("higher_lower", max_turns=0)
    with pytest.raises(ValueError, match="heldout_fraction"):
        GameConfig(heldout_fraction=0.0)
    with pytest.raises(ValueError, match="split"):
        get_task_source("higher_lower").tasks("dev", 1, 0)


def test_example_game_as_chat_turns():
    src = get_task_source("higher_lower", example=False, example_turns=True, system_prompt="Play.")
    task = src.tasks("heldout", 1, 0)[0]
    env = src.make_env()
    msgs = env.reset(task)
    assert [m["role"] for m in msgs] == ["system", "user"] + ["assistant", "user"] * 3 + ["user"]
    assert msgs[-1]["content"] == task.prompt and "Example" not in task.prompt
    assert msgs[2:8:2] == [{"role": "assistant", "content": g} for g in ("10", "5", "7")]
    assert msgs[7]["content"].startswith("Correct!")
    # stepping is the adapter's: the gymnasium env answers
    assert env.step(str(task.answer)).info["success"] is True
