"""``verifiers`` environments (0.4, ``verifiers.v1``) as a task source.

A ``verifiers`` environment is a ``Taskset`` (the data half: tasks with a prompt, an
optional system prompt and their fields) whose ``Task`` class carries the rubric: its
``@vf.reward`` methods (and rewards plugged through the task's config), each weighted.
``load_environment`` factories return either the ``Taskset`` or an ``Env`` holding one
(``env.taskset``); both are accepted unchanged.

An episode is one reply: :meth:`VerifiersEnvironment.reset` renders the task's system
prompt and prompt as messages; :meth:`VerifiersEnvironment.step` records the reply in a
``verifiers`` ``Trace`` (the prompt messages, then the reply as the sampled assistant
message) and awaits ``task.score(trace)``, which runs the rubric exactly as
``verifiers`` does. The reward is ``trace.reward`` (the weighted sum of the rubric's
rewards); ``info["success"]`` is ``reward >= success_threshold``. A rubric that raises is
an error of the run (``RuntimeError`` naming the task), never a silent zero. Rubric
functions that need a sandbox runtime are skipped by ``verifiers`` itself when scoring
without one, as in its offline scoring.

Splits: a task goes to ``heldout`` by the hash of its ``key`` (``heldout_fraction``).
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, List, Optional

from ..task import Message, StepResult, Task
from ..splits import hash_split, take

__all__ = ["VerifiersEnvironment", "VerifiersSource"]


def _messages(data: Any) -> List[Message]:
    from verifiers.v1.types import content_text

    msgs: List[Message] = []
    if getattr(data, "system_prompt", None):
        msgs.append({"role": "system", "content": str(data.system_prompt)})
    prompt = data.prompt
    if isinstance(prompt, str):
        msgs.append({"role": "user", "content": prompt})
    else:
        for m in prompt or []:
            role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
            content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
            msgs.append({"role": str(role), "content": content if isinstance(content, str) else content_text(content)})
    if not msgs or msgs[-1]["role"] != "user":
        raise ValueError(f"task: a verifiers task must end its prompt with a user message, got {msgs!r}")
    return msgs


def _run(coro):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    import concurrent.futures  # called from inside an event loop: score on a fresh one

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class VerifiersEnvironment:
    """One single-reply episode over a ``verifiers`` task."""

    max_turns = 1

    def __init__(self, source: "VerifiersSource") -> None:
        self.source, self.name = source, source.name
        self._vf_task = None
        self._prompt: List[Message] = []

    def reset(self, task: Task) -> List[Message]:
        self._vf_task = self.source.vf_task(task)
        self._prompt = _messages(self._vf_task.data)
        return [dict(m) for m in self._prompt]

    def potential(self) -> float:
        return 0.0

    def score(self, reply: str) -> tuple:
        """(reward, {reward name: score}) of ``reply`` under the task's rubric."""
        import verifiers.v1 as vf
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        t = self._vf_task
        trace = Trace(task=TraceTask(type=type(t).__name__, data=t.data, key=t.key, hash=t.hash),
                      agent=AgentInfo(config=vf.AgentConfig()))
        kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
        for k, m in enumerate(self._prompt):
            trace.nodes.append(MessageNode(parent=k - 1 if k else None, message=kinds[m["role"]](content=m["content"])))
        trace.nodes.append(MessageNode(parent=len(self._prompt) - 1, message=vf.AssistantMessage(content=reply),
                                       sampled=True))
        try:
            _run(t.score(trace))
        except Exception as exc:
            raise RuntimeError(f"task.name: the verifiers rubric of task {t.key!r} raised "
                               f"{type(exc).__name__}: {exc}") from exc
        parts = {k: (None if r is None else float(r.value)) for k, r in trace.rewards.items()}
        return float(trace.reward), parts

    def step(self, action_text: str) -> StepResult:
        if self._vf_task is None:
            raise ValueError("step: call reset(task) first")
        reward, parts = self.score(action_text)
        info = {"success": reward >= self.source.success_threshold,
                **{f"reward/{k}": v for k, v in parts.items() if v is not None}}
        return StepResult([], reward, True, False, info)


class VerifiersSource:
    """Task source over a ``verifiers`` ``Taskset`` (or an ``Env`` with ``.taskset``).

    Args:
      env: the ``Taskset`` or ``Env`` (e.g. what the package's ``load_environment`` returns).
      heldout_fraction: share of the tasks (by hash of their key) held out.
      success_threshold: reward at or above which an episode counts as a success.
      max_tasks: read at most this many tasks of the taskset (infinite tasksets need it).
    """

    name = "verifiers"

    def __init__(self, env: Any, *, heldout_fraction: float = 0.2, success_threshold: float = 1.0,
                 max_tasks: Optional[int] = None) -> None:
        taskset = getattr(env, "taskset", env)
        if not hasattr(taskset, "load") or not hasattr(taskset, "__iter__"):
            raise ValueError(f"env: expected a verifiers Taskset or an Env with .taskset, got {type(env).__name__}")
        if not getattr(taskset, "bounded", True) and max_tasks is None:
            raise ValueError("max_tasks: the verifiers taskset is infinite; give max_tasks")
        hash_split("probe", heldout_fraction)  # validates the fraction
        self.taskset = taskset
        self.heldout_fraction = float(heldout_fraction)
        self.success_threshold = float(success_threshold)
        self._max = max_tasks
        self._pool = None

    def _tasks_by_split(self):
        if self._pool is None:
            import itertools

            pool = {"train": [], "heldout": []}
            items = itertools.islice(iter(self.taskset), self._max) if self._max else iter(self.taskset)
            for t in items:
                pool[hash_split(str(t.key), self.heldout_fraction)].append(t)
            if not pool["train"]:
                raise ValueError("env: the verifiers taskset yielded no training tasks")
            if self.heldout_fraction > 0 and not pool["heldout"]:
                pool["heldout"] = pool["train"][-1:]  # one task: too few to hold any out by hash
            self._pool = pool
            self._by_key = {t.key: t for split in pool.values() for t in split}
        return self._pool

    def tasks(self, split: str, n: int, seed: int) -> List[Task]:
        if split not in ("train", "heldout"):
            raise ValueError(f"split: expected 'train' or 'heldout', got {split!r}")
        pool = self._tasks_by_split()[split]
        picked = take(pool, n, seed, what=f"{split} tasks")
        out, seen = [], {}
        for t in picked:
            k = seen[t.key] = seen.get(t.key, -1) + 1
            out.append(Task(id=f"vf-{split}-{t.key}" + (f"#{k}" if k else ""), split=split,
                            prompt=t.data.prompt_text, answer=getattr(t.data, "answer", None),
                            metadata={"vf_key": t.key}))
        return out

    def vf_task(self, task: Task):
        """The ``verifiers`` task behind ``task``."""
        self._tasks_by_split()
        found = self._by_key.get(task.metadata.get("vf_key"))
        if found is not None:
            return found
        raise ValueError(f"task: {task.id!r} is not a task of this verifiers environment")

    def make_env(self, **kwargs: Any) -> VerifiersEnvironment:
        return VerifiersEnvironment(self)

    def demonstration(self, task: Task) -> List[Message]:
        answer = task.answer
        if answer is None:
            raise ValueError("sft.steps: the verifiers tasks carry no 'answer' field to demonstrate; set sft.steps to 0")
        return [{"role": "assistant", "content": str(answer)}]
