"""One episode as a shell command: the agent reads OPENAI_BASE_URL, the task comes in TRAJGRAD_TASK.

``rollout.proxy.agent: "python examples/openai_agent/run_episode.py"``. The reward goes to
``$TRAJGRAD_REWARD_URL`` (a plain POST; ``trajgrad.serve.client.report_reward`` does the same).
Only the agent, ``openai`` and the standard library are imported, so an episode starts quickly.
"""
import json
import os
import sys
import urllib.request
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import openai  # noqa: E402

from agent import run_agent  # noqa: E402
from shop_tasks import score  # noqa: E402

task = SimpleNamespace(**json.loads(os.environ["TRAJGRAD_TASK"]))
answer = run_agent(openai.OpenAI(max_retries=0), task.prompt, model=os.environ.get("TRAJGRAD_MODEL", "policy"))
reward = score(answer, task)
body = json.dumps({"reward": reward, "success": reward == 1.0}).encode()
request = urllib.request.Request(os.environ["TRAJGRAD_REWARD_URL"], data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
urllib.request.urlopen(request, timeout=30).read()
