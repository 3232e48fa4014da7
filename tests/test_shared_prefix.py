"""HFBackend's two-level shared prefix: a preamble common to every prompt, then each group's
own prompt, each run once; the same actions and behaviour log-probs as recomputing every row."""
from __future__ import annotations

import pytest
import torch

import trajgrad.rollout.generation as generation_mod
from trajgrad.envs.base import StepResult, Task
from trajgrad.model.tiny import build_tiny_model
from trajgrad.rollout import HFSampler

pytestmark = pytest.mark.usefixtures("one_thread")

PREAMBLE = "Solve the arithmetic question and answer in tags. " * 2


class PreambleEnv:
    """Every prompt starts with the same long preamble, then its own question."""

    def __init__(self, turns=2):
        self.turns, self.t = turns, 0

    def reset(self, task):
        self.t = 0
        return [{"role": "user", "content": PREAMBLE + task.prompt}]

    def step(self, action_text):
        self.t += 1
        if self.t >= self.turns:
            return StepResult([], 1.0, True, False, {"success": True})
        return StepResult([{"role": "user", "content": f"<result>{len(action_text)}</result>"}], 0.0, False, False, {})


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, hidden_size=64, layers=2, heads=4, seed=0)


def _tasks():
    # questions of different lengths: the groups' prompts end at different positions
    return [Task(id=f"q{i}", split="train", prompt=f"what is {i} plus {'1' * (3 * i + 1)} ?", answer=0)
            for i in range(3)]


def _embedded(model):
    seen = [0]
    handle = model.get_input_embeddings().register_forward_hook(
        lambda mod, inp, out: seen.__setitem__(0, seen[0] + inp[0].numel()))
    return seen, handle


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0)], ids=["greedy", "T1"])
def test_two_level_prefix_equals_full_recompute(tok, model, monkeypatch, sampling):
    extracted = []
    real = generation_mod.extract_rows
    monkeypatch.setattr(generation_mod, "extract_rows", lambda *a: extracted.append(len(a[1])) or real(*a))
    out, counts = {}, {}
    for reuse in (True, False):
        extracted.clear()
        seen, handle = _embedded(model)
        try:
            s = HFSampler(model, tok, max_new_tokens=8, reuse_kv=reuse, **sampling)
            out[reuse] = s.rollout(lambda: PreambleEnv(), _tasks(), group_size=4, seed=3)
        finally:
            handle.remove()
        counts[reuse] = seen[0]
        if reuse:
            first_read = extracted[0]
    # the shared rows read back: one per distinct prompt (3), not one per preamble (1)
    assert first_read == 3
    a, b = out[True], out[False]
    assert [[u.action_ids for u in t.turns] for t in a] == [[u.action_ids for u in t.turns] for t in b]
    for ta, tb in zip(a, b):
        for ua, ub in zip(ta.turns, tb.turns):
            assert max((abs(x - y) for x, y in zip(ua.behaviour_logp, ub.behaviour_logp)), default=0.0) < 1e-5
    assert counts[True] < 0.5 * counts[False], counts


def test_two_level_prefix_runs_the_preamble_once_and_each_prompt_once(tok, model):
    """Tokens embedded by the shared-prefix pass: the preamble once, each group's remaining
    prompt once (not once per member)."""
    backend = generation_mod.HFBackend(model, tok, temperature=0.0, max_new_tokens=4)
    from trajgrad.rollout.chat import prompt_ids

    prompts = [prompt_ids(tok, PreambleEnv().reset(t)) for t in _tasks()]
    seqs = [p for p in prompts for _ in range(4)]
    seen, handle = _embedded(model)
    try:
        past = backend._shared_prefix(seqs, [None] * len(seqs))
    finally:
        handle.remove()
    lengths = sorted({p.length for p in past})
    # every row keeps at least one token to run, and rows of one prompt share one RowKV
    assert all(p.length < len(s) for p, s in zip(past, seqs))
    for g in range(3):
        assert all(past[4 * g + j] is past[4 * g] for j in range(4))
    common = min(lengths)
    assert common > len(PREAMBLE) // 2
    # preamble once + each prompt's continuation once, far below one row per member
    assert seen[0] < sum(len(p) for p in prompts)
    # the keys and values equal a plain forward pass of the row's prefix
    row = seqs[4]
    n = past[4].length
    ids = torch.tensor([row[:n]])
    ref = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    from trajgrad.model.kv import cache_layers, output_cache

    for (k, v), kk, vv in zip(cache_layers(output_cache(ref)), past[4].keys, past[4].values):
        assert torch.allclose(k[0], kk, atol=1e-5) and torch.allclose(v[0], vv, atol=1e-5)
