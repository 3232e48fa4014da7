"""One episode as a shell command: ``rollout.proxy.agent: "python examples/anthropic_agent/run_episode.py"``.

``anthropic.Anthropic()`` reads ``ANTHROPIC_BASE_URL`` (the episode's session on the proxy); the task
comes as JSON in ``TRAJGRAD_TASK``; the outcome is POSTed to ``TRAJGRAD_REWARD_URL``.
"""
import json
import os
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anthropic  # noqa: E402

from calendar_tasks import play  # noqa: E402

outcome = play(anthropic.Anthropic(max_retries=0), SimpleNamespace(**json.loads(os.environ["TRAJGRAD_TASK"])),
               os.environ.get("TRAJGRAD_MODEL", "policy"))
urllib.request.urlopen(urllib.request.Request(
    os.environ["TRAJGRAD_REWARD_URL"], data=json.dumps(outcome).encode(), method="POST",
    headers={"Content-Type": "application/json"}), timeout=30).read()
