"""rollout.backend: proxy: the trainer serves its live policy and trains an external agent that speaks
the OpenAI chat API. Groups and single rollouts, exact behaviour log-probs (§7), per-turn versions
(§16), timeouts counted and never trained, agent failures counted, config errors naming keys."""
from __future__ import annotations

import json
import textwrap
import time

import httpx
import pytest
import torch

from trajgrad.envs.base import Task
from trajgrad.model.learner import learner_logprobs
from trajgrad.model.tiny import build_tiny_model
from trajgrad.rollout import collate
from trajgrad.train.config import load_config
from trajgrad.serve.proxy import ProxySampler

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("one_thread")

AGENTS = '''
import time
import httpx
import openai

LATE = {}


def two_turns(task, base_url, session):
    """Two chat calls; the reward is the length parity of the last reply (varies within a group)."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": task.prompt}]
    r = client.chat.completions.create(model="gpt-4o", messages=msgs)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    r = client.chat.completions.create(model="gpt-4o", messages=msgs)
    return {"reward": float(len(r.choices[0].message.content or "") % 2), "success": True}


def silent(task, base_url):
    openai.OpenAI(base_url=base_url, api_key="x", max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": task.prompt}])
    return None  # never reports a reward


def sleepy(task, base_url, session):
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    try:  # on a slow machine the episode may expire during the first call already: that is refused too
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": task.prompt}])
        time.sleep(1.5)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "late"}])
        LATE[session] = 200
    except openai.APIStatusError as exc:
        LATE[session] = exc.status_code
    return 1.0


def broken(task):
    raise RuntimeError("the agent fell over")


def hot(base_url):
    openai.OpenAI(base_url=base_url, api_key="x", max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "q"}], temperature=0.3)
    return 1.0
'''


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    d = tmp_path_factory.mktemp("agents")
    (d / "proxy_agents.py").write_text(textwrap.dedent(AGENTS))
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(d))
    import proxy_agents

    yield proxy_agents
    mp.undo()


def _tasks(n, split="train"):
    return [Task(id=f"t{i}", split=split, prompt="q" * (2 + 3 * i), answer=i) for i in range(n)]


def _sampler(tok, model, agent, **kw):
    args = dict(temperature=1.0, top_k=None, top_p=None, max_new_tokens=8, reward_timeout_s=30.0, concurrency=4,
                console=lambda m: None)
    args.update(kw)
    return ProxySampler(model, tok, agent=agent, **args)


def test_groups_versions_and_exact_logprobs(agents, tok):
    model = build_tiny_model(tok, seed=0)
    s = _sampler(tok, model, "proxy_agents:two_turns", temperature=0.9, top_k=30)
    try:
        trajs = s.rollout(None, _tasks(2), group_size=3, seed=0)
        assert [t.task_id for t in trajs] == ["t0"] * 3 + ["t1"] * 3
        assert [t.metadata["group_index"] for t in trajs] == [0, 1, 2] * 2
        assert all(len(t.turns) == 2 and t.success is True and t.split == "train" for t in trajs)
        assert all(tu.policy_version == 0 for t in trajs for tu in t.turns)
        assert s.step_stats()["proxy/trained"] == 6.0 and s.step_stats()["proxy/timeouts"] == 0.0
        batch = collate(trajs, tok.pad_token_id)
        with torch.no_grad():
            out = learner_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask, temperature=0.9,
                                   top_k=30)
        m = batch.action_mask.bool()
        diff = torch.where(m, out.logp.double() - batch.old_logp.double(), torch.zeros((), dtype=torch.double))
        assert float(diff.abs().max()) < 1e-5 and int(m.sum()) == sum(t.num_action_tokens for t in trajs)
        # a new version (the trainer's update): the server reports it and later turns record it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        s.set_policy_version(3)
        assert httpx.get(f"{s.url}/health").json()["policy_version"] == 3
        again = s.rollout(None, _tasks(1), group_size=1, seed=1)
        assert [tu.policy_version for tu in again[0].turns] == [3, 3]
        batch = collate(again, tok.pad_token_id)
        with torch.no_grad():  # sampled with the updated (shared) weights
            out = learner_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask, temperature=0.9,
                                   top_k=30)
        m = batch.action_mask.bool()
        assert float(torch.where(m, out.logp.double() - batch.old_logp.double(), 0.0).abs().max()) < 1e-5
    finally:
        s.close()


