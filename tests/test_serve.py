"""`trajgrad serve` and the OpenAI-compatible rollout backend: served log-probs are the
behaviour log-probs of the processed distribution (§7), multi-turn episodes are the
served tokens verbatim (§4), weight syncs set the policy version of later turns (§16),
and bad requests are 4xx with a message naming the field."""
from __future__ import annotations

import copy
import json
import socket
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trajgrad.envs.base import StepResult, Task
from trajgrad.model.learner import learner_logprobs
from trajgrad.model.tiny import build_tiny_model
from trajgrad.rollout import collate
from trajgrad.rollout.chat import observation_ids, prompt_ids
from trajgrad.rollout.openai_backend import OpenAISampler
from trajgrad.serve import create_app

SYSTEM = {"role": "system", "content": "You are a test."}
MODEL_NAME = "tiny-served"


class EchoEnv:
    """Multi-turn environment: each step answers one user message quoting the action length."""

    name = "echo"

    def __init__(self, max_turns=3):
        self.max_turns = max_turns
        self.history = []
        self.t = 0

    def reset(self, task):
        self.t = 0
        self.history = [SYSTEM, {"role": "user", "content": task.prompt}]
        return list(self.history)

    def step(self, action_text):
        self.t += 1
        self.history.append({"role": "assistant", "content": action_text})
        msgs = [{"role": "user", "content": f"<result>{len(action_text)}</result>"}]
        self.history.extend(msgs)
        return StepResult(msgs, 0.5 * self.t, False, False, {})


class Recorder:
    def __init__(self, **kw):
        self.kw = kw
        self.envs = []

    def make_env(self):
        env = EchoEnv(**self.kw)
        self.envs.append(env)
        return env


def tasks(n=3):
    return [Task(id=f"t{i}", split="train", prompt="q" * (1 + 5 * i), answer=i) for i in range(n)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def learner(tok):
    return build_tiny_model(tok, seed=0)


class _Server:
    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def served(tok, learner):
    """A real uvicorn server on a free loopback port, serving a copy of the learner."""
    model = copy.deepcopy(learner)
    app = create_app(model, tok, model_name=MODEL_NAME, seed=0)
    with _Server(app) as srv:
        srv.model = model
        srv.app = app
        yield srv


@pytest.fixture()
def client(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c


def _learner_logp(model, batch, temperature, top_k=None, top_p=None):
    with torch.no_grad():
        return learner_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask,
                                temperature=temperature, top_k=top_k, top_p=top_p).logp


# ----------------------------------------------------------------------------- §7 exactness
@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=20)],
    ids=["T1", "T0.7-p0.9", "T1.3-k20"],
)
def test_served_logprobs_equal_learner_recompute(served, tok, learner, sampling):
    """No update between sampling and learning: the learner's recomputation on the collated
    trajectories gives ratio 1 (|ratio - 1| < 1e-5) on every action token."""
    with OpenAISampler(served.url, tok, model_name=MODEL_NAME, max_new_tokens=10, **sampling) as sampler:
        trajs = sampler.rollout(Recorder(max_turns=3), tasks(3), group_size=2, seed=1)
    assert len(trajs) == 6 and all(len(t.turns) == 3 for t in trajs)
    batch = collate(trajs, tok.pad_token_id)
    logp = _learner_logp(learner, batch, **sampling)
    m = batch.action_mask
    ratio = torch.exp(logp - batch.old_logp)[m]
    assert ratio.numel() == sum(t.num_action_tokens for t in trajs) > 100
    assert torch.isfinite(ratio).all()
    assert (ratio - 1).abs().max().item() < 1e-5
    # the check can fail: the learner without the sampler's temperature / truncation
    if sampling != dict(temperature=1.0):
        wrong = _learner_logp(learner, batch, temperature=1.0)
        assert (wrong - batch.old_logp)[m].abs().max().item() > 1e-3
    for t in trajs:
        s = t.sampling
        assert s["server"] == "trajgrad" and s["backend"] == "openai" and s["model"] == MODEL_NAME
        assert s["temperature"] == sampling["temperature"] and s["seed"] == 1
        assert s["top_k"] == sampling.get("top_k") and s["top_p"] == sampling.get("top_p")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    temperature=st.floats(0.3, 2.0),
    top_k=st.one_of(st.none(), st.integers(1, 60)),
    top_p=st.one_of(st.none(), st.floats(0.2, 1.0)),
    prompt=st.lists(st.integers(4, 100), min_size=1, max_size=12),
    seed=st.integers(0, 2**31),
)
def test_property_any_settings_logprobs_are_the_learners(served, learner, temperature, top_k, top_p, prompt, seed):
    """For any temperature / top-k / top-p and prompt, each reported token log-prob equals
    the learner's log-prob of that token under the same processed distribution."""
    r = httpx.post(served.url + "/v1/completions", json={
        "prompt": prompt, "n": 3, "max_tokens": 6, "logprobs": 0, "temperature": temperature, "top_k": top_k,
        "top_p": top_p, "seed": seed}, timeout=60)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        ids = torch.tensor([prompt + c["token_ids"]])
        am = torch.ones_like(ids)
        mask = torch.zeros_like(am[:, 1:])
        mask[:, len(prompt) - 1:] = 1
        with torch.no_grad():
            lp = learner_logprobs(learner, ids, am, mask, temperature=temperature, top_k=top_k, top_p=top_p).logp
        expected = lp[0, len(prompt) - 1:].double()
        got = torch.tensor(c["logprobs"]["token_logprobs"], dtype=torch.float64)
        assert torch.isfinite(expected).all()
        assert (expected - got).abs().max().item() < 1e-5


