"""Shared by the tests of the example agents trained through the proxy (examples/openai_agent,
examples/anthropic_agent): a proxy whose policy replies are scripted, and a small training run."""
from __future__ import annotations

import json
from concurrent.futures import Future


def scripted_proxy(tok, agent: str, replies):
    """A :class:`~trajgrad.serve.proxy.ProxySampler` on the tiny model whose calls answer ``replies`` in
    order (each + end of turn, log-prob -0.25 per token)."""
    from trajgrad.model.tiny import build_tiny_model
    from trajgrad.rollout.chat import encode, end_of_turn_id
    from trajgrad.serve.proxy import ProxySampler

    s = ProxySampler(build_tiny_model(tok, seed=0), tok, agent=agent, temperature=1.0, top_k=None, top_p=None,
                     max_new_tokens=64, console=lambda m: None)
    script = list(replies)
    eot = end_of_turn_id(tok)

    def submit(rows, key, seed):
        ids = encode(tok, script.pop(0)) + [eot]
        f = Future()
        f.set_result(([(ids, [-0.25] * len(ids), False) for _ in rows], s.state.policy_version))
        return f

    s.state.submit = submit
    return s


def train_example(config, tmp_path, **over):
    """``trajgrad.train`` of an example's YAML on a smaller tiny model, quietly."""
    import trajgrad

    base = {"log.progress": False, "sampling.max_new_tokens": 16, "model.tiny.hidden_size": 32}
    base.update(over)
    return trajgrad.train(config=config, overrides=base, run_dir=tmp_path / "run", console=lambda m: None)


def check_two_steps(tmp_path, task_prefix: str) -> None:
    """A 2-step run of 8 episodes per step: versions per turn, both updates, exact log-probs."""
    lines = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 16 and all(x["task_id"].startswith(task_prefix) for x in lines)
    assert [{t["policy_version"] for t in x["turns"]} for x in lines] == [{0}] * 8 + [{1}] * 8
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m.get("kind") == "train"]
    assert [m["policy_version"] for m in steps] == [1.0, 2.0]
    assert all(m["mismatch/max_abs_log_ratio"] < 1e-5 for m in steps)
