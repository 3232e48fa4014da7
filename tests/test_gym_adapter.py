"""The gymnasium adapter lets the environment decide what it accepts: every reply reaches `step`;
a refusal (an exception, or a flag in `info`) is counted and shown in the environment's words.
The turn limit comes from the env spec, else the adapter option, and is printed; a non-text
observation is refused when the source is built."""
import json
import string

import pytest

from trajgrad.envs import get_task_source
from trajgrad.train.config import load_config
from trajgrad.train.metrics import read_metrics
from trajgrad.train.rewards import invalid_action_facts

gym = pytest.importorskip("gymnasium")
ME = __name__


class Radec(gym.Env):
    """Answer with `answer: radec`. The action space is gymnasium's default `Text` (alphanumeric: no
    colon, no space); a reply without `answer:` raises, one that names another word is flagged in `info`."""

    def __init__(self, rounds: int = 3, flag: str = "invalid_action"):
        self.observation_space = gym.spaces.Text(max_length=64, charset=string.printable)
        self.action_space = gym.spaces.Text(max_length=32)
        self.rounds, self.flag, self._t = rounds, flag, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return f"puzzle {self.np_random.integers(10**6)}: what is the word? reply 'answer: WORD'", {}

    def step(self, action):
        self._t += 1
        if not action.startswith("answer:"):
            raise ValueError("replies start with 'answer:'")
        ok = action == "answer: radec"
        info = {"success": ok}
        if not ok and action != "answer: pass":
            info.update({"invalid_action": True} if self.flag == "invalid_action" else
                        {"metrics": {"action_is_valid": False}})
        done = ok or self._t >= self.rounds
        return ("correct" if ok else "no such word"), float(ok), done, False, info


def make_radec(rounds: int = 3, flag: str = "invalid_action"):
    return Radec(rounds, flag)


class DictObs(Radec):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return {"board": [1, 2]}, {}


def make_dict_obs():
    return DictObs()


def _episode(src):
    env = src.make_env()
    return env, env.reset(src.tasks("train", 1, 0)[0])


def test_punctuation_reaches_the_environment():
    space = gym.spaces.Text(max_length=32)
    assert not space.contains("answer: radec")  # what the adapter used to refuse
    env, _ = _episode(get_task_source(f"{ME}:make_radec"))
    r = env.step("answer: radec")
    assert r.terminated and r.reward == 1.0 and r.info == {"success": True}


@pytest.mark.parametrize("flag, reason", [("invalid_action", "invalid_action"), ("metrics", "action_is_valid")])
def test_refusals_are_counted_in_the_environments_words(flag, reason):
    src = get_task_source(f"{ME}:make_radec", flag=flag, adapter={"max_turns": 3})
    env, _ = _episode(src)
    r1 = env.step("radec")  # step raises: its message, the episode goes on
    assert r1.messages == [{"role": "user", "content": "error: replies start with 'answer:'"}]
    assert r1.info == {"invalid_action": "ValueError"} and r1.reward == 0.0 and not (r1.terminated or r1.truncated)
    r2 = env.step("answer: comet")  # flagged in info: the environment's own observation is its message
    assert r2.messages == [{"role": "user", "content": "no such word"}] and r2.info["invalid_action"] == reason
    r3 = env.step("answer: pass")  # a valid action that ends the episode (the env's 3 rounds)
    assert r3.terminated and "invalid_action" not in r3.info and r3.info["success"] is False

    class T:  # the turns of two trajectories, as the trainer's learn() sees them
        def __init__(self, infos):
            self.turns = [type("Turn", (), {"info": i})() for i in infos]

    facts = invalid_action_facts([T([r1.info, r2.info, r3.info]), T([{"success": True}])])
    assert facts == {"env/invalid_action_frac": 0.5, "env/invalid_action/ValueError": 1.0,
                     f"env/invalid_action/{reason}": 1.0}


