"""examples/openai_agent: an agent written only against the openai client, trained unchanged through
the proxy on the tiny model (as a Python callable and as a shell command)."""
import json
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openai_agent"
pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def shop(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import shop_tasks

    return shop_tasks


def test_agent_uses_only_the_openai_client():
    src = (EXAMPLE / "agent.py").read_text()
    imports = {line.split()[1].split(".")[0] for line in src.splitlines() if line.startswith(("import ", "from "))}
    assert imports == {"__future__", "json", "os", "sys", "openai"}


def test_tasks_and_score(shop):
    src = shop.ShopTasks()
    train, held = src.tasks("train", 30, 0), src.tasks("heldout", 10, 0)
    assert not {t.prompt for t in train} & {t.prompt for t in held} and len({t.prompt for t in held}) == 10
    task = next(t for t in held)
    assert shop.score(f"It costs {task.answer}.", task) == 1.0 and shop.score("no idea", task) == 0.0
    assert shop.score(str(task.answer + 1), task) == 0.0


def test_the_unchanged_agent_loop_is_recorded_through_the_proxy(shop, tok):
    """Scripted policy replies: lookup, multiply, answer. The agent's two tools run, the reward is 1, and
    the trajectory holds the three sampled replies verbatim with the tool results as masked observations."""
    from trajgrad.envs.base import Task
    from trajgrad.model.tiny import build_tiny_model
    from trajgrad.rollout.chat import encode, end_of_turn_id
    from trajgrad.train.proxy import ProxySampler

    s = ProxySampler(build_tiny_model(tok, seed=0), tok, agent="shop_tasks:episode", temperature=1.0, top_k=None,
                     top_p=None, max_new_tokens=64, console=lambda m: None)
    replies = ['<tool_call>{"name": "lookup_price", "arguments": {"item": "apples"}}</tool_call>',
               '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 3}}</tool_call>', "9"]
    script = list(replies)
    eot = end_of_turn_id(tok)

    def submit(rows, key, seed):
        ids = encode(tok, script.pop(0)) + [eot]
        f = Future()
        f.set_result(([(ids, [-0.25] * len(ids), False) for _ in rows], s.state.policy_version))
        return f

    s.state.submit = submit
    try:
        task = Task(id="q", split="heldout", prompt="How much do 3 apples cost?", answer=9)
        (traj,) = s.rollout(None, [task])
    finally:
        s.close()
    assert traj.total_reward == 1.0 and traj.success is True and [t.action_text for t in traj.turns] == replies
    obs = [tok.decode(t.observation_ids) for t in traj.turns]
    assert obs[0] == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n" and "tool\n9" in obs[1]
    assert sum(traj.action_mask()) == sum(len(t.action_ids) for t in traj.turns)


def _train(tmp_path, **over):
    import trajgrad

    base = {"log.progress": False, "sampling.max_new_tokens": 16, "model.tiny.hidden_size": 32}
    base.update(over)
    return trajgrad.train(config=EXAMPLE / "shop_tiny.yaml", overrides=base, run_dir=tmp_path / "run",
                          console=lambda m: None)


def test_example_trains_on_the_tiny_model(shop, tmp_path):
    s = _train(tmp_path, **{"rollout.proxy.agent": "shop_tasks:episode", "train.steps": 2})
    assert s["steps"] == 2
    lines = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 16 and all(x["task_id"].startswith("shop-train-") for x in lines)
    assert [{t["policy_version"] for t in x["turns"]} for x in lines] == [{0}] * 8 + [{1}] * 8
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m.get("kind") == "train"]
    assert [m["policy_version"] for m in steps] == [1.0, 2.0]
    assert all(m["mismatch/max_abs_log_ratio"] < 1e-5 for m in steps)


def test_example_shell_command_as_configured(shop, tmp_path, monkeypatch):
    """The YAML's own agent command (python run_episode.py per episode), one small step."""
    monkeypatch.chdir(EXAMPLE.parents[1])
    monkeypatch.setenv("PYTHONPATH", ":".join([str(EXAMPLE.parents[1] / "src"), str(EXAMPLE)] + sys.path))
    s = _train(tmp_path, **{"train.steps": 1, "train.prompts_per_step": 1, "train.group_size": 2})
    assert s["steps"] == 1
    lines = (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 2
