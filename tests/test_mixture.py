"""Several environments in one run (``tasks:``): the stratified split, per-environment advantages,
config errors, and a mixed run of the calculator and a gymnasium environment on the tiny model."""
from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from trajgrad.objective import get_recipe
from trajgrad.train.config import build_config, load_config
from trajgrad.train.mixture import Member, Mixture, SPLIT_SALT, explain_config, split_counts
from trajgrad.train.seeding import step_seed

gym = pytest.importorskip("gymnasium")
ME = __name__


# ----------------------------------------------------------------------------- the split
@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=0.01, max_value=100.0), min_size=1, max_size=6), st.integers(0, 200),
       st.integers(0, 2**31 - 2))
def test_split_sums_to_P_keeps_shares_starves_none_and_is_deterministic(weights, extra, seed):
    P = len(weights) + extra
    counts = split_counts(weights, P, seed)
    assert counts == split_counts(weights, P, seed)  # deterministic per seed
    assert sum(counts) == P
    assert min(counts) >= 1  # none starved with P >= number of environments
    target = [w / sum(weights) * P for w in weights]
    small = sum(1 for t in target if t < 1)
    for c, t in zip(counts, target):
        assert abs(c - t) < 1 + small
        if small == 0:
            assert abs(c - t) < 1  # the stratified rule: each count within one prompt of its share


def test_split_remainder_is_drawn_from_the_seed():
    # three equal weights, P = 4: one prompt of remainder, its environment drawn from the seed
    winners = {tuple(split_counts([1, 1, 1], 4, s)) for s in range(40)}
    assert winners == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
    # rounded up too often (3 x round(1.5) = 6 > 5): one environment gives one back
    assert sorted(split_counts([1, 1, 1], 5, 3)) == [1, 2, 2]
    assert split_counts([0.98, 0.01, 0.01], 3, 0) == [1, 1, 1]  # w P < 1/2: not starved


@pytest.mark.parametrize("weights,P", [([1, 1, 1], 2), ([], 3), ([1, -1], 4), ([1, float("nan")], 4)])
def test_split_refuses_too_few_prompts_and_bad_weights(weights, P):
    with pytest.raises(ValueError, match=r"^(P|weights):"):
        split_counts(weights, P, 0)


# ----------------------------------------------------------------------------- advantages
def test_advantages_are_computed_within_each_environment_by_its_own_objective():
    """Environment a: GRPO's group std, G = 2, rewards in {0, 1}. Environment b: batch std, G = 3,
    rewards in tens. The batch interleaves them and even gives a's and b's first groups the same
    group id: a hand computation of each environment on its own."""
    base = get_recipe("grpo", group_size=2)
    a = Member("a", 1.0, None, [], [], base, 0)
    b = Member("b", 1.0, None, [], [], base.replace(group_size=3, advantage="batch_std"), 0)
    mix = Mixture([a, b], seed=0)
    envs = ["a", "b", "a", "b", "b", "a", "a", "b", "b", "b"]
    r = torch.tensor([0.0, 10.0, 1.0, 20.0, 60.0, 1.0, 1.0, 0.0, 0.0, 30.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 2, 2])  # a's group 0 and b's group 0 share id 0
    trajs = [SimpleNamespace(metadata={"environment": e}) for e in envs]
    metrics = {}
    ga = mix.sequence_advantages(r, gid, trajs, metrics)
    eps = 1e-6
    # a: group (0, 1): mean 0.5, population std 0.5; group (1, 1): zero variance -> 0
    want_a = [(0 - 0.5) / (0.5 + eps), (1 - 0.5) / (0.5 + eps), 0.0, 0.0]
    # b: groups (10, 20, 60) and (0, 0, 30), centred by their group means 30 and 10, scaled by the
    # population std of b's six rewards only: mean 20, sum of squared deviations 2600
    sb = math.sqrt(2600 / 6)
    want_b = [(x - m) / (sb + eps) for x, m in zip([10, 20, 60, 0, 0, 30], [30, 30, 30, 10, 10, 10])]
    got = ga.advantages.tolist()
    assert [got[i] for i, e in enumerate(envs) if e == "a"] == pytest.approx(want_a, rel=1e-9)
    assert [got[i] for i, e in enumerate(envs) if e == "b"] == pytest.approx(want_b, rel=1e-9)
    assert ga.zero_variance.tolist() == [False, True, False, False]
    assert metrics == {"env/a/zero_variance_frac": 0.5, "env/b/zero_variance_frac": 0.0}
    # one objective over the whole batch (what a run with one task computes) gives other numbers
    whole = base.replace(group_size=3, advantage="batch_std").sequence_advantages(r, group_ids=gid).advantages
    assert not torch.allclose(whole, ga.advantages)
    with pytest.raises(ValueError, match="trajs:"):
        mix.sequence_advantages(r, gid, trajs[:-1] + [SimpleNamespace(metadata={"environment": "c"})])