def test_trainer_sampling_is_enforced(agents, tok):
    s = _sampler(tok, build_tiny_model(tok, seed=0), "proxy_agents:hot")
    try:
        assert s.rollout(None, _tasks(1)) == []
        assert s.counters["agent_errors"] == 1
        r = httpx.post(f"{s.url}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "q"}], "temperature": 0.3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        r = httpx.post(f"{s.url}/s/unknown/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]})
        assert r.status_code == 404 and r.json()["error"]["param"] == "session"  # only the trainer opens episodes
    finally:
        s.close()


def test_missing_reward_times_out_counted_not_trained(agents, tok):
    s = _sampler(tok, build_tiny_model(tok, seed=0), "proxy_agents:sleepy", reward_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        assert s.rollout(None, _tasks(2)) == []
        assert time.monotonic() - t0 < 5
        assert s.counters["timeouts"] == 2 and s.counters["trained"] == 0
        deadline = time.monotonic() + 10
        while len(agents.LATE) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(agents.LATE.values()) == [410, 410]  # an expired episode is never extended
        s.agent, s._fn = "proxy_agents:silent", agents.silent  # returns without a reward
        s.reward_timeout_s = 0.3
        assert s.rollout(None, _tasks(1)) == [] and s.step_stats()["proxy/timeouts"] == 1.0
        s._fn = agents.broken
        assert s.rollout(None, _tasks(1)) == [] and s.counters["agent_errors"] == 1
    finally:
        s.close()


def test_shell_command_agent(tok, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent('''
        import json, os
        import openai
        from trajgrad.serve.client import report_reward
        task = json.loads(os.environ["TRAJGRAD_TASK"])
        assert os.environ["OPENAI_BASE_URL"].endswith("/s/" + os.environ["TRAJGRAD_SESSION"] + "/v1")
        r = openai.OpenAI(max_retries=0).chat.completions.create(
            model=os.environ["TRAJGRAD_MODEL"], messages=[{"role": "user", "content": task["prompt"]}])
        report_reward(1.0 if task["id"] == "t1" else 0.0, success=task["id"] == "t1")
    '''))
    s = _sampler(tok, build_tiny_model(tok, seed=0), f"python {script}")
    try:
        trajs = s.rollout(None, _tasks(2))
        assert [t.task_id for t in trajs] == ["t0", "t1"] and [t.total_reward for t in trajs] == [0.0, 1.0]
        assert [t.success for t in trajs] == [False, True]
    finally:
        s.close()


def test_trainer_trains_through_the_proxy(agents, tmp_path):
    """Two GRPO steps: the agent's episodes are the trained trajectories, the served policy version
    follows the trainer's, and the learner recomputes the served log-probs exactly."""
    from trajgrad.train.trainer import Trainer

    cfg = load_config(preset="tiny", overrides={
        "rollout.backend": "proxy", "rollout.proxy.agent": "proxy_agents:two_turns", "rollout.proxy.concurrency": 4,
        "train.steps": 2, "train.prompts_per_step": 2, "train.group_size": 3, "sft.steps": 0,
        "eval.before": False, "eval.after": True, "eval.every": 0, "checkpoint.every": 0, "task.n_heldout": 4,
        "sampling.max_new_tokens": 8, "log.progress": False, "log.tensorboard": False, "log.token_log": False,
        "model.tiny.hidden_size": 32})
    tr = Trainer(cfg, tmp_path / "run", console=lambda m: None)
    try:
        assert tr.sampler.model is tr.model  # the served weights are the trainer's
        summary = tr.run()
        assert summary["eval_after"]["n"] == 4  # held-out evaluation runs the same agent
        assert tr.policy_version == 2 and tr.sampler.policy_version == 2
        assert httpx.get(f"{tr.sampler.url}/v1/models").json()["data"][0]["policy_version"] == 2
        lines = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
        assert len(lines) == 12 and {x["metadata"]["env"] for x in lines} == {"proxy"}
        versions = [{t["policy_version"] for t in x["turns"]} for x in lines]
        assert versions == [{0}] * 6 + [{1}] * 6
        metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if m.get("kind") == "train"]
        assert len(steps) == 2 and all(m["mismatch/max_abs_log_ratio"] < 1e-5 for m in steps)
        assert all(m["proxy/trained"] == 6 for m in steps)  # the proxy's counts reach the metrics
        assert tr.sampler.counters["trained"] == 12
        assert [m["eval/n"] for m in metrics if m.get("kind") == "eval_after"] == [4]
    finally:
        tr.sampler.close()