def test_turn_limit_spec_then_adapter_option_then_default():
    src = get_task_source(f"{ME}:make_radec", adapter={"max_turns": 2})
    assert src.max_turns == 2 and "turn limit 2 (task.options.adapter.max_turns)" in src.notes[0]
    env, _ = _episode(src)
    assert not env.step("x").truncated
    last = env.step("y")
    assert last.truncated and last.info["success"] is False and last.info["invalid_action"] == "ValueError"
    src = get_task_source(f"{ME}:make_radec")
    assert src.max_turns == 8 and "set task.options.adapter.max_turns" in src.notes[0]
    gym.register("trajgrad-test/Radec-v0", entry_point=f"{ME}:make_radec", max_episode_steps=3)
    src = get_task_source("gymnasium:make", id="trajgrad-test/Radec-v0")
    assert src.max_turns == 3 and "turn limit 3 (the env spec's max_episode_steps)" in src.notes[0]
    spec_limit = r"max_turns: the spec of 'trajgrad-test/Radec-v0' sets max_episode_steps=3, the turn limit"
    with pytest.raises(ValueError, match=r"^adapter\." + spec_limit):
        get_task_source("gymnasium:make", id="trajgrad-test/Radec-v0", adapter={"max_turns": 5})
    with pytest.raises(ValueError, match=r"^task\.options\.adapter\." + spec_limit):
        load_config(preset="tiny", overrides={"task.name": "gymnasium:make", "sft.steps": 0, "task.options": {
            "id": "trajgrad-test/Radec-v0", "adapter": {"max_turns": 5}}})


def test_a_non_text_observation_is_refused_at_load():
    with pytest.raises(ValueError) as e:
        load_config(preset="tiny", overrides={"task.name": f"{ME}:make_dict_obs", "task.options": {},
                                              "sft.steps": 0, "task.n_heldout": 2})
    msg = str(e.value)
    assert msg.startswith("task.name: the gymnasium environment 'DictObs' returned an observation of type dict"), msg
    assert "ObservationWrapper" in msg and "\n" not in msg


def test_a_run_prints_the_turn_limit_and_logs_invalid_actions(tmp_path):
    import trajgrad

    lines = []
    over = {"train.steps": 1, "train.prompts_per_step": 2, "train.group_size": 2, "sft.steps": 0,
            "task.n_heldout": 2, "sampling.max_new_tokens": 4, "log.progress": False, "checkpoint.every": 0,
            "eval.before": False, "eval.after": False, "task.options": {"adapter": {"max_turns": 2}}}
    trajgrad.train(model="tiny", env=f"{ME}:make_radec", overrides=over, run_dir=tmp_path / "run",
                   console=lines.append)
    assert any("gymnasium environment 'Radec', turn limit 2 (task.options.adapter.max_turns)" in ln for ln in lines)
    rec = read_metrics(tmp_path / "run", kind="train")[0]
    # a random tiny model never writes 'answer:': every turn (2 prompts x 2 samples x 2 turns) is the env's ValueError
    assert rec["env/invalid_action_frac"] == 1.0 and rec["env/invalid_action/ValueError"] == 8.0
    turns = [json.loads(ln)["turns"] for ln in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert all(len(t) == 2 for t in turns)


def test_sft_with_a_gym_env_is_refused_at_load_leaving_no_run_dir(tmp_path):
    from typer.testing import CliRunner

    from trajgrad.cli import app

    res = CliRunner().invoke(app, ["train", "--preset", "tiny", "--run-dir", str(tmp_path / "run"),
                                   "--set", f"task.name={ME}:make_radec", "--set", "task.options={}",
                                   "--set", "task.n_heldout=4"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (f"error: sft.steps: 300 SFT steps train on demonstrations; task '{ME}:make_radec': "
                                  "a gymnasium environment has no demonstrations; set sft.steps to 0")
    assert not (tmp_path / "run").exists()


def test_the_python_api_leaves_a_presets_sft_and_heldout_count_to_its_own_task(tmp_path):
    from trajgrad.api import build_config

    cfg = build_config(model="tiny", env=f"{ME}:make_radec")
    assert (cfg.sft.steps, cfg.eval.distinct, cfg.task.n_heldout) == (0, "warn", 128)
    with pytest.raises(ValueError, match=r"^sft\.steps: 5 SFT steps train on demonstrations; .*set sft\.steps to 0$"):
        build_config(model="tiny", env=f"{ME}:make_radec", overrides={"sft.steps": 5})
    assert build_config(model="tiny", env=f"{ME}:make_radec", overrides={"task.n_heldout": 4}).eval.distinct == "refuse"