# ----------------------------------------------------------------------------- config
def _tiny(**over):
    base = {"sft.steps": 0, "train.prompts_per_step": 3, "eval.distinct": "warn"}
    return load_config(preset="tiny", overrides={**base, **over})


TWO = [{"name": "calc", "source": "calculator"}, {"name": "guess"}]


def test_task_and_tasks_together_are_refused_naming_both(tmp_path):
    p = tmp_path / "both.yaml"
    p.write_text("preset: tiny\nsft: {steps: 0}\neval: {distinct: warn}\ntask: {name: guess}\ntasks:\n  - {name: calc, source: calculator}\n")
    with pytest.raises(ValueError, match=r"^task, tasks: both given"):
        load_config(p)
    with pytest.raises(ValueError, match=r"^task, tasks: both given"):
        _tiny(**{"task.n_train": 10, "tasks": TWO})
    with pytest.raises(ValueError, match=r"^task, tasks: both given"):
        build_config({"task": {"name": "guess"}, "tasks": TWO})
    # tasks alone replaces the preset's task section; a dumped config (default task beside tasks) loads
    cfg = _tiny(tasks=TWO)
    assert [e.name for e in cfg.tasks] == ["calc", "guess"]
    assert build_config(json.loads(json.dumps(cfg.model_dump()))).tasks == cfg.tasks


@pytest.mark.parametrize("tasks,extra,match", [
    ([{"name": "a", "source": "calculator"}, {"name": "a", "source": "guess"}], {},
     r"tasks\[1\]\.name: 'a' is also the name of tasks\[0\]"),
    ([{"name": "a", "source": "calculator"}, {"name": "b", "source": "guess", "weight": 0}], {}, r"tasks\[1\]\.weight:"),
    ([{"name": "a", "source": "calculator"}, {"name": "b", "source": "guess", "group_size": 0}], {},
     r"tasks\[1\]\.group_size:"),
    ([{"name": "a", "source": "calculator", "group_size": 1}, {"name": "b", "source": "guess"}], {},
     r"tasks\[0\]\.group_size: advantage 'group_std' needs groups of >= 2"),
    ([{"name": "a", "source": "calculator"}, {"name": "b", "source": "guess", "advantage": {"eps_low": 0.1}}], {},
     r"tasks\[1\]\.advantage\.eps_low: not a field of the advantage estimator"),
    ([{"name": "a", "source": "calculator"}, {"name": "b", "source": "guess", "advantage": {"std_eps": "x"}}], {},
     r"^tasks\[1\]\.advantage\.std_eps: [^;]*$"),
    ([{"name": "a", "source": "calculator"}, {"name": "b", "source": "guess", "advantage": {"advantage": "gae"}}], {},
     r"tasks\[1\]\.advantage\.advantage: 'gae' is not a sequence-level estimator"),
    ([{"name": "a", "source": "calculator", "options": {"max_turnz": 1}}, {"name": "b", "source": "guess"}], {},
     r"tasks\[0\]\.options\.max_turnz: unknown option"),
    ([{"name": "a", "source": "calculatr"}, {"name": "b", "source": "guess"}], {}, r"tasks\[0\]\.source: unknown task"),
    ([{"name": "a b", "source": "calculator"}], {}, r"tasks\[0\]\.name:"),
    ([{"name": "a", "source": "calculator"}, {"name": "b", "source": "guess"}], {"train.prompts_per_step": 1},
     r"train\.prompts_per_step: is 1, fewer than the 2 environments"),
    (TWO, {"recipe.name": "ppo"}, r"recipe\.name: 'ppo' \(a critic\) is not supported"),
    (TWO, {"sft.steps": 2}, r"sft\.steps: .*set sft\.steps: 0"),
])
def test_every_per_environment_key_is_checked_at_load_time(tasks, extra, match):
    with pytest.raises(ValueError, match=match):
        _tiny(tasks=tasks, **extra)


