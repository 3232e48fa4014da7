"""The calendar agent's tasks, its score, and the glue that runs one training episode.

``CalendarTasks`` asks for the days of one month or of two months together (the months of the
last quarter are held out); ``score`` compares the agent's final reply with the true count.
``episode`` (a Python callable for ``rollout.proxy.agent``) and ``python run_episode.py`` (a shell
command) each run ``calendar_agent.run_agent`` unchanged through ``play`` and report the reward.
"""
from __future__ import annotations

import itertools
import re

from calendar_agent import DAYS, run_agent

HELDOUT_MONTHS = {"october", "november", "december"}


def questions(split: str) -> list:
    """``(question, answer)`` pairs; a question is held out when it names a held-out month."""
    months = list(DAYS)
    pairs = [(m,) for m in months] + list(itertools.combinations(months, 2))
    out = []
    for pair in pairs:
        if (split == "heldout") != bool(HELDOUT_MONTHS & set(pair)):
            continue
        names = " and ".join(m.capitalize() for m in pair)
        out.append((f"How many days are there in {names}{' together' if len(pair) == 2 else ''}?",
                    sum(DAYS[m] for m in pair)))
    return out


def score(answer_text: str, task) -> float:
    """1.0 when the last integer of the reply is the right count, else 0.0."""
    found = re.findall(r"\d+", answer_text or "")
    return float(bool(found) and int(found[-1]) == task.answer)


class CalendarTasks:
    """A task source: ``tasks(split, n, seed)`` (the agent is the environment: no ``make_env``)."""

    name = "calendar"

    def tasks(self, split: str, n: int, seed: int) -> list:
        from trajgrad.envs.base import Task

        pool = questions(split)
        if not pool:
            raise ValueError(f"split: no {split!r} questions")
        picked = [(seed + i) % len(pool) for i in range(n)]
        return [Task(id=f"calendar-{split}-{k:03d}", split=split, prompt=pool[k][0], answer=pool[k][1]) for k in picked]

    def make_env(self, **kwargs):
        raise NotImplementedError("the calendar agent runs outside trajgrad (rollout.backend: proxy)")


def play(client, task, model: str) -> dict:
    """Run the unchanged agent on ``task`` with ``client``; ``{"reward", "success"}``."""
    reward = score(run_agent(client, task.prompt, model=model), task)
    return {"reward": reward, "success": reward == 1.0}


def episode(task, anthropic_base_url):
    """One training episode (``rollout.proxy.agent: "calendar_tasks:episode"``)."""
    import anthropic

    return play(anthropic.Anthropic(base_url=anthropic_base_url, api_key="trajgrad-local", max_retries=0), task,
                "policy")
