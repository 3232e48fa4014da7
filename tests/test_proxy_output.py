"""rollout.backend: proxy keeps a shell agent's output in the run directory and shows it when the agent
fails; a task source with only tasks(split, n, seed) is enough for it (the agent is the environment)."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from trajgrad.envs.base import Task
from trajgrad.model.tiny import build_tiny_model
from trajgrad.train.config import load_config
from trajgrad.serve.proxy import ProxySampler

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("one_thread")
ME = __name__

AGENT = '''
import json, os, sys
import httpx  # a light agent: plain HTTP to the OpenAI-compatible session URL
task = json.loads(os.environ["TRAJGRAD_TASK"])
print("agent stdout for", task["id"])
print("agent stderr for", task["id"], file=sys.stderr)
httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", timeout=60, json={
    "model": os.environ["TRAJGRAD_MODEL"], "messages": [{"role": "user", "content": task["prompt"]}]}).raise_for_status()
if task["prompt"] != "forget":
    httpx.post(os.environ["TRAJGRAD_REWARD_URL"], json={"reward": 1.0}, timeout=60).raise_for_status()
'''


class TasksOnly:
    """The task list of an agent that is its own environment: tasks(), no make_env()."""

    def tasks(self, split, n, seed):
        return [Task(id=f"{split}-{seed}-{i}", split=split, prompt=f"question {split} {i}", answer=None)
                for i in range(n)]


def tasks_only():
    return TasksOnly()


@pytest.fixture()
def agent(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(AGENT))
    return f"{sys.executable} {script}"


def test_a_shell_agents_output_is_kept_and_shown_when_it_fails(tok, tmp_path, agent):
    said = []
    s = ProxySampler(build_tiny_model(tok, seed=0), tok, agent=agent, temperature=1.0, top_k=None, top_p=None,
                     max_new_tokens=4, console=said.append, output_log=str(tmp_path / "agent_output.log"))
    try:
        trajs = s.rollout(None, [Task(id="a", split="train", prompt="hi", answer=None),
                                 Task(id="b", split="train", prompt="forget", answer=None)])
    finally:
        s.close()
    assert [t.task_id for t in trajs] == ["a"] and s.counters["trained"] == 1
    log = (tmp_path / "agent_output.log").read_text()
    for tid in ("a", "b"):
        assert f"task {tid} (exit status 0) ===" in log
        assert f"agent stdout for {tid}" in log and f"agent stderr for {tid}" in log
    assert len(said) == 1 and "exited without reporting a reward: agent stdout for b" in said[0], said
    assert str(tmp_path / "agent_output.log") in said[0]


def test_a_task_list_without_make_env_trains_through_the_proxy(tmp_path, agent):
    from trajgrad.train.trainer import Trainer

    over = {"task.name": f"{ME}:tasks_only", "task.options": {}, "rollout.backend": "proxy",
            "rollout.proxy.agent": agent, "train.steps": 1, "train.prompts_per_step": 2, "train.group_size": 2,
            "sft.steps": 0, "eval.before": False, "eval.after": False, "checkpoint.every": 0, "task.n_heldout": 2,
            "sampling.max_new_tokens": 4, "log.progress": False, "log.tensorboard": False,
            "model.tiny.hidden_size": 32}
    tr = Trainer(load_config(preset="tiny", overrides=over), tmp_path / "run", console=lambda m: None)
    try:
        tr.run()
    finally:
        tr.sampler.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(x["total_reward"] == 1.0 for x in lines)
    assert (tmp_path / "run" / "agent_output.log").read_text().count("agent stdout for train-") == 4
    with pytest.raises(ValueError, match=r"^task\.name: .*gives tasks\(\) but no make_env\(\): only rollout\.backend "
                                         r"'proxy'"):
        load_config(preset="tiny", overrides={**over, "rollout.backend": "hf", "rollout.proxy.agent": None})
