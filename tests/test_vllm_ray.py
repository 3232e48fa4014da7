"""SAO and grouped GRPO on Ray with rollouts from the session's vLLM server (trajgrad.train.ray_vllm).

Two Ray workers share the one server: they hold no model, they name the learner's newest adapter
in their requests, and every turn records the version of that adapter. The server's own request
counter shows the turns were sampled there; with ``max_lag 0`` every trained token was sampled by
the weights the learner holds when it updates, so the learner's recomputed log-probs must equal
the served ones (|log ratio| < 1e-4, float32).
"""
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _vllm import (max_abs_log_ratio, served_requests, spy_batches, vllm_train_config,  # noqa: E402
                   vllm_unavailable)

from trajgrad.train.metrics import read_metrics  # noqa: E402

pytestmark = [pytest.mark.xdist_group("vllm"),
              pytest.mark.skipif(bool(vllm_unavailable()), reason=vllm_unavailable() or "-")]

_GUESS = {"name": "guess", "n_train": 16, "n_heldout": 2, "options": {"upper": 8, "max_turns": 2, "few_shot": False}}


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _run_two_steps(trainer_cls, url, run_dir, cfg, mode):
    """Two updates of ``trainer_cls`` on ``cfg``; checks what the docstring of this module says."""
    lt = trainer_cls(cfg, run_dir, console=lambda *_: None)
    tr = lt.trainer
    batches = spy_batches(tr)
    before = served_requests(url)
    summary = lt.run(stall_timeout=240)
    assert summary["steps"] == 2 and summary["mode"] == mode
    rows = [r for r in read_metrics(tr.run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # served behaviour log-probs == the learner's recomputation; the update moved the weights
        assert r["mismatch/max_abs_log_ratio"] < 1e-4, r
        assert r["grad_norm"] > 0, r
    assert [v for v, _, _ in batches] == [0, 1]
    turns = 0
    for v, trajs, _ in batches:
        for t in trajs:
            assert [turn.policy_version for turn in t.turns] == [v] * len(t.turns)
            turns += len(t.turns)
    # the second batch was sampled by version 1, not by version 0's weights
    (_, _, w0), (_, second, w1) = batches
    assert max_abs_log_ratio(tr.cfg, w1, second) < 1e-4
    assert max_abs_log_ratio(tr.cfg, w0, second) > 1e-3
    # every trained turn was one request to the server (the workers sample nothing themselves)
    assert served_requests(url) - before >= turns
    # the learner synced after each update; the workers' requests named the adapter of version 1
    assert tr.sampler.request_model == tr.sampler.backend.lora_name + "-v2"
    assert tr.sampler.backend.loaded_adapters == [tr.sampler.backend.lora_name + "-v1", tr.sampler.request_model]


def _config(url, model_dir, **sections):
    # the random test model earns no reward: an entropy bonus makes every update move the weights
    return vllm_train_config(model_dir, rollout={"backend": "vllm", "base_url": url, "model_name": "policy"},
                             task=_GUESS, **sections)


def test_sao_two_updates_through_vllm(vllm_server, ray_session, tmp_path):
    from trajgrad.train.asynchronous import AsyncTrainer

    url, model_dir, _ = vllm_server
    cfg = _config(url, model_dir, recipe={"name": "sao", "overrides": {"entropy_coef": 0.05}},
                  critic={"warmup_steps": 0},
                  train={"steps": 2, "prompts_per_step": 1, "group_size": 1, "micro_batch_size": 4},
                  asynchronous={"enabled": True, "workers": 2, "max_lag": 0, "batch_trajectories": 2, "queue_size": 2,
                                "partial": "per_segment"})
    _run_two_steps(AsyncTrainer, url, tmp_path / "run", cfg, "async")


def test_grouped_grpo_two_steps_through_vllm(vllm_server, ray_session, tmp_path):
    from trajgrad.train.asynchronous import GroupedRayTrainer

    url, model_dir, _ = vllm_server
    cfg = _config(url, model_dir, recipe={"name": "grpo", "overrides": {"entropy_coef": 0.05}},
                  train={"steps": 2, "prompts_per_step": 1, "group_size": 2, "micro_batch_size": 4},
                  asynchronous={"enabled": False, "workers": 2})
    _run_two_steps(GroupedRayTrainer, url, tmp_path / "run", cfg, "grouped")


def test_sao_full_weights_on_vllm_is_refused_at_load_time(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model\.lora: SAO .*rollout\.backend 'vllm' needs a LoRA policy"):
        vllm_train_config(tmp_path, model={"lora": None}, recipe={"name": "sao"},
                          rollout={"backend": "vllm", "base_url": "http://127.0.0.1:1"},
                          asynchronous={"enabled": True, "workers": 2})


def _lora_learner(model_dir):
    from trajgrad.model.build import build_model

    lora = type("L", (), {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": None})()
    model, _ = build_model(path=str(model_dir), dtype="float32", lora=lora)
    return model.eval()


def _perturb_lora(model):
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)


def _complete(url, model_name, prompt, max_tokens, seed):
    """One served completion of ``prompt`` (token ids): (sampled ids, their log-probs)."""
    import httpx

    body = {"model": model_name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 1.0, "logprobs": 0, "return_tokens_as_token_ids": True, "seed": seed}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return [int(t.split(":")[1]) for t in lp["tokens"]], lp["token_logprobs"]


def _max_diff(model, prompt, ids, served) -> float:
    """max |learner log-prob - served log-prob| of ``ids`` after ``prompt`` (T=1)."""
    import torch

    from trajgrad.logprobs import token_logprobs

    seq = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].float()
    return float((token_logprobs(logits, seq[0, len(prompt):]) - torch.tensor(served)).abs().max())


def test_lora_sync_while_a_request_runs(vllm_server, tmp_path):
    """What SAO's workers rely on: a LoRA sync while a request runs under the previous adapter
    leaves that request on the previous adapter (its log-probs are the old weights', to 1e-4), the
    previous adapter stays loaded (``keep_adapters``), the prefix-cache reset vLLM refuses while
    the request holds cache blocks is counted, not an error, and the new adapter reuses none of
    the old one's cache blocks."""
    import threading
    import time

    import httpx
    import torch

    from trajgrad.rollout.vllm_sampler import VLLMSampler

    url, model_dir, tok = vllm_server
    model = _lora_learner(model_dir)
    with VLLMSampler(None, tok, work_dir=tmp_path, base_url=url, model_name="policy") as s:
        s.backend.keep_adapters = 1
        s.sync_weights(model, 1, tmp_path / "sync")  # lora_B = 0: the base weights
        first = s.request_model
        prompt = tok.encode("Count slowly:", add_special_tokens=False)
        box = {}
        th = threading.Thread(target=lambda: box.update(r=_complete(url, first, prompt, 300, 1)))
        th.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the request holds cache blocks now
            m = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", httpx.get(url + "/metrics").text, re.M)
            if m and float(m.group(1)) >= 1:
                break
            time.sleep(0.05)
        base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
        _perturb_lora(model)
        s.sync_weights(model, 2, tmp_path / "sync")
        refused = s.backend.prefix_cache_kept
        th.join(timeout=300)
        second = s.request_model
        assert s.backend.loaded_adapters == [first, second]
        assert s.step_stats()["sync/prefix_cache_kept"] == refused
        assert s.step_stats()["sync/prefix_cache_kept"] == 0  # counted once
    assert refused == 1, "the request finished before the sync: it was not running"
    ids, served = box["r"]
    assert len(ids) == 300
    # the v1 request's cache blocks (the reset was refused) are not reused under v2: a v2 request
    # that repeats 256 of its tokens gets the v2 weights' log-probs
    head = prompt + ids[:256]
    assert _max_diff(model, head, *_complete(url, second, head, 8, 2)) < 1e-4
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in base:
                p.copy_(base[n])
    assert _max_diff(model, prompt, ids, served) < 1e-4


def test_a_version_set_without_its_weights_is_synced(vllm_server, tmp_path):
    """A resumed learner sets its checkpoint's version on the sampler without a sync: the sampler
    syncs the policy it was built with, so the server samples the weights that version names."""
    from trajgrad.rollout.vllm_sampler import VLLMSampler

    url, model_dir, tok = vllm_server
    model = _lora_learner(model_dir)
    _perturb_lora(model)  # the weights a checkpoint of version 5 would load
    with VLLMSampler(model, tok, work_dir=tmp_path, base_url=url, model_name="policy") as s:
        s.set_policy_version(5)
        assert s.policy_version == 5 and s.request_model == s.backend.lora_name + "-v5"
        assert s.step_stats()["sync/seconds"] > 0
        s.set_policy_version(5)  # the version the server holds: nothing to sync
        assert "sync/seconds" not in s.step_stats()
        prompt = tok.encode("Hello there", add_special_tokens=False)
        assert _max_diff(model, prompt, *_complete(url, s.request_model, prompt, 16, 3)) < 1e-4
