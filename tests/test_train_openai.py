"""The trainer with rollouts from an OpenAI-compatible server (`trajgrad serve`) on loopback.

After every update the trainer syncs the weights to the server; the learner's log-probs of
the next step's served tokens then match the served log-probs (mismatch ~ 0), which holds
only if the server really samples with the new weights.
"""
import os
import sys

import httpx
import pytest
import torch

from trajgrad.model.tiny import build_tiny_model
from trajgrad.model.tokenizer import build_char_tokenizer
from trajgrad.serve import create_app
from trajgrad.train.metrics import read_metrics
from trajgrad.train.trainer import Trainer

sys.path.insert(0, os.path.dirname(__file__))
from test_serve import _Server  # noqa: E402
from test_train import micro_config  # noqa: E402


def test_grpo_through_served_rollouts_with_weight_sync(tmp_path):
    tok = build_char_tokenizer()
    served_model = build_tiny_model(tok, hidden_size=32, layers=1, heads=2, seed=0)  # = the learner's init
    app = create_app(served_model, tok, model_name="tiny", seed=0)
    with _Server(app) as srv:
        cfg = micro_config("grpo", train={"steps": 3, "old_logp": "recompute"}, sft={"steps": 0},
                           rollout={"backend": "openai", "base_url": srv.url, "server": "trajgrad", "model_name": "tiny"},
                           optim={"lr": 1e-2})
        tr = Trainer(cfg, tmp_path / "run", console=lambda *_: None)
        tr.run()
        health = httpx.get(f"{srv.url}/health").json()
    rows = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # each step samples from the weights the learner has at that step
        assert r["mismatch/max_abs_log_ratio"] < 1e-4, r
    assert health.get("policy_version") == 3
    # the served copy received the learner's weights
    for (n, p), (_, q) in zip(tr.model.named_parameters(), served_model.named_parameters()):
        assert torch.allclose(p, q, atol=1e-6), n