def test_seeded_rollouts_reproduce(served, tok):
    with OpenAISampler(served.url, tok, model_name=MODEL_NAME, max_new_tokens=6) as s:
        a = s.rollout(Recorder(max_turns=2), tasks(2), group_size=2, seed=7)
        b = s.rollout(Recorder(max_turns=2), tasks(2), group_size=2, seed=7)
        c = s.rollout(Recorder(max_turns=2), tasks(2), group_size=2, seed=8)
    assert [t.token_ids() for t in a] == [t.token_ids() for t in b]
    assert [t.token_ids() for t in a] != [t.token_ids() for t in c]
    # group members of one task are different samples (one seed per request, not per prompt)
    assert a[0].turns[0].action_ids != a[1].turns[0].action_ids or a[0].turns[1].action_ids != a[1].turns[1].action_ids


# ----------------------------------------------------------------------------- §4 assembly
def test_multi_turn_trained_tokens_are_the_served_tokens(served, tok):
    """The trajectory's action positions hold exactly the ids the server returned for that
    context; observations are the env's messages tokenized alone, with action_mask 0."""
    exchanges = []

    def capture(response):
        response.read()
        exchanges.append((json.loads(response.request.content), response.json()))

    src = Recorder(max_turns=3)
    with httpx.Client(timeout=60, event_hooks={"response": [capture]}) as http:
        with OpenAISampler(served.url, tok, model_name=MODEL_NAME, max_new_tokens=12, client=http) as sampler:
            trajs = sampler.rollout(src, tasks(2), group_size=2, seed=3)
    assert len(exchanges) == 3  # one batched request per turn, rows = the episodes in order
    served = []  # served[k][i] = (context sent, ids returned) of episode i at turn k
    for req, resp in exchanges:
        choices = sorted(resp["choices"], key=lambda c: c["index"])
        served.append([(prompt, c["token_ids"]) for prompt, c in zip(req["prompt"], choices)])
    assert all(len(turn_rows) == len(trajs) == 4 for turn_rows in served)
    eos = sampler.eos_id
    for i, (traj, env) in enumerate(zip(trajs, src.envs)):
        ids = traj.token_ids()
        mask = traj.action_mask()
        assert traj.prompt_ids == prompt_ids(tok, env.history[:2])
        users = [m for m in env.history[2:] if m["role"] == "user"]
        pos = len(traj.prompt_ids)
        for k, turn in enumerate(traj.turns):
            context, returned = served[k][i]
            assert context == ids[:pos]
            assert returned == turn.action_ids == ids[pos: pos + len(turn.action_ids)]
            assert mask[pos - 1: pos - 1 + len(turn.action_ids)] == [1] * len(turn.action_ids)
            pos += len(turn.action_ids)
            if k < len(traj.turns) - 1:
                cut = turn.action_ids[-1] != eos
                assert turn.cut == cut
                assert turn.observation_ids == observation_ids(tok, [users[k]], action_closed=not cut)
            assert mask[pos - 1: pos - 1 + len(turn.observation_ids)] == [0] * len(turn.observation_ids)
            assert ids[pos: pos + len(turn.observation_ids)] == turn.observation_ids
            pos += len(turn.observation_ids)
        assert pos == len(ids)


