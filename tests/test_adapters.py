"""Environments of other libraries plugged in unchanged: gymnasium (text spaces), verifiers (Taskset +
rubric) and OpenEnv (served over HTTP on loopback); import-string task names and their errors.

Each adapter runs against a real instance of its library and trains 2 steps on the tiny model."""
import json
import socket
import threading
import time

import pytest

from trajgrad.envs import get_task_source
from trajgrad.train.config import load_config

ME = __name__
gym = pytest.importorskip("gymnasium")


# ----------------------------------------------------------------------------- gymnasium
class EchoDigit(gym.Env):
    """Text in, text out: the agent must reply with the digit it is shown."""

    def __init__(self, rounds: int = 2):
        self.observation_space = gym.spaces.Text(max_length=64, charset="0123456789abcdefghijklmnopqrstuvwxyz ")
        self.action_space = gym.spaces.Text(max_length=16, charset="0123456789abcdefghijklmnopqrstuvwxyz .")
        self.rounds, self._digit, self._t = rounds, "0", 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        self._digit = str(self.np_random.integers(10))
        return f"say {self._digit}", {}

    def step(self, action):
        self._t += 1
        ok = action.strip() == self._digit
        done = ok or self._t >= self.rounds
        self._digit = str(self.np_random.integers(10))
        return f"say {self._digit}", float(ok), done, False, {"success": ok}


def make_gym(rounds: int = 2):
    return EchoDigit(rounds)


def not_a_factory_result():
    return 42


def test_gymnasium_adapter_episode_and_splits():
    src = get_task_source(f"{ME}:make_gym", rounds=3, adapter={"max_turns": 2})
    assert type(src).__name__ == "GymSource"
    train, held = src.tasks("train", 5, 0), src.tasks("heldout", 5, 0)
    assert not {t.metadata["seed"] for t in train} & {t.metadata["seed"] for t in held}
    env = src.make_env()
    msgs = env.reset(train[0])
    digit = msgs[-1]["content"].split()[-1]
    assert msgs == [{"role": "user", "content": f"say {digit}"}]
    assert env.reset(train[0]) == msgs  # seeded
    r = env.step("WRONG!")  # outside the Text action space, yet the environment decides: it goes on
    assert r.messages[0]["content"].startswith("say ") and "invalid_action" not in r.info and not r.terminated
    env.reset(train[0])
    r = env.step(digit)
    assert r.terminated and r.reward == 1.0 and r.info["success"] is True
    env.reset(train[0])
    r1 = env.step("x")
    assert r1.messages[0]["role"] == "user" and r1.reward == 0.0 and not (r1.terminated or r1.truncated)
    r2 = env.step("x")  # adapter's max_turns=2 cuts before the env's 3 rounds
    assert r2.truncated and r2.info["success"] is False
    # gymnasium.make of a registered id works the same way
    gym.register("trajgrad-test/EchoDigit-v0", entry_point=f"{ME}:EchoDigit", max_episode_steps=2)
    src = get_task_source("gymnasium:make", id="trajgrad-test/EchoDigit-v0")
    assert src.max_turns == 2 and src.make_env().reset(train[0])[0]["content"].startswith("say ")


@pytest.mark.parametrize("name, key, words", [
    ("no_such_pkg_abc:make", "task.name", ["cannot import module 'no_such_pkg_abc'"]),
    (f"{ME}:nothing_here", "task.name", ["has no attribute 'nothing_here'"]),
    (f"{ME}:ME", "task.name", ["not a callable factory"]),
    (f"{ME}:not_a_factory_result", "task.name", ["returned a int", "expected a task source"]),
    ("bad name:x y", "task.name", ["expected an import string"]),
])
def test_bad_import_strings_name_task_name(name, key, words):
    with pytest.raises(ValueError) as e:
        load_config(preset="tiny", overrides={"task.name": name, "task.options": {}})
    msg = str(e.value)
    assert msg.startswith(f"{key}:"), msg
    for w in words:
        assert w in msg, msg
    with pytest.raises(ValueError, match=r"^task\.options"):
        load_config(preset="tiny", overrides={"task.name": f"{ME}:make_gym", "task.options": {"colour": 1}})


def _two_steps(tmp_path, name, options, **extra):
    import trajgrad

    over = {"train.steps": 2, "train.prompts_per_step": 2, "train.group_size": 2, "sft.steps": 0,
            "task.n_heldout": 2, "sampling.max_new_tokens": 4, "log.progress": False, "checkpoint.every": 0,
            "task.options": options, **extra}
    return trajgrad.train(model="tiny", env=name, overrides=over, run_dir=tmp_path / "run", console=lambda m: None)


def test_gymnasium_environment_trains_two_steps(tmp_path):
    s = _two_steps(tmp_path, f"{ME}:make_gym", {"rounds": 2, "adapter": {"max_turns": 2}})
    assert s["steps"] == 2 and s["eval_after"]["n"] == 2


