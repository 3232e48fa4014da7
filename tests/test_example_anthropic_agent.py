"""examples/anthropic_agent: an agent written only against the anthropic client, trained unchanged
through the proxy's /v1/messages on the tiny model (as a Python callable and as a shell command)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _proxy_examples import check_two_steps, scripted_proxy, train_example  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "anthropic_agent"
pytest.importorskip("anthropic")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def calendar(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import calendar_tasks

    return calendar_tasks


def test_agent_uses_only_the_anthropic_client():
    src = (EXAMPLE / "calendar_agent.py").read_text()
    imports = {line.split()[1].split(".")[0] for line in src.splitlines() if line.startswith(("import ", "from "))}
    assert imports == {"__future__", "os", "sys", "anthropic"}
    assert "import" not in (EXAMPLE / "run_episode.py").read_text().split("from calendar_tasks import play")[1]


def test_tasks_and_score(calendar):
    src = calendar.CalendarTasks()
    train, held = src.tasks("train", 30, 0), src.tasks("heldout", 10, 0)
    assert not {t.prompt for t in train} & {t.prompt for t in held} and len({t.prompt for t in held}) == 10
    assert all("October" in t.prompt or "November" in t.prompt or "December" in t.prompt for t in held)
    task = next(t for t in train if t.prompt == "How many days are there in February and March together?")
    assert task.answer == 59 and calendar.score("That is 59 days.", task) == 1.0
    assert calendar.score("no idea", task) == 0.0 and calendar.score("58", task) == 0.0


def test_the_unchanged_agent_loop_is_recorded_through_the_proxy(calendar, tok):
    """Scripted policy replies: days_in_month twice, add, the answer. The agent's tools run through
    tool_use / tool_result blocks, the reward is 1, and the trajectory holds the four sampled replies
    verbatim with the tool results as masked observations."""
    from trajgrad.envs.base import Task

    replies = ['<tool_call>{"name": "days_in_month", "arguments": {"month": "march"}}</tool_call>',
               '<tool_call>{"name": "days_in_month", "arguments": {"month": "April"}}</tool_call>',
               'Adding. <tool_call>{"name": "add", "arguments": {"a": 31, "b": 30}}</tool_call>', "61"]
    s = scripted_proxy(tok, "calendar_tasks:episode", replies)
    try:
        task = Task(id="q", split="train", prompt="How many days are there in March and April together?", answer=61)
        (traj,) = s.rollout(None, [task])
    finally:
        s.close()
    assert traj.total_reward == 1.0 and traj.success is True and [t.action_text for t in traj.turns] == replies
    assert "diverged" not in traj.metadata and s.counters["trained"] == 1
    obs = [tok.decode(t.observation_ids) for t in traj.turns]
    assert obs[0] == "\n<|im_start|>tool\n31<|im_end|>\n<|im_start|>assistant\n" and "tool\n61" in obs[2]
    assert sum(traj.action_mask()) == sum(len(t.action_ids) for t in traj.turns)


def test_example_trains_on_the_tiny_model(calendar, tmp_path):
    s = train_example(EXAMPLE / "calendar_tiny.yaml", tmp_path,
                      **{"rollout.proxy.agent": "calendar_tasks:episode", "train.steps": 2})
    assert s["steps"] == 2
    check_two_steps(tmp_path, "calendar-train-")


def test_example_shell_command_as_configured(calendar, tmp_path, monkeypatch):
    """The YAML's own agent command (python run_episode.py per episode, ANTHROPIC_BASE_URL), one small step."""
    monkeypatch.chdir(EXAMPLE.parents[1])
    monkeypatch.setenv("PYTHONPATH", ":".join([str(EXAMPLE.parents[1] / "src"), str(EXAMPLE)] + sys.path))
    s = train_example(EXAMPLE / "calendar_tiny.yaml", tmp_path,
                      **{"train.steps": 1, "train.prompts_per_step": 1, "train.group_size": 2})
    assert s["steps"] == 1 and len((tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()) == 2
