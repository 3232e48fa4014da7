"""A new user's own task, end to end: a gymnasium environment whose right answer has punctuation
(outside gymnasium's default `Text` charset), a dataset with a reward function, and a tiny
`save_pretrained` checkpoint, all written here, driven through the CLI, a YAML file naming
`module:factory`, and the three-line Python API. Nothing is refused, and each run keeps the turn
limit it printed (the env spec's `max_episode_steps`, else `task.options.adapter.max_turns`)."""
import json
import textwrap

import pytest
import yaml
from typer.testing import CliRunner

from _tiny_models import save_family_checkpoint

gym = pytest.importorskip("gymnasium")

ENV = '''
import string
import gymnasium as gym


class Radec(gym.Env):
    """Name the hidden word as `answer: WORD`."""

    def __init__(self):
        self.observation_space = gym.spaces.Text(max_length=80, charset=string.printable)
        self.action_space = gym.spaces.Text(max_length=32)  # gymnasium's default charset: no ':' or ' '

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.word = ["radec", "comet", "nova"][int(self.np_random.integers(3))]
        return f"case {seed}: the word has {len(self.word)} letters. Reply 'answer: WORD'.", {}

    def step(self, action):
        ok = action.strip() == f"answer: {self.word}"
        return ("right" if ok else "not it, try again"), float(ok), ok, False, {"success": ok}


gym.register("my_env/Radec-v0", entry_point=f"{__name__}:Radec", max_episode_steps=3)


def make():
    return gym.make("my_env/Radec-v0")
'''

REWARDS = '''
def correct(prompts, completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
'''

FAST = {"train.steps": 1, "train.prompts_per_step": 2, "train.group_size": 2, "task.n_heldout": 2,
        "sampling.max_new_tokens": 6, "eval.before": False, "eval.during_n": None, "log.progress": False,
        "log.tensorboard": False, "checkpoint.every": 0}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp("newuser")
    (d / "my_env.py").write_text(textwrap.dedent(ENV))
    (d / "my_rewards.py").write_text(textwrap.dedent(REWARDS))
    (d / "data.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                                          for i in range(40)))
    save_family_checkpoint("qwen2", d / "my-model")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(d))
    yield d
    mp.undo()


def _turns(run):
    return [len(json.loads(ln)["turns"]) for ln in (run / "trajectories.jsonl").read_text().splitlines()]


def _sets(d):
    return [f"{k}={'null' if v is None else v}" for k, v in d.items()]


def test_the_right_answer_has_punctuation_the_default_text_space_refuses(project):
    import my_env

    env = my_env.make()
    env.reset(seed=0)
    assert not env.action_space.contains("answer: radec")
    from trajgrad.envs import get_task_source

    src = get_task_source("my_env:make")
    e = src.make_env()
    e.reset(src.tasks("train", 1, 0)[0])
    r = e.step(f"answer: {e.env.unwrapped.word}")
    assert r.terminated and r.reward == 1.0 and "invalid_action" not in r.info


def test_cli_with_the_gym_env_and_the_checkpoint(project, tmp_path):
    from trajgrad.cli import app

    # the embedded default config (SmolLM2's schedule), with this checkpoint and environment
    args = ["train", "--run-dir", str(tmp_path / "run"), "--set", f"model.path={project / 'my-model'}",
            "--set", "task.name=my_env:make", "--set", "task.options={}"]
    for s in _sets(FAST):
        args += ["--set", s]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())  # the console wraps long lines
    assert "task: gymnasium environment 'my_env/Radec-v0', turn limit 3 (the env spec's max_episode_steps)" in out
    assert "held-out: 2 distinct tasks (task.n_heldout)" in out
    assert _turns(tmp_path / "run") and set(_turns(tmp_path / "run")) == {3}  # a random model never answers


def test_yaml_module_factory_with_the_adapters_turn_limit(project, tmp_path):
    from trajgrad.cli import app

    cfg = {"name": "my-radec", "model": {"path": str(project / "my-model"), "lora": {"r": 4, "alpha": 8}},
           "task": {"name": "my_env:Radec", "options": {"adapter": {"max_turns": 2}}, "n_heldout": 2},
           "recipe": {"name": "grpo"}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = ["train", str(path), "--run-dir", str(tmp_path / "run")]
    for s in _sets({k: v for k, v in FAST.items() if k != "task.n_heldout"}):
        args += ["--set", s]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "task: gymnasium environment 'Radec', turn limit 2 (task.options.adapter.max_turns)" in out
    assert set(_turns(tmp_path / "run")) == {2}
    rec = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "env/invalid_action_frac" in next(r for r in rec if r.get("kind") == "train")


def test_the_three_line_python_api(project, tmp_path):
    import trajgrad

    lines = []
    s = trajgrad.train(model=str(project / "my-model"), env="my_env:make", overrides=FAST,
                       run_dir=tmp_path / "gym", console=lines.append)
    assert s["steps"] == 1 and set(_turns(tmp_path / "gym")) == {3}
    assert any("turn limit 3 (the env spec's max_episode_steps)" in ln for ln in lines)
    # the default held-out count (64) is more than this dataset's: its distinct ones are evaluated, and said so
    fast = {k: v for k, v in FAST.items() if k != "task.n_heldout"}
    s = trajgrad.train(model=str(project / "my-model"), dataset=project / "data.jsonl", rewards=["my_rewards:correct"],
                       overrides=fast, run_dir=tmp_path / "data", console=lines.append)
    assert s["steps"] == 1 and s["eval_after"]["n"] == 3
    assert "held-out: 3 distinct tasks of the 64 asked for (task.n_heldout); evaluating the 3 distinct ones " \
           "(eval.distinct: warn)" in lines