# ----------------------------------------------------------------------------- verifiers
def load_environment(n: int = 12):
    """A verifiers environment as a package would ship it: a Taskset whose Task carries the rubric."""
    import verifiers.v1 as vf

    class SumData(vf.TaskData):
        answer: str = ""

    class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
        @vf.reward(weight=1.0)
        async def correct(self, task, trace) -> float:
            return float(trace.last_reply == task.answer)

        @vf.reward(weight=0.5)
        async def brief(self, trace) -> float:
            return float(len(trace.last_reply) <= 2)

    class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
        def load(self):
            for i in range(n):
                yield SumTask(SumData(prompt=f"{i}+1=", answer=str(i + 1), system_prompt="Reply with a number."))

    return SumTaskset(vf.TasksetConfig())


def test_verifiers_adapter_scores_with_the_rubric():
    src = get_task_source(f"{ME}:load_environment", n=12, adapter={"heldout_fraction": 0.25})
    assert type(src).__name__ == "VerifiersSource"
    train, held = src.tasks("train", 20, 0), src.tasks("heldout", 2, 0)
    assert not {t.metadata["vf_key"] for t in train} & {t.metadata["vf_key"] for t in held}
    t = train[0]
    env = src.make_env()
    assert env.reset(t) == [{"role": "system", "content": "Reply with a number."}, {"role": "user", "content": t.prompt}]
    r = env.step(t.answer)
    assert r.terminated and r.reward == pytest.approx(1.0 + 0.5 * (len(t.answer) <= 2))
    assert r.info["reward/correct"] == 1.0 and r.info["success"] is True
    env.reset(t)
    r = env.step("no idea")
    assert r.reward == 0.0 and r.info["success"] is False
    assert src.demonstration(t) == [{"role": "assistant", "content": t.answer}]


def test_verifiers_environment_trains_two_steps(tmp_path):
    s = _two_steps(tmp_path, f"{ME}:load_environment", {"n": 12})
    assert s["steps"] == 2 and s["eval_after"]["n"] == 2


# ----------------------------------------------------------------------------- OpenEnv
def _openenv_app():
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class GuessAction(Action):
        message: str

    class GuessObservation(Observation):
        prompt: str = ""

    class ParityEnv(Environment):
        """Say whether the shown number is even or odd."""

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._n, self._state = 0, State(episode_id="e", step_count=0)

        def reset(self, seed=None, episode_id=None, **kwargs):
            self._n = (seed or 0) * 7 % 100
            self._state = State(episode_id=episode_id or "e", step_count=0)
            return GuessObservation(prompt=f"Is {self._n} even or odd?")

        def step(self, action, timeout_s=None, **kwargs):
            self._state.step_count += 1
            want = "even" if self._n % 2 == 0 else "odd"
            ok = action.message.strip().lower() == want
            done = ok or self._state.step_count >= 2
            return GuessObservation(prompt="try again", done=done, reward=1.0 if ok else 0.0,
                                    metadata={"success": ok})

        @property
        def state(self):
            return self._state

    return create_fastapi_app(ParityEnv, GuessAction, GuessObservation, max_concurrent_envs=16)


@pytest.fixture(scope="module")
def openenv_url():
    pytest.importorskip("openenv")
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(_openenv_app(), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_openenv_adapter_over_http(openenv_url):
    src = get_task_source("openenv", base_url=openenv_url, max_turns=3)
    train = src.tasks("train", 3, 0)
    env = src.make_env()
    msgs = env.reset(train[1])
    n = int(msgs[0]["content"].split()[1])
    assert msgs == [{"role": "user", "content": f"Is {n} even or odd?"}]
    r = env.step("wrong")
    assert r.messages == [{"role": "user", "content": "try again"}] and r.reward == 0.0 and not r.terminated
    r = env.step("even" if n % 2 == 0 else "odd")
    assert r.terminated and r.reward == 1.0 and r.info["success"] is True


def test_openenv_config_errors_and_missing_server():
    with pytest.raises(ValueError, match=r"^task\.options\.base_url: expected an http"):
        load_config(preset="tiny", overrides={"task.name": "openenv", "task.options": {"base_url": "ftp://x"}})
    with pytest.raises(ValueError, match=r"^task\.options\.max_turns: .*integer"):
        load_config(preset="tiny", overrides={"task.name": "openenv",
                                              "task.options": {"base_url": "http://127.0.0.1:1", "max_turns": 1.5}})
    env = get_task_source("openenv", base_url="http://127.0.0.1:9", timeout_s=1.0).make_env()
    with pytest.raises(Exception):
        env.reset(get_task_source("openenv").tasks("train", 1, 0)[0])


def test_openenv_environment_trains_two_steps(tmp_path, openenv_url):
    s = _two_steps(tmp_path, "openenv", {"base_url": openenv_url, "max_turns": 2})
    assert s["steps"] == 2 and s["eval_after"]["n"] == 2


class _BadToolSource:
    """A user's task source whose environment has a tool without type hints."""

    def tasks(self, split, n, seed):
        return []

    def make_env(self, **kwargs):
        from trajgrad.envs import ToolEnv

        def peek(x):
            """No hint on x."""

        return ToolEnv([peek], lambda text, task: 0.0)

    def demonstration(self, task):
        return []


def bad_tool_source():
    return _BadToolSource()


def test_a_tool_schema_that_cannot_be_built_fails_at_config_load():
    with pytest.raises(ValueError, match=r"^task\.name: building an environment of .* fn: peek, parameter 'x': "
                                         r"has no type hint"):
        load_config(preset="tiny", overrides={"task.name": f"{ME}:bad_tool_source", "task.options": {}})
