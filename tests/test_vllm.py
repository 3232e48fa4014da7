"""Rollouts on a real vLLM engine (the CPU build from `make vllm`), one server for the session.

The test model has SmolLM2's real tokenizer and two small random layers (tests/_vllm.py); the
learner is the same checkpoint loaded with transformers in float32. Every action token's
served log-prob must equal the learner's recomputed one (|ratio - 1| < 1e-4), before and after
weight syncs.
"""
import copy
import os
import sys

import httpx
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _vllm import vllm_unavailable  # noqa: E402

from trajgrad.envs import get_task_source  # noqa: E402
from trajgrad.logprobs import token_logprobs  # noqa: E402
from trajgrad.model.build import build_model  # noqa: E402
from trajgrad.rollout.vllm_sampler import VLLMSampler  # noqa: E402

pytestmark = [pytest.mark.xdist_group("vllm"),
              pytest.mark.skipif(bool(vllm_unavailable()), reason=vllm_unavailable() or "-")]


def _learner(model_dir, lora: bool = False):
    lora_cfg = type("L", (), {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": None})() if lora else None
    model, tok = build_model(path=str(model_dir), dtype="float32", lora=lora_cfg)
    return model.eval(), tok


def _recomputed(model, traj, temperature, top_k, top_p):
    """(learner log-probs, behaviour log-probs) on the action targets of one trajectory."""
    ids = torch.tensor([traj.token_ids()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    lp = token_logprobs(logits, ids[0, 1:], temperature=temperature, top_k=top_k, top_p=top_p)
    mask = torch.tensor(traj.action_mask(), dtype=torch.bool)
    old = torch.tensor(traj.behaviour_logp_aligned(), dtype=torch.float32)
    return lp[mask], old[mask]


def _sampler(url, tok, model=None, **kw):
    return VLLMSampler(model, tok, work_dir=".", base_url=url, model_name="policy", max_new_tokens=kw.pop("n", 24), **kw)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, None, 0.9), (1.3, 20, None)])
def test_served_logprobs_are_the_learners(vllm_server, temperature, top_k, top_p):
    url, model_dir, tok = vllm_server
    model, _ = _learner(model_dir)
    source = get_task_source("calculator", max_turns=1)
    tasks = source.tasks("train", 2, 0)
    with _sampler(url, tok, temperature=temperature, top_k=top_k, top_p=top_p, n=12) as s:
        trajs = s.rollout(source, tasks, group_size=2, seed=3)
    n = 0
    for t in trajs:
        lp, old = _recomputed(model, t, temperature, top_k, top_p)
        assert torch.isfinite(old).all()
        assert (lp - old).abs().max() < 1e-4, (temperature, top_k, top_p)
        n += lp.numel()
    assert n >= 4 * 5


def test_same_seed_same_tokens(vllm_server):
    url, _, tok = vllm_server
    source = get_task_source("calculator", max_turns=1)
    tasks = source.tasks("train", 2, 1)
    with _sampler(url, tok, temperature=1.0, n=8) as s:
        a = [t.token_ids() for t in s.rollout(source, tasks, group_size=3, seed=11)]
        b = [t.token_ids() for t in s.rollout(source, tasks, group_size=3, seed=11)]
        c = [t.token_ids() for t in s.rollout(source, tasks, group_size=3, seed=12)]
    assert a == b
    assert a != c


def test_multi_turn_masks_observations_and_records_versions_per_turn(vllm_server, tmp_path):
    url, model_dir, tok = vllm_server
    model, _ = _learner(model_dir, lora=True)
    base = copy.deepcopy(model)
    with torch.no_grad():  # a LoRA update that changes the served distribution
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    source = get_task_source("guess", max_turns=2)
    tasks = source.tasks("train", 3, 0)
    with _sampler(url, tok, temperature=1.0, n=8) as s:
        synced = {}

        def before_turn(turn):  # the weights change between the first and the second turn
            if turn == 1 and not synced:
                synced["dir"] = s.sync_weights(model, 1, tmp_path / "sync")
        trajs = s.rollout(source, tasks, group_size=2, seed=5, before_turn=before_turn)
        assert s.request_model == s.backend.lora_name + "-v1"
    assert synced
    multi = [t for t in trajs if len(t.turns) >= 2]
    assert multi, "the guess task gives several turns"
    for t in multi:
        assert [turn.policy_version for turn in t.turns[:2]] == [0, 1]
        # the action targets are exactly the sampled ids: observation tokens are never trained
        ids, mask = t.token_ids(), t.action_mask()
        assert t.turns[0].observation_ids
        assert [ids[i + 1] for i, m in enumerate(mask) if m] == [x for turn in t.turns for x in turn.action_ids]
        # turn 1 was sampled by the base weights, turn 2 by the synced adapter
        versions = torch.tensor([v for v, m in zip(t.policy_versions_aligned(), mask) if m])
        for version, learner in ((0, base), (1, model)):
            lp, old = _recomputed(learner, t, 1.0, None, None)
            assert (lp - old)[versions == version].abs().max() < 1e-4, version


def _served_prompt_logprobs(url, model_name, prompt, completion_ids):
    """The served log-probs of ``completion_ids`` after ``prompt`` (prompt_logprobs of one request)."""
    body = {"model": model_name, "prompt": prompt + completion_ids, "max_tokens": 1, "temperature": 1.0,
            "prompt_logprobs": 0, "return_tokens_as_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"][len(prompt):]
    out = []
    for tok_id, e in zip(completion_ids, entries):
        out.append(next(v["logprob"] for k, v in e.items() if int(k) == tok_id))
    return torch.tensor(out)


def _learner_logprobs(model, prompt, completion_ids):
    ids = torch.tensor([prompt + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return token_logprobs(logits, ids[0, len(prompt):])


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_sync_serves_the_new_weights(vllm_server, tmp_path, kind):
    url, model_dir, tok = vllm_server
    model, _ = _learner(model_dir, lora=kind == "lora")
    old = copy.deepcopy(model)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    completion = tok.encode("The answer is 42.", add_special_tokens=False)
    with _sampler(url, tok) as s:
        before = _served_prompt_logprobs(url, s.request_model, prompt, completion)
        assert (before - _learner_logprobs(old, prompt, completion)).abs().max() < 1e-4
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * (0.05 if kind == "lora" else 0.02))
        s.sync_weights(model, 7, tmp_path / "sync")
        stats = s.step_stats()
        assert stats["sync/seconds"] > 0
        after = _served_prompt_logprobs(url, s.request_model, prompt, completion)
        new = _learner_logprobs(model, prompt, completion)
        assert (after - new).abs().max() < 1e-4
        assert (new - before).abs().max() > 1e-2  # the sync changed what is served
        if kind == "full":  # the next tests see the original weights again
            s.sync_weights(old, 8, tmp_path / "sync")
            again = _served_prompt_logprobs(url, s.request_model, prompt, completion)
            assert (again - before).abs().max() < 1e-4


def test_grpo_two_steps_through_vllm(vllm_server, tmp_path, monkeypatch):
    """The trainer samples from vLLM, syncs the LoRA adapter after each update, and the learner's
    log-probs of the next step's served tokens match (the server really samples the new weights);
    the held-out evaluation samples from the server too."""
    import trajgrad.train.evaluation as evaluation

    from _vllm import vllm_train_config

    from trajgrad.train.metrics import read_metrics
    from trajgrad.train.trainer import Trainer

    url, model_dir, _ = vllm_server
    cfg = vllm_train_config(model_dir, rollout={"backend": "vllm", "base_url": url, "model_name": "policy"},
                            train={"steps": 2, "prompts_per_step": 2, "group_size": 2, "micro_batch_size": 4,
                                   "old_logp": "recompute"},
                            eval={"before": True, "after": True, "every": 0, "n": 2})

    def no_local_sampler(*a, **k):
        raise AssertionError("the evaluation sampled in process, not from vLLM")
    monkeypatch.setattr(evaluation, "HFSampler", no_local_sampler)
    tr = Trainer(cfg, tmp_path / "run", console=lambda *_: None)
    summary = tr.run()
    assert summary["eval_after"]["n"] == 2
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["mismatch/max_abs_log_ratio"] < 1e-4, r
    assert rows[1]["sync/seconds"] > 0  # the sync after step 1, before step 2's rollouts
    assert tr.sampler.request_model == tr.sampler.backend.lora_name + "-v2"
