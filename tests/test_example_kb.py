"""examples/kb_agent: a user-written multi-tool environment, checked and trained end to end on the tiny model."""
import json
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kb_agent"


@pytest.fixture()
def kb(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import kb_env

    return kb_env


def test_demonstrations_solve_every_task_through_the_environment(kb):
    source = kb.KBSource()
    train, held = source.tasks("train", 200, 0), source.tasks("heldout", 50, 0)
    assert not {t.prompt for t in train} & {t.prompt for t in held}
    assert any(t.metadata["convert"] for t in held) and any(not t.metadata["convert"] for t in held)
    for task in train[:40] + held:
        env = source.make_env()
        msgs = env.reset(task)
        assert '"name": "lookup"' in msgs[0]["content"] and '"name": "convert"' in msgs[0]["content"]
        demo = source.demonstration(task)
        for k, m in enumerate(demo):
            if m["role"] != "assistant":
                continue
            r = env.step(m["content"])
            if k + 1 < len(demo):
                assert r.messages == [demo[k + 1]] and not r.terminated
        assert r.terminated and r.reward == 1.0 and r.info["success"] is True


def test_tool_errors_reach_the_agent(kb):
    source = kb.KBSource()
    task = source.tasks("heldout", 1, 0)[0]
    env = source.make_env()
    env.reset(task)
    r = env.step('<tool_call>{"name": "lookup", "arguments": {"entity": "Atlantis", "attribute": "country"}}</tool_call>')
    assert r.messages[0] == {"role": "tool", "content": "error: KeyError: \"no entity named 'Atlantis'\""}
    r = env.step('<tool_call>{"name": "convert", "arguments": {"value": 1, "from_unit": "m", "to_unit": "yd"}}</tool_call>')
    assert "expected one of" in r.messages[0]["content"]
    r = env.step("I give up")
    assert r.terminated and r.reward == 0.0  # the third turn answers (wrongly)


def test_kb_agent_trains_end_to_end_on_the_tiny_model(kb, tmp_path):
    import trajgrad

    over = {"train.steps": 2, "train.prompts_per_step": 2, "train.group_size": 2, "sft.steps": 3, "sft.batch_size": 4,
            "task.n_heldout": 4, "sampling.max_new_tokens": 24, "log.progress": False}
    s = trajgrad.train(config=EXAMPLE / "kb_tiny.yaml", overrides=over, run_dir=tmp_path / "run", console=lambda m: None)
    assert s["steps"] == 2 and s["eval_before"]["n"] == s["eval_after"]["n"] == 4
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("reward/mean" in l for l in lines) == 2