# ----------------------------------------------------------------------------- §16 sync
def _score(client, ids, prefix_len, temperature=1.0):
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0,
                                             "temperature": temperature})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]["token_logprobs"]
    assert lp[0] is None and len(lp) == len(ids)
    return torch.tensor(lp[prefix_len:], dtype=torch.float64), r.json()["policy_version"]


def test_sync_weights_sets_version_and_changes_logprobs(served, tok, learner, client, tmp_path):
    prefix = prompt_ids(tok, [SYSTEM, {"role": "user", "content": "fixed question"}])
    ids = prefix + tok("a fixed continuation<|im_end|>", add_special_tokens=False)["input_ids"]
    ids_t = torch.tensor([ids])
    am = torch.ones_like(ids_t)

    def recompute(model):
        with torch.no_grad():
            out = learner_logprobs(model, ids_t, am, am[:, 1:], temperature=0.8).logp[0]
        return out[prefix_len - 1:].double()

    prefix_len = len(prefix)
    before, v0 = _score(client, ids, prefix_len, temperature=0.8)
    assert torch.allclose(before, recompute(learner), atol=1e-5, rtol=0)

    new = copy.deepcopy(learner)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in new.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    version = v0 + 5
    with OpenAISampler(served.url, tok, model_name=MODEL_NAME, max_new_tokens=8, temperature=0.8) as sampler:
        out = sampler.sync_weights(new, version, tmp_path)
        assert (out / "trainable.safetensors").is_file()
        assert client.get("/health").json()["policy_version"] == version
        assert sampler.policy_version == version
        after, v1 = _score(client, ids, prefix_len, temperature=0.8)
        assert v1 == version
        assert (after - before).abs().max().item() > 1e-2  # the weights changed
        assert torch.allclose(after, recompute(new), atol=1e-5, rtol=0)  # to the learner's new weights
        trajs = sampler.rollout(Recorder(max_turns=2), tasks(2), group_size=2, seed=4)
    assert all(turn.policy_version == version for t in trajs for turn in t.turns)
    batch = collate(trajs, tok.pad_token_id)
    assert (batch.policy_version[batch.action_mask] == version).all()
    m = batch.action_mask
    ratio_new = torch.exp(_learner_logp(new, batch, 0.8) - batch.old_logp)[m]
    ratio_old = torch.exp(_learner_logp(learner, batch, 0.8) - batch.old_logp)[m]
    assert (ratio_new - 1).abs().max().item() < 1e-5
    assert (ratio_old - 1).abs().max().item() > 1e-2
    # restore the served weights for the other tests
    with served.app.state.trajgrad.lock:
        served.model.load_state_dict(learner.state_dict())
        served.app.state.trajgrad.policy_version = 0


def test_turns_record_the_version_that_sampled_them(served, tok, learner, tmp_path):
    """A reload between turns (another process syncing the server) shows up per turn."""
    state = served.app.state.trajgrad
    state_dict = copy.deepcopy(learner.state_dict())

    def bump(t):
        with state.lock:
            state.policy_version = 10 + t

    class BumpEnv(EchoEnv):
        def step(self, action_text):
            res = super().step(action_text)
            bump(self.t)
            return res

    try:
        with OpenAISampler(served.url, tok, model_name=MODEL_NAME, max_new_tokens=5, policy_version=99) as s:
            trajs = s.rollout(lambda: BumpEnv(max_turns=3), tasks(1), group_size=1, seed=0)
        versions = [turn.policy_version for turn in trajs[0].turns]
        assert versions == [0, 11, 12]
    finally:
        with state.lock:
            served.model.load_state_dict(state_dict)
            state.policy_version = 0