def test_explain_prints_each_environments_objective_where_they_differ(tmp_path):
    p = tmp_path / "mix.yaml"
    p.write_text("preset: tiny\nsft: {steps: 0}\neval: {distinct: warn}\ntrain: {prompts_per_step: 3}\ntasks:\n"
                 "  - {name: calc, source: calculator, weight: 2}\n"
                 "  - {name: guess, group_size: 3, advantage: {advantage: group_center}}\n")
    cfg = load_config(p)
    text = explain_config(cfg)
    from trajgrad.cli import app

    out = CliRunner().invoke(app, ["explain", str(p)])
    assert out.exit_code == 0 and out.output.strip() == text.strip()
    per_env, shared = text.split("shared by every environment", 1)
    assert "calc: weight 2 (66.7% of the prompts)" in per_env and "guess: weight 1 (33.3% of the prompts)" in per_env
    assert "A_i = R_i − mean_G(R),  G = 3" in per_env and "(std_G(R) + 1e-06),  G = 8" in per_env
    assert "advantage:" not in shared and "per-token term (to minimize):" in shared  # one policy term


# ----------------------------------------------------------------------------- a mixed run
class EchoDigit(gym.Env):
    """Text in, text out: reply with the digit shown (one turn)."""

    def __init__(self):
        self.observation_space = gym.spaces.Text(max_length=16, charset="0123456789say ")
        self.action_space = gym.spaces.Text(max_length=8, charset="0123456789 ")
        self._digit = "0"

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._digit = str(self.np_random.integers(10))
        return f"say {self._digit}", {}

    def step(self, action):
        ok = action.strip() == self._digit
        return "", float(ok), True, False, {"success": ok}


def make_echo():
    return EchoDigit()


def _mixed_config(**train):
    return build_config({
        "name": "mixed",
        "model": {"name": "tiny", "dtype": "float32", "lora": None, "tiny": {"hidden_size": 32, "layers": 1, "heads": 2}},
        "tasks": [
            {"name": "calc", "source": "calculator", "weight": 2, "n_train": 32, "n_heldout": 3, "group_size": 2,
             "options": {"few_shot": False, "system_prompt": "", "max_turns": 2, "min_ops": 1, "max_ops": 1,
                         "max_operand": 9}},
            {"name": "echo", "source": f"{ME}:make_echo", "weight": 1, "n_train": 16, "n_heldout": 2, "group_size": 3,
             "advantage": {"advantage": "group_center"}, "options": {"adapter": {"max_turns": 1}}},
        ],
        "sampling": {"temperature": 1.0, "max_new_tokens": 4},
        "recipe": {"name": "grpo"},
        "train": {"steps": 2, "prompts_per_step": 4, "micro_batch_size": 8, "seed": 3, **train},
        "sft": {"steps": 0},
        "eval": {"before": False, "after": True, "every": 0},
        "checkpoint": {"every": 1},
        "log": {"tensorboard": False, "progress": False},
    })


