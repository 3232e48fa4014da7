"""The recording proxy with its calls sampled by the session's vLLM server (rollout.proxy.engine: vllm).

An agent that speaks the OpenAI chat API (the real ``openai`` client, two calls per episode)
trains through the proxy; the proxy renders and records every call token for token, vLLM
draws the replies. The recorded log-probs must equal the learner's recomputation
(|log ratio| < 1e-4, float32), every turn records the version the server held, the server's
own request counter shows it sampled every turn, and the adapter synced after each update is
the one later calls name.
"""
import json
import os
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _vllm import (max_abs_log_ratio, served_requests, spy_batches, vllm_train_config,  # noqa: E402
                   vllm_unavailable)

from trajgrad.train.metrics import read_metrics  # noqa: E402

pytestmark = [pytest.mark.xdist_group("vllm"),
              pytest.mark.skipif(bool(vllm_unavailable()), reason=vllm_unavailable() or "-")]

AGENT = '''
import openai


def two_calls(task, base_url):
    """A system prompt, the task, the reply, a follow-up; the reward is the parity of the reply's token count
    as the client reads it from the returned log-probs."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    history = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": task.prompt}]
    first = client.chat.completions.create(model="any", messages=history, logprobs=True).choices[0]
    history.append(first.message.model_dump(exclude_none=True))
    history.append({"role": "user", "content": "Are you sure?"})
    second = client.chat.completions.create(model="any", messages=history, logprobs=True).choices[0]
    return {"reward": float(len(second.logprobs.content) % 2), "success": True}
'''


@pytest.fixture()
def agent(tmp_path, monkeypatch):
    pytest.importorskip("openai")
    (tmp_path / "vllm_proxy_agent.py").write_text(textwrap.dedent(AGENT))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "vllm_proxy_agent:two_calls"


def test_proxy_records_vllm_samples_exactly(vllm_server, agent, tmp_path):
    from trajgrad.train.trainer import Trainer

    url, model_dir, _ = vllm_server
    cfg = vllm_train_config(model_dir, rollout={"backend": "proxy", "base_url": url, "model_name": "policy",
                                                "proxy": {"agent": agent, "engine": "vllm", "concurrency": 4}},
                            recipe={"name": "grpo", "overrides": {"entropy_coef": 0.05}})  # every update moves
    tr = Trainer(cfg, tmp_path / "run", console=lambda *_: None)
    batches = spy_batches(tr)
    engine = tr.sampler.engine
    assert engine is not None and engine.url == url
    before = served_requests(url)
    try:
        tr.run()
    finally:
        tr.sampler.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and {x["metadata"]["env"] for x in lines} == {"proxy"}
    assert all(len(x["turns"]) == 2 for x in lines)
    assert [{t["policy_version"] for t in x["turns"]} for x in lines] == [{0}] * 4 + [{1}] * 4
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # vLLM's recorded log-probs == the learner's recomputation
        assert r["mismatch/max_abs_log_ratio"] < 1e-4, r
        assert r["proxy/trained"] == 4
        assert r["grad_norm"] > 0
    # the second step's calls were sampled by version 1, not by version 0's weights
    (_, _, w0), (_, second, w1) = batches
    assert max_abs_log_ratio(cfg, w1, second) < 1e-4
    assert max_abs_log_ratio(cfg, w0, second) > 1e-3
    assert rows[1]["sync/seconds"] > 0  # the sync after step 1, before step 2's calls
    assert served_requests(url) - before >= 16  # every call was sampled by vLLM
    backend = engine.sampler.backend
    assert backend.request_model == backend.lora_name + "-v2"  # synced after each update
