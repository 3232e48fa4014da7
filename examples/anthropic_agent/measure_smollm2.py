"""The calendar agent on SmolLM2-135M-Instruct (float32) through the proxy's /v1/messages: episodes, and how
far the learner's recomputed log-probs are from the served ones over every action token.

    PYTHONPATH=src:examples/anthropic_agent python examples/anthropic_agent/measure_smollm2.py
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from calendar_tasks import CalendarTasks  # noqa: E402
from trajgrad.model.build import build_model  # noqa: E402
from trajgrad.model.learner import learner_logprobs  # noqa: E402
from trajgrad.rollout import collate  # noqa: E402
from trajgrad.serve.proxy import ProxySampler  # noqa: E402

model, tok = build_model("smollm2", dtype="float32")
s = ProxySampler(model, tok, agent="calendar_tasks:episode", temperature=1.0, top_k=None, top_p=None,
                 max_new_tokens=48, reward_timeout_s=600, concurrency=4)
try:
    t0 = time.perf_counter()
    trajs = s.rollout(None, CalendarTasks().tasks("heldout", 4, 0), group_size=2, seed=0)
    print(f"{len(trajs)} episodes in {time.perf_counter() - t0:.0f} s; counters {s.counters}")
    print("turns", [len(t.turns) for t in trajs], "rewards", [t.total_reward for t in trajs])
    print("first reply:", json.dumps(trajs[0].turns[0].action_text))
    batch = collate(trajs, tok.pad_token_id)
    with torch.no_grad():
        out = learner_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask, temperature=1.0)
    m = batch.action_mask.bool()
    d = torch.where(m, out.logp.double() - batch.old_logp.double(), 0.0).abs()
    print(f"action tokens {int(m.sum())}, max |learner - served| {float(d.max()):.2e}, "
          f"mean {float(d.sum() / m.sum()):.2e}")
finally:
    s.close()