def test_calculator_and_gymnasium_train_together_and_report_per_environment(tmp_path):
    from trajgrad.rollout import read_trajectories
    from trajgrad.train.metrics import read_metrics
    from trajgrad.train.trainer import Trainer
    from trajgrad.view import page_data, read_run

    cfg = _mixed_config()
    run = tmp_path / "run"
    tr = Trainer(cfg, run, console=lambda *_: None)
    summary = tr.run()
    rows = [r for r in read_metrics(run) if r["kind"] == "train"]
    trajs = read_trajectories(run / "trajectories.jsonl")
    G = {"calc": 2, "echo": 3}
    for step, row in enumerate(rows):
        want = split_counts([2, 1], 4, step_seed(3, step, SPLIT_SALT))  # the stratified rule, the run's seed
        assert [row["env/calc/prompts"], row["env/echo/prompts"]] == want
        assert [row["env/calc/episodes"], row["env/echo/episodes"]] == [want[0] * 2, want[1] * 3]
        for name in G:
            assert 0.0 <= row[f"env/{name}/success"] <= 1.0 and f"env/{name}/reward" in row
            assert f"env/{name}/zero_variance_frac" in row
    # every trajectory records its environment; a group (task id) never mixes environments
    groups = {}
    for t in trajs:
        env = t.metadata["environment"]
        assert t.task_id.startswith(env + "/") and t.episode_id.startswith(env + "/")
        groups.setdefault(t.task_id, set()).add(env)
    assert all(len(v) == 1 for v in groups.values())
    sizes = {}
    for t in trajs:
        sizes.setdefault(t.task_id, []).append(t.metadata["environment"])
    assert all(len(v) == G[v[0]] for v in sizes.values())  # each environment's own group size
    # held-out: each environment on its own held-out split, plus overall
    ev = summary["eval_after"]
    assert ev["environments"]["calc"]["n"] == 3 and ev["environments"]["echo"]["n"] == 2 and ev["n"] == 5
    last = [r for r in read_metrics(run) if r["kind"] == "eval_after"][-1]
    assert last["eval/calc/n"] == 3 and last["eval/echo/n"] == 2 and last["eval/n"] == 5
    # the data cursors of both environments are in the checkpoint (a resumed run continues them)
    from trajgrad.train.checkpoint import latest_checkpoint

    extra = json.loads((latest_checkpoint(run) / "extra.json").read_text())
    assert extra["mixture"] == {"calc": sum(r["env/calc/prompts"] for r in rows),
                                "echo": sum(r["env/echo/prompts"] for r in rows)}
    resumed = Trainer(cfg, run, resume=True, console=lambda *_: None)
    assert resumed.step == 2 and resumed.mixture.state_dict() == extra["mixture"]
    # trajgrad view: the page's rows carry the environment; --env keeps one environment's episodes
    data = page_data(read_run(run))
    assert {r["env"] for r in data["rows"]} == {"calc", "echo"}
    echo = page_data(read_run(run, environment="echo"))
    assert echo["rows"] and {r["env"] for r in echo["rows"]} == {"echo"}
    assert len(echo["rows"]) == sum(1 for t in trajs if t.metadata["environment"] == "echo")
    assert "per environment" in data["objective"]
    with pytest.raises(ValueError, match=r"^environment: no trajectory of environment 'nope'.*calc, echo"):
        read_run(run, environment="nope")
    from trajgrad.cli import app

    out = CliRunner().invoke(app, ["view", str(run), "--env", "calc", "--out", str(tmp_path / "calc.html")])
    assert out.exit_code == 0, out.output
    page = (tmp_path / "calc.html").read_text()
    embedded = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S).group(1))
    assert 'id="environment"' in page and {r["env"] for r in embedded["rows"]} == {"calc"}


def test_a_resumed_mixed_run_samples_what_the_uninterrupted_run_did(tmp_path):
    from trajgrad.rollout import read_trajectories
    from trajgrad.train.trainer import Trainer

    def ids(run):
        return [(t.task_id, t.token_ids()) for t in read_trajectories(run / "trajectories.jsonl")]

    quiet = lambda *_: None  # noqa: E731
    cfg = _mixed_config(steps=3)
    cfg.eval.after = False
    Trainer(cfg, tmp_path / "full", console=quiet).run()
    short = _mixed_config(steps=1)
    short.eval.after = False
    Trainer(short, tmp_path / "cut", console=quiet).run()  # checkpointed after step 1
    Trainer(cfg, tmp_path / "cut", resume=True, console=quiet).run()  # both environments' cursors restored
    assert ids(tmp_path / "cut") == ids(tmp_path / "full")