def test_sao_runs_single_rollouts(agents, tmp_path):
    from trajgrad.train.trainer import Trainer

    cfg = load_config(preset="tiny", overrides={
        "recipe.name": "sao", "train.group_size": None, "rollout.backend": "proxy", "rollout.proxy.agent": "proxy_agents:two_turns",
        "train.steps": 1, "train.prompts_per_step": 3, "sft.steps": 0, "eval.before": False, "eval.after": False,
        "eval.every": 0, "checkpoint.every": 0, "sampling.max_new_tokens": 6, "log.progress": False,
        "log.tensorboard": False, "log.token_log": False, "model.tiny.hidden_size": 32})
    tr = Trainer(cfg, tmp_path / "run", console=lambda m: None)
    try:
        tr.run()
        lines = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
        assert len(lines) == 3 and len({x["task_id"] for x in lines}) == 3  # one rollout per prompt
    finally:
        tr.sampler.close()


@pytest.mark.parametrize("overrides,key", [
    ({"rollout.backend": "proxy"}, "rollout.proxy.agent"),
    ({"rollout.backend": "proxy", "rollout.proxy.agent": "no_such_module_xyz:fn"}, "rollout.proxy.agent"),
    ({"rollout.backend": "proxy", "rollout.proxy.agent": "json:no_such_fn"}, "rollout.proxy.agent"),
    ({"rollout.backend": "proxy", "rollout.proxy.agent": "python a.py", "rollout.proxy.reward_timeout_s": 0},
     "rollout.proxy.reward_timeout_s"),
    ({"rollout.backend": "proxy", "rollout.proxy.agent": "python a.py", "rollout.proxy.concurrency": 0},
     "rollout.proxy.concurrency"),
    ({"rollout.backend": "hf", "rollout.proxy.concurrency": 3}, "rollout.proxy.concurrency"),
    ({"rollout.backend": "proxy", "rollout.proxy.agent": "python a.py", "asynchronous.enabled": True},
     "asynchronous.enabled"),
])
def test_config_errors_name_the_key(overrides, key):
    base = {"eval.before": False, "eval.after": False, "eval.every": 0}
    with pytest.raises(ValueError, match=rf"(^|; ){key.replace('.', '[.]')}:"):
        load_config(preset="tiny", overrides={**base, **overrides})


def test_proxy_sampler_bad_arguments(tok):
    model = build_tiny_model(tok, seed=0)
    with pytest.raises(ValueError, match="rollout.proxy.agent"):
        _sampler(tok, model, "  ")
    with pytest.raises(ValueError, match="rollout.proxy.reward_timeout_s"):
        _sampler(tok, model, "true", reward_timeout_s=float("nan"))
    with pytest.raises(ValueError, match="rollout.proxy.concurrency"):
        _sampler(tok, model, "true", concurrency=0)
    s = _sampler(tok, model, "true")
    with pytest.raises(ValueError, match="group_size"):
        s.rollout(None, _tasks(1), group_size=0)
    with pytest.raises(ValueError, match="version"):
        s.set_policy_version(-1)
