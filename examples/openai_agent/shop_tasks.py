"""The shop agent's tasks, its score, and the glue that runs one training episode.

``ShopTasks`` lists questions over the price table of ``agent.py`` (split into train and
held-out by a hash of the question); the agent answers them through the proxy, and
``score`` compares its final reply with the true price. ``episode`` (a Python callable for
``rollout.proxy.agent``) and ``python run_episode.py`` (a shell command) each run
``agent.run_agent`` unchanged and report the reward.
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import List

from agent import EXAMPLE, PRICES, SYSTEM, TOOLS

COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 9)  # the example's own; ``max_count`` asks for more items at once


def _split(question: str, heldout_fraction: float = 0.25) -> str:
    h = int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < heldout_fraction else "train"


def questions(max_count: int = COUNTS[-1]) -> List[dict]:
    """One question per item and count from 1 to ``max_count``: the example's own (counts up to 9)
    first, in their order, then the larger counts (so a larger ``max_count`` keeps the first ones)."""
    out = []
    for item, price in sorted(PRICES.items()):
        out.append({"q": f"How much does one {item} cost?", "answer": price})
        for n in COUNTS[1:]:
            out.append({"q": f"How much do {n} {item}s cost?", "answer": n * price})
    for item, price in sorted(PRICES.items()):
        for n in range(COUNTS[-1] + 1, max_count + 1):
            out.append({"q": f"How much do {n} {item}s cost?", "answer": n * price})
    return out


def _item_and_count(question: str):
    m = re.fullmatch(r"How much (?:does one|do (\d+)) (\w+?)s? cost\?", question)
    if m is None or m.group(2) not in PRICES:
        raise ValueError(f"demonstration: not a question of the shop: {question!r}")
    return m.group(2), int(m.group(1) or 1)


def _call(i: int, name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def score(answer_text: str, task) -> float:
    """1.0 when the reply is the right number (alone, or as its last number), else 0.0."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer_text or "")
    return 1.0 if numbers and float(numbers[-1]) == float(task.answer) else 0.0


class ShopTasks:
    """A task source: ``tasks(split, n, seed)`` (the agent is the environment: no ``make_env``).

    ``task.options``: ``heldout_fraction`` (share of the questions held out, by hash) and ``max_count``
    (questions ask for 1 to ``max_count`` items; 9, the example's own, holds out 24 distinct questions;
    25 holds out 69).
    """

    name = "shop"

    def __init__(self, heldout_fraction: float = 0.25, max_count: int = COUNTS[-1]):
        if not (isinstance(max_count, int) and max_count >= COUNTS[-1]):
            raise ValueError(f"task.options.max_count: expected an integer of at least {COUNTS[-1]}, got {max_count!r}")
        self.heldout_fraction = heldout_fraction
        self.max_count = max_count

    def tasks(self, split: str, n: int, seed: int) -> list:
        from trajgrad.envs.base import Task

        pool = [q for q in questions(self.max_count) if _split(q["q"], self.heldout_fraction) == split]
        if not pool:
            raise ValueError(f"split: no {split!r} questions")
        out = []
        for i in range(n):
            q = pool[(i + seed) % len(pool)]
            out.append(Task(id=f"shop-{split}-{(i + seed) % len(pool):03d}", split=split, prompt=q["q"],
                            answer=q["answer"]))
        return out

    def first_request(self, task) -> dict:
        """The agent's first chat request for ``task`` (what ``agent.run_agent`` sends)."""
        return {"messages": [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": task.prompt}],
                "tools": TOOLS}

    def demonstration(self, task) -> list:
        """The correct exchange, as the worked example shows it: lookup_price(item), multiply(count, price),
        then the number alone."""
        item, count = _item_and_count(task.prompt)
        price = PRICES[item]
        return [_call(0, "lookup_price", {"item": item}), {"role": "tool", "tool_call_id": "call_0", "content": str(price)},
                _call(1, "multiply", {"a": count, "b": price}),
                {"role": "tool", "tool_call_id": "call_1", "content": str(count * price)},
                {"role": "assistant", "content": str(count * price)}]

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
