"""examples/openai_agent: an agent written only against the openai client, trained unchanged through
the proxy on the tiny model (as a Python callable and as a shell command)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _proxy_examples import check_two_steps, scripted_proxy, train_example  # noqa: E402

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

    replies = ['<tool_call>{"name": "lookup_price", "arguments": {"item": "apples"}}</tool_call>',
               '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 3}}</tool_call>', "9"]
    s = scripted_proxy(tok, "shop_tasks:episode", replies)
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
    return train_example(EXAMPLE / "shop_tiny.yaml", tmp_path, **over)


def test_example_trains_on_the_tiny_model(shop, tmp_path):
    s = _train(tmp_path, **{"rollout.proxy.agent": "shop_tasks:episode", "train.steps": 2})
    assert s["steps"] == 2
    check_two_steps(tmp_path, "shop-train-")


def test_example_shell_command_as_configured(shop, tmp_path, monkeypatch):
    """The YAML's own agent command (python run_episode.py per episode), one small step."""
    monkeypatch.chdir(EXAMPLE.parents[1])
    monkeypatch.setenv("PYTHONPATH", ":".join([str(EXAMPLE.parents[1] / "src"), str(EXAMPLE)] + sys.path))
    s = _train(tmp_path, **{"train.steps": 1, "train.prompts_per_step": 1, "train.group_size": 2})
    assert s["steps"] == 1
    lines = (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 2