def test_reload_formats_and_errors(served, tok, learner, client, tmp_path):
    from safetensors.torch import save_file

    state = served.app.state.trajgrad
    emb = "model.embed_tokens.weight"
    w = learner.state_dict()[emb].clone()
    try:
        # a safetensors file with a subset of the tensors, a HF save_pretrained directory
        save_file({emb: w + 1.0}, str(tmp_path / "subset.safetensors"))
        r = client.post("/reload", json={"path": str(tmp_path / "subset.safetensors"), "version": 2})
        assert r.status_code == 200 and r.json()["policy_version"] == 2 and r.json()["tensors"] == 1
        assert torch.equal(served.model.state_dict()[emb], w + 1.0)
        learner.save_pretrained(tmp_path / "hf")
        r = client.post("/reload", json={"path": str(tmp_path / "hf"), "version": 3})
        assert r.status_code == 200 and r.json()["format"] == "safetensors"
        assert torch.equal(served.model.state_dict()[emb], w)
        # a trajgrad checkpoint (trainable parameters of module "policy")
        from trajgrad.train.checkpoint import save_checkpoint

        bumped = copy.deepcopy(learner)
        with torch.no_grad():
            bumped.model.embed_tokens.weight.add_(0.5)
        step_dir = save_checkpoint(tmp_path / "run", 7, model=bumped)
        for path in (tmp_path / "run", step_dir):
            r = client.post("/reload", json={"path": str(path), "version": 4})
            assert r.status_code == 200 and r.json()["format"] == "trajgrad_checkpoint", r.text
            assert torch.equal(served.model.state_dict()[emb], w + 0.5)
        # errors leave the weights and the version unchanged
        save_file({"no.such.tensor": w}, str(tmp_path / "bad.safetensors"))
        save_file({emb: w[:3]}, str(tmp_path / "shape.safetensors"))
        for body, field in [
            ({"path": str(tmp_path / "missing"), "version": 5}, "path"),
            ({"path": str(tmp_path / "bad.safetensors"), "version": 5}, "path"),
            ({"path": str(tmp_path / "shape.safetensors"), "version": 5}, "path"),
            ({"path": str(tmp_path), "version": 5}, "path"),
            ({"path": str(tmp_path / "hf"), "version": -1}, "version"),
            ({"path": str(tmp_path / "hf"), "version": "5"}, "version"),
            ({"version": 5}, "path"),
        ]:
            r = client.post("/reload", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["message"].startswith(field), r.text
        assert torch.equal(served.model.state_dict()[emb], w + 0.5)
        assert state.policy_version == 4
    finally:
        with state.lock:
            served.model.load_state_dict(learner.state_dict())
            state.policy_version = 0


def test_lora_adapter_sync(tok, learner, tmp_path):
    """A LoRA policy syncs its adapter (save_pretrained -> /reload); the served adapter then
    equals the learner's, and a served model without adapters is wrapped by the first one."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    policy = get_peft_model(copy.deepcopy(learner), cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in policy.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    policy.eval()
    app = create_app(copy.deepcopy(learner), tok, model_name=MODEL_NAME, seed=0)
    with _Server(app) as srv, OpenAISampler(srv.url, tok, model_name=MODEL_NAME, max_new_tokens=6) as s:
        for version in (1, 2):
            s.sync_weights(policy, version, tmp_path)
            trajs = s.rollout(Recorder(max_turns=2), tasks(2), group_size=1, seed=version)
            batch = collate(trajs, tok.pad_token_id)
            ratio = torch.exp(_learner_logp(policy, batch, 1.0) - batch.old_logp)[batch.action_mask]
            assert (ratio - 1).abs().max().item() < 1e-5
            assert all(t.policy_version == version for tr in trajs for t in tr.turns)
            with torch.no_grad():  # change the adapter for the second sync
                for n, p in policy.named_parameters():
                    if "lora_B" in n:
                        p.mul_(-1.5)
        # an adapter with another rank is refused, nothing changes
        r2 = LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        other = get_peft_model(copy.deepcopy(learner), r2)
        other.save_pretrained(tmp_path / "r2")
        r = httpx.post(srv.url + "/reload", json={"path": str(tmp_path / "r2"), "version": 9})
        assert r.status_code == 400 and "r=" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/health").json()["policy_version"] == 2


# ----------------------------------------------------------------------------- requests
def test_completions_response_shape(served, tok, client):
    r = client.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": [[40, 41], [5, 6, 7]], "n": 2, "max_tokens": 4, "logprobs": 2,
        "temperature": 0.9, "top_k": 30, "return_tokens_as_token_ids": True, "seed": 11,
    })
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_index"] for c in body["choices"]] == [0, 0, 1, 1]
    total = 0
    for c in body["choices"]:
        ids = c["token_ids"]
        total += len(ids)
        lp = c["logprobs"]
        assert lp["tokens"] == [f"token_id:{i}" for i in ids]
        assert len(lp["token_logprobs"]) == len(ids) and all(x <= 0 for x in lp["token_logprobs"])
        assert len(lp["top_logprobs"]) == len(ids) and all(1 <= len(d) <= 2 for d in lp["top_logprobs"])
        # the sampled token's log-prob is never above the best alternative's
        for x, d in zip(lp["token_logprobs"], lp["top_logprobs"]):
            assert x <= max(d.values()) + 1e-6
        assert c["text"] == tok.decode(ids, skip_special_tokens=True)
        assert c["finish_reason"] in ("stop", "length") and c["policy_version"] == 0
    assert body["usage"] == {"prompt_tokens": 2 + 3, "completion_tokens": total, "total_tokens": 5 + total}
    again = client.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": [[40, 41], [5, 6, 7]], "n": 2, "max_tokens": 4, "logprobs": 2,
        "temperature": 0.9, "top_k": 30, "return_tokens_as_token_ids": True, "seed": 11,
    }).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in body["choices"]]
    # greedy: probability one, deterministic
    g = [client.post("/v1/completions", json={"prompt": "abc", "temperature": 0, "max_tokens": 5, "logprobs": 0}).json()
         for _ in range(2)]
    assert g[0]["choices"][0]["token_ids"] == g[1]["choices"][0]["token_ids"]
    assert g[0]["choices"][0]["logprobs"]["token_logprobs"] == [0.0] * len(g[0]["choices"][0]["token_ids"])
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL_NAME and models["data"][0]["max_model_len"] == 4096


def test_concurrent_requests_are_answered(served, client):
    from concurrent.futures import ThreadPoolExecutor

    def one(i):
        return httpx.post(served.url + "/v1/completions", json={"prompt": [10 + i, 11, 12], "max_tokens": 3,
                                                                "logprobs": 0}, timeout=60).json()

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, range(8)))
    assert all(len(o["choices"]) == 1 and 1 <= len(o["choices"][0]["token_ids"]) <= 3 for o in outs)


@pytest.mark.parametrize(
    "body, field, status",
    [
        ({"prompt": "x", "temperature": -0.5}, "temperature", 400),
        ({"prompt": "x", "temperature": "hot"}, "temperature", 400),
        ({"prompt": "x", "temperature": True}, "temperature", 400),
        ({"prompt": "x", "temperature": 1e-300}, "temperature", 400),
        ({"prompt": "x", "temperature": 10**400}, "temperature", 400),
        ({"prompt": "x", "top_p": 0}, "top_p", 400),
        ({"prompt": "x", "top_p": 1.5}, "top_p", 400),
        ({"prompt": "x", "top_k": -5}, "top_k", 400),
        ({"prompt": "x", "top_k": 2.5}, "top_k", 400),
        ({"prompt": "x", "n": 0}, "n", 400),
        ({"prompt": "x", "n": 100000}, "n", 400),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", 400),
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", 400),
        ({"prompt": "x", "max_tokens": 5000}, "max_tokens", 400),
        ({"prompt": "x" * 4000, "max_tokens": 200}, "prompt", 400),
        ({"prompt": "x", "logprobs": 21}, "logprobs", 400),
        ({"prompt": {"text": "x"}}, "prompt", 400),
        ({"prompt": []}, "prompt", 400),
        ({"prompt": [1, 2, 9999]}, "prompt", 400),
        ({"prompt": [1, -2]}, "prompt", 400),
        ({"prompt": [[1, 2], []]}, "prompt", 400),
        ({}, "prompt", 400),
        ({"prompt": "x", "foo": 1}, "foo", 400),
        ({"prompt": "x", "stop": ["\n"]}, "stop", 400),
        ({"prompt": "x", "stream": True}, "stream", 400),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", 400),
        ({"prompt": "x", "repetition_penalty": 1.2}, "repetition_penalty", 400),
        ({"prompt": "x", "min_p": 0.1}, "min_p", 400),
        ({"prompt": "x", "logit_bias": {"5": 2.0}}, "logit_bias", 400),
        ({"prompt": "x", "stop_token_ids": [5000]}, "stop_token_ids", 400),
        ({"prompt": "x", "seed": 2**70}, "seed", 400),
        ({"prompt": "x", "model": "gpt-4"}, "model", 404),
    ],
)
def test_bad_requests_are_4xx_naming_the_field(client, body, field, status):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"].startswith(field), err
    assert err["param"] == field and err["code"] == status


def test_malformed_json_is_400(client):
    r = client.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("body")
    # neutral values of the distribution-changing fields are accepted
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "presence_penalty": 0, "min_p": 0.0,
                                             "repetition_penalty": 1, "stop": [], "stream": False, "top_k": -1,
                                             "top_p": 1.0, "user": "u"})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- backend dialects
def _mock(handler):
    return httpx.Client(transport=httpx.MockTransport(handler), timeout=5)


def test_vllm_dialect_requests_and_parsing(tok):
    """The vLLM request pins every sampling field and asks for token ids; the response's
    'token_id:<id>' tokens and log-probs become the action; sync loads versioned adapters."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    seen = []

    def handler(request):
        body = json.loads(request.content) if request.content else None
        seen.append((request.url.path, body))
        if request.url.path == "/v1/completions":
            toks = ["token_id:40", "token_id:41", f"token_id:{eos}"]
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "", "finish_reason": "stop",
                                                          "logprobs": {"tokens": toks,
                                                                       "token_logprobs": [-0.5, -1.0, -0.25]}}]})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "base", "max_model_len": 2048}]})
        return httpx.Response(200, text="Success: LoRA adapter added successfully.")

    with OpenAISampler("http://vllm.test/v1", tok, model_name="base", server="vllm", temperature=0.7, top_p=0.9,
                       max_new_tokens=8, client=_mock(handler)) as s:
        trajs = s.rollout(Recorder(max_turns=2), tasks(2), group_size=2, seed=5)
        assert s.max_context_tokens == 2048
    assert all(t.turns[0].action_ids == [40, 41, eos] and t.turns[0].behaviour_logp == [-0.5, -1.0, -0.25]
               for t in trajs)
    reqs = [b for p, b in seen if p == "/v1/completions"]
    assert len(reqs) == 8  # one request per episode per turn
    r = reqs[0]
    assert r["return_tokens_as_token_ids"] is True and r["logprobs"] == 0 and r["stop_token_ids"] == [eos]
    assert (r["temperature"], r["top_p"], r["top_k"], r["min_p"], r["repetition_penalty"]) == (0.7, 0.9, -1, 0.0, 1.0)
    assert r["prompt"] == trajs[0].prompt_ids and r["model"] == "base"
    assert len({b["seed"] for b in reqs[:4]}) == 4  # distinct seeds: group members differ
    assert trajs[0].sampling["server"] == "vllm"


