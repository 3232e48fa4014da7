"""The shop agent's tasks, its score, and the glue that runs one training episode.

``ShopTasks`` lists questions over the price table of ``agent.py`` (split into train and
held-out by a hash of the question); the agent answers them through the proxy, and
``score`` compares its final reply with the true price. ``episode`` (a Python callable for
``rollout.proxy.agent``) and ``python run_episode.py`` (a shell command) each run
``agent.run_agent`` unchanged and report the reward.
"""
from __future__ import annotations

import hashlib
import re
from typing import List

from agent import PRICES

COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 9)


def _split(question: str, heldout_fraction: float = 0.25) -> str:
    h = int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < heldout_fraction else "train"


def questions() -> List[dict]:
    out = []
    for item, price in sorted(PRICES.items()):
        out.append({"q": f"How much does one {item} cost?", "answer": price})
        for n in COUNTS[1:]:
            out.append({"q": f"How much do {n} {item}s cost?", "answer": n * price})
    return out


def score(answer_text: str, task) -> float:
    """1.0 when the reply is the right number (alone, or as its last number), else 0.0."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer_text or "")
    return 1.0 if numbers and float(numbers[-1]) == float(task.answer) else 0.0


class ShopTasks:
    """A task source: ``tasks(split, n, seed)`` (the agent is the environment: no ``make_env``)."""

    name = "shop"

    def __init__(self, heldout_fraction: float = 0.25):
        self.heldout_fraction = heldout_fraction

    def tasks(self, split: str, n: int, seed: int) -> list:
        from trajgrad.envs.base import Task

        pool = [q for q in questions() if _split(q["q"], self.heldout_fraction) == split]
        if not pool:
            raise ValueError(f"split: no {split!r} questions")
        out = []
        for i in range(n):
            q = pool[(i + seed) % len(pool)]
            out.append(Task(id=f"shop-{split}-{(i + seed) % len(pool):03d}", split=split, prompt=q["q"],
                            answer=q["answer"]))
        return out

    def make_env(self, **kwargs):
        raise NotImplementedError("the shop agent runs outside trajgrad (rollout.backend: proxy)")


def episode(task, base_url, session):
    """One training episode: the unchanged agent against the served policy, then its score."""
    import openai

    from agent import run_agent

    client = openai.OpenAI(base_url=base_url, api_key="trajgrad-local", max_retries=0)
    answer = run_agent(client, task.prompt, model="policy")
    reward = score(answer, task)
    return {"reward": reward, "success": reward == 1.0}
