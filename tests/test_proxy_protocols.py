"""The recording proxy serves /v1/responses and /v1/messages beside chat completions: agents written
against client.responses.create or the anthropic client are recorded per episode with exact behaviour
log-probs (§7) and the run's sampling enforced (a shell-command agent reading ANTHROPIC_BASE_URL:
tests/test_example_anthropic_agent.py)."""
from __future__ import annotations

import textwrap

import httpx
import pytest
import torch

from trajgrad.envs.base import Task
from trajgrad.model.learner import learner_logprobs
from trajgrad.model.tiny import build_tiny_model
from trajgrad.rollout import collate
from trajgrad.serve.proxy import ProxySampler

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.usefixtures("one_thread")

AGENTS = '''
import anthropic
import openai


def responses_turns(task, base_url):
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    items = [{"role": "user", "content": task.prompt}]
    r = client.responses.create(model="gpt-5", instructions="Be brief.", input=items, store=False)
    items += list(r.output) + [{"role": "user", "content": "again"}]
    r = client.responses.create(model="gpt-5", instructions="Be brief.", input=items, stream=True)
    text = "".join(e.delta for e in r if e.type == "response.output_text.delta")
    return float(len(text) % 2)


def messages_turns(task, anthropic_base_url):
    client = anthropic.Anthropic(base_url=anthropic_base_url, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": task.prompt}]
    r = client.messages.create(model="claude", max_tokens=8, system="Be brief.", messages=msgs)
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
             {"role": "user", "content": "again"}]
    with client.messages.stream(model="claude", max_tokens=8, system="Be brief.", messages=msgs) as stream:
        text = "".join(stream.text_stream)
    return float(len(text) % 2)
'''


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    d = tmp_path_factory.mktemp("protocol_agents")
    (d / "protocol_agents.py").write_text(textwrap.dedent(AGENTS))
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(d))
    import protocol_agents

    yield protocol_agents
    mp.undo()


def _tasks(n):
    return [Task(id=f"t{i}", split="train", prompt="q" * (2 + 3 * i), answer=i) for i in range(n)]


@pytest.mark.parametrize("agent", ["responses_turns", "messages_turns"])
def test_protocol_agents_are_recorded_exactly(agents, tok, agent):
    model = build_tiny_model(tok, seed=0)
    s = ProxySampler(model, tok, agent=f"protocol_agents:{agent}", temperature=0.9, top_k=30, top_p=None,
                     max_new_tokens=8, reward_timeout_s=60.0, concurrency=4, console=lambda m: None)
    try:
        trajs = s.rollout(None, _tasks(2), group_size=2, seed=0)
        assert [t.task_id for t in trajs] == ["t0", "t0", "t1", "t1"] and s.step_stats()["proxy/trained"] == 4.0
        assert all(len(t.turns) == 2 and "diverged" not in t.metadata for t in trajs)
        batch = collate(trajs, tok.pad_token_id)
        with torch.no_grad():
            out = learner_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask, temperature=0.9,
                                   top_k=30)
        m = batch.action_mask.bool()
        assert float(torch.where(m, out.logp.double() - batch.old_logp.double(), 0.0).abs().max()) < 1e-5
        assert int(m.sum()) == sum(t.num_action_tokens for t in trajs)
        # the run's sampling is enforced on both protocols, each answering in its own error shape
        r = httpx.post(f"{s.url}/v1/responses", json={"input": "q", "temperature": 0.3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        r = httpx.post(f"{s.url}/v1/messages", json={"max_tokens": 4, "messages": [{"role": "user", "content": "q"}],
                                                     "top_k": 5})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("top_k")
    finally:
        s.close()