def test_vllm_sync_full_reload_and_lora_versions(tok, learner, tmp_path):
    """Full weights: /collective_rpc reload_weights from the saved checkpoint; LoRA: versioned adapter
    names, the previous one unloaded; each sync resets the prefix cache (the real engine: test_vllm.py)."""
    from peft import LoraConfig, get_peft_model

    seen = []

    def handler(request):
        seen.append((request.url.path, json.loads(request.content) if request.content else None))
        if request.url.path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        return httpx.Response(200, text="Success")

    with OpenAISampler("http://vllm.test", tok, model_name="base", server="vllm", client=_mock(handler),
                       max_context_tokens=512) as s:
        s.sync_weights(learner, 1, tmp_path)
        assert s.request_model == "base"
        policy = get_peft_model(copy.deepcopy(learner), LoraConfig(r=2, target_modules=["q_proj"]))
        s.sync_weights(policy, 2, tmp_path)
        s.sync_weights(policy, 3, tmp_path)
        assert s.request_model == "trajgrad-policy-v3" and s.policy_version == 3
    v1_dir, v2_dir = (str(tmp_path.resolve() / f"v00000{i}") for i in (1, 2))
    assert seen[0] == ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": v1_dir}})
    assert (tmp_path / "v000001" / "config.json").is_file()
    assert seen[1][0] == "/reset_prefix_cache"
    assert seen[2] == ("/v1/load_lora_adapter", {"lora_name": "trajgrad-policy-v2", "lora_path": v2_dir})
    assert seen[3][0] == "/reset_prefix_cache"
    assert seen[4][0] == "/v1/load_lora_adapter" and seen[4][1]["lora_name"] == "trajgrad-policy-v3"
    assert seen[5] == ("/v1/unload_lora_adapter", {"lora_name": "trajgrad-policy-v2"})
    assert seen[6][0] == "/reset_prefix_cache"
    assert (tmp_path / "v000002" / "adapter_config.json").is_file()


