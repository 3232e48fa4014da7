"""One episode as a shell command: the agent reads OPENAI_BASE_URL, the task comes in TRAJGRAD_TASK.

``rollout.proxy.agent: "python examples/openai_agent/run_episode.py"``; the reward goes to the
proxy with ``trajgrad.serve.client.report_reward`` (or ``curl -X POST $TRAJGRAD_REWARD_URL``).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import openai  # noqa: E402

from agent import run_agent  # noqa: E402
from shop_tasks import score  # noqa: E402
from trajgrad.envs.base import Task  # noqa: E402
from trajgrad.serve.client import report_reward  # noqa: E402

task = Task(**json.loads(os.environ["TRAJGRAD_TASK"]))
answer = run_agent(openai.OpenAI(max_retries=0), task.prompt, model=os.environ.get("TRAJGRAD_MODEL", "policy"))
reward = score(answer, task)
report_reward(reward, success=reward == 1.0)