def test_sglang_dialect(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    seen = []

    def handler(request):
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        return httpx.Response(200, json={"text": "ab", "output_ids": [50, eos],
                                         "meta_info": {"output_token_logprobs": [[-0.1, 50, None], [-0.2, eos, None]]}})

    with OpenAISampler("http://sg.test", tok, model_name="m", server="sglang", temperature=0.6, client=_mock(handler),
                       max_new_tokens=5) as s:
        trajs = s.rollout(Recorder(max_turns=1), tasks(1))
    assert trajs[0].turns[0].action_ids == [50, eos] and trajs[0].turns[0].behaviour_logp == [-0.1, -0.2]
    path, body = seen[0]
    assert path == "/generate" and body["return_logprob"] is True and body["input_ids"] == trajs[0].prompt_ids
    sp = body["sampling_params"]
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["max_new_tokens"]) == (0.6, 1.0, -1, 5)
    with pytest.raises(ValueError, match="top_k"):
        OpenAISampler("http://sg.test", tok, model_name="m", server="sglang", top_k=5, client=_mock(handler))
    with pytest.raises(ValueError, match="top_p"):
        OpenAISampler("http://sg.test", tok, model_name="m", server="sglang", top_p=0.9, client=_mock(handler))


@pytest.mark.parametrize(
    "server, payload, match",
    [
        ("vllm", {"choices": [{"logprobs": {"tokens": ["ab", "c"], "token_logprobs": [-1.0, -1.0]}}]},
         "return_tokens_as_token_ids"),
        ("vllm", {"choices": [{"text": "abc", "logprobs": None}]}, "server: .*no logprobs"),
        ("vllm", {"choices": [{"logprobs": {"tokens": ["token_id:5"], "token_logprobs": [None]}}]}, "server"),
        ("vllm", {"choices": [{"logprobs": {"tokens": ["token_id:5"], "token_logprobs": [0.5]}}]}, "positive"),
        ("sglang", {"text": "abc", "meta_info": {}}, "return_logprob"),
        ("trajgrad", {"choices": [{"index": 0, "text": "abc"}]}, "token_ids"),
    ],
)
def test_responses_without_ids_or_logprobs_raise(tok, server, payload, match):
    def handler(request):
        return httpx.Response(200, json=payload)

    with OpenAISampler("http://x.test", tok, model_name="m", server=server, client=_mock(handler),
                       max_context_tokens=512) as s:
        with pytest.raises(ValueError, match=match):
            s.rollout(Recorder(max_turns=1), tasks(1))


def test_server_errors_are_reported(tok):
    def handler(request):
        return httpx.Response(400, json={"error": {"message": "temperature: bad", "code": 400}})

    with OpenAISampler("http://x.test", tok, model_name="m", client=_mock(handler), max_context_tokens=512) as s:
        with pytest.raises(ValueError, match="server: the trajgrad server answered 400.*temperature: bad"):
            s.rollout(Recorder(max_turns=1), tasks(1))
    with OpenAISampler("http://127.0.0.1:9", tok, model_name="m", timeout=2, max_context_tokens=512) as s:
        with pytest.raises(ConnectionError, match="server"):
            s.rollout(Recorder(max_turns=1), tasks(1))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(server="ollama"), "server"),
        (dict(base_url="localhost:8000"), "base_url"),
        (dict(model_name=""), "model_name"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(timeout=0), "timeout"),
        (dict(max_concurrency=0), "max_concurrency"),
        (dict(policy_version=-1), "version"),
    ],
)
def test_backend_bad_settings(tok, kwargs, name):
    args = dict(base_url="http://127.0.0.1:1", model_name="m")
    args.update(kwargs)
    base_url = args.pop("base_url")
    with pytest.raises(ValueError, match=name):
        OpenAISampler(base_url, tok, **args)


def test_sync_weights_bad_input(tok, learner, tmp_path):
    with OpenAISampler("http://127.0.0.1:1", tok, model_name="m") as s:
        with pytest.raises(ValueError, match="version"):
            s.sync_weights(learner, -1, tmp_path)
        with pytest.raises(ValueError, match="model"):
            s.sync_weights("not a model", 1, tmp_path)


def test_create_app_bad_arguments(tok, learner):
    with pytest.raises(ValueError, match="model_name"):
        create_app(learner, tok, model_name="")
    with pytest.raises(ValueError, match="policy_version"):
        create_app(learner, tok, model_name="m", policy_version=-1)
    with pytest.raises(ValueError, match="max_batch_rows"):
        create_app(learner, tok, model_name="m", max_batch_rows=0)



def test_cli_serve_builds_and_runs_the_app(monkeypatch, capsys):
    """`trajgrad serve` builds the model, the app, and hands it to uvicorn on loopback; a
    non-loopback host gets a warning (no authentication)."""
    import uvicorn
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from trajgrad.cli import app as cli_app

    calls = []

    def fake_run(app, host, port, log_level):
        calls.append((host, port))
        with TestClient(app) as c:
            calls.append(c.get("/health").json())
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 0})
            calls.append(r.json()["choices"][0]["policy_version"])

    monkeypatch.setattr(uvicorn, "run", fake_run)
    res = CliRunner().invoke(cli_app, ["serve", "--model", "tiny", "--port", "8123", "--model-name", "cli-tiny",
                                       "--policy-version", "3", "--seed", "0"])
    assert res.exit_code == 0, res.output
    assert calls == [("127.0.0.1", 8123), {"status": "ok", "model": "cli-tiny", "policy_version": 3}, 3]
    res = CliRunner().invoke(cli_app, ["serve", "--model", "nope"])
    assert res.exit_code == 2 and "model" in res.output
    from trajgrad.serve import main

    main(host="0.0.0.0", port=8124, model="tiny")
    assert "no authentication" in capsys.readouterr().err


def test_reload_garbage_adapter_is_a_400_naming_path(tok, learner, tmp_path):
    """A garbage adapter (unreadable weights, a config that is not a LoRA config, a JSON
    list) is refused with 400 naming ``path``, into a plain served model (the first adapter
    would wrap it) and into a LoRA-served one; the model, its version and its modules stay."""
    from fastapi.testclient import TestClient
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    good = tmp_path / "good"
    get_peft_model(copy.deepcopy(learner), cfg).save_pretrained(good)
    cases = {}
    for name, config, weights in [
        ("weights", None, b"\x00garbage\xff" * 7),
        ("config", b"{not json", None),
        ("list", b"[1, 2, 3]", None),
        ("not_lora", json.dumps({"peft_type": "NOPE", "r": "x"}).encode(), None),
        ("empty_weights", None, b""),
    ]:
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_bytes(config if config is not None else (good / "adapter_config.json").read_bytes())
        (d / "adapter_model.safetensors").write_bytes(
            weights if weights is not None else (good / "adapter_model.safetensors").read_bytes())
        cases[name] = d
    plain = copy.deepcopy(learner)
    lora = get_peft_model(copy.deepcopy(learner), cfg)
    for served_model in (plain, lora):
        app = create_app(served_model, tok, model_name=MODEL_NAME, seed=0, policy_version=3)
        state = app.state.trajgrad
        before = {k: v.clone() for k, v in state.model.state_dict().items()}
        n_modules = len(list(state.model.modules()))
        with TestClient(app) as c:
            for name, d in cases.items():
                r = c.post("/reload", json={"path": str(d), "version": 4})
                assert r.status_code == 400, (name, r.status_code, r.text)
                err = r.json()["error"]
                assert err["param"] == "path" and err["message"].startswith("path:"), (name, err)
            assert state.model is served_model and state.policy_version == 3
            assert len(list(state.model.modules())) == n_modules  # nothing was wrapped
            after = state.model.state_dict()
            assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)
            # the good adapter still loads afterwards
            r = c.post("/reload", json={"path": str(good), "version": 5})
            assert r.status_code == 200 and r.json()["policy_version"] == 5, r.text
