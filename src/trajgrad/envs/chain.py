r"""Task source ``"chain"``: three dependent tool calls, rewarded only for the final answer.

A task names an item; its answer needs three calls, each on the previous call's result::

    user:      Look up the code of kiwi, fetch the record with that code, then compute its value * 7.
    assistant: <lookup>kiwi</lookup>
    user:      <result>417</result>              (a random code of this task)
    assistant: <fetch>417</fetch>
    user:      <result>86</result>               (a random value of this task)
    assistant: <calc>86 * 7</calc>
    user:      <result>602</result>
    assistant: <answer>602</answer>

The codes (100..999) and values (10..99) are drawn per task, so the answer cannot be
guessed or computed without the first two results, and the last step is one operation
(``+ - *`` with an operand of the task) done by the calculator. The task's directory holds
the item and ``distractors`` other items with their own codes and records: a lookup of the
wrong item, or a fetch of the wrong code, leads to a wrong value.

Each assistant turn is one :meth:`ChainEnv.step`; its first complete ``<lookup>``,
``<fetch>``, ``<calc>`` or ``<answer>`` tag is the action. A call's result (or
``<result>error: ...</result>``) comes back as a user turn.

Reward: ``1.0`` on the step with the correct ``<answer>``, ``0`` everywhere else (no
reward for calls: credit for the three calls comes only from the end). A wrong answer
ends the episode with 0; so does reaching ``max_turns`` (default 5: the three calls, the
answer and one spare turn) without an answer (``terminated``, so a critic does not
bootstrap a value there). :math:`\Phi = 0` (no potential).

Splits: the SHA-256 of the task's content (item, code, value, operation) decides its
split (``heldout`` for ``heldout_fraction`` of the hashes), so train and held-out tasks
never coincide; the tasks of one call are distinct.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from .base import Message, StepResult, Task, extract_tag, register_task_source
from .calculator import calculator_tool
from .splits import check_task_request, hash_split

__all__ = ["ChainConfig", "ChainEnv", "ChainSource"]

_ACTIONS = ("lookup", "fetch", "calc", "answer")
ITEMS = ("apple", "kiwi", "mango", "lemon", "peach", "plum", "grape", "melon", "cherry", "banana", "orange",
         "pear", "lime", "fig", "date", "olive", "carrot", "onion", "potato", "tomato", "pepper", "garlic",
         "ginger", "radish", "walnut", "almond", "cashew", "hazel", "cocoa", "coffee", "tea", "honey",
         "butter", "cheese", "bread", "rice", "pasta", "flour", "sugar", "salt", "basil", "mint", "sage",
         "thyme", "cumin", "clove", "nutmeg", "vanilla")
_EXAMPLES = ({"item": "apple", "code": 512, "op": "*", "operand": 4, "records": {512: 38}},
             {"item": "pear", "code": 274, "op": "+", "operand": 57, "records": {274: 61}})


@dataclass(frozen=True)
class ChainConfig:
    """Options of the chain tasks (keyword arguments of ``get_task_source("chain", ...)``).

    Attributes:
      max_turns: assistant turns before the episode ends as a failure (>= 4).
      distractors: other items in each task's directory (0..5).
      heldout_fraction: fraction of the task-hash space assigned to ``heldout``.
      few_shot: include the worked examples (as chat turns) in ``reset``.
      examples: how many worked examples ``few_shot`` shows (1 or 2). SmolLM2-135M-Instruct
        with one example looks the item up, then answers with its code: 0/64 held-out.
      system_prompt: ``None`` for the built-in instructions, a string to replace them,
        ``""`` for no system message.
    """

    max_turns: int = 5
    distractors: int = 2
    heldout_fraction: float = 0.2
    few_shot: bool = True
    examples: int = 1
    system_prompt: Optional[str] = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.max_turns, int) and self.max_turns >= 4):
            raise ValueError(f"max_turns: expected an integer >= 4 (three calls and the answer), got {self.max_turns!r}")
        if not (isinstance(self.distractors, int) and 0 <= self.distractors <= 5):
            raise ValueError(f"distractors: expected an integer in [0, 5], got {self.distractors!r}")
        if not 0.0 < float(self.heldout_fraction) < 1.0:
            raise ValueError(f"heldout_fraction: expected a number in (0, 1), got {self.heldout_fraction}")
        if self.examples not in (1, 2) or isinstance(self.examples, bool):
            raise ValueError(f"examples: expected 1 or 2, got {self.examples!r}")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"system_prompt: expected a string or None, got {type(self.system_prompt).__name__}")


def _apply(value: int, op: str, operand: int) -> int:
    return value + operand if op == "+" else value - operand if op == "-" else value * operand


def _question(item: str, op: str, operand: int) -> str:
    return (f"Look up the code of {item}, fetch the record with that code, then compute its value {op} {operand}. "
            "What is the result?")


_INSTRUCTIONS = ("You answer with tools. <lookup>ITEM</lookup> gives an item's code, <fetch>CODE</fetch> gives the "
                 "value of the record with that code, <calc>EXPRESSION</calc> computes one operation. Each result "
                 "comes back as <result>...</result>. Write one tool call per reply; when you know the result, "
                 "write <answer>NUMBER</answer>.")


def _exchange(t: Dict[str, Any]) -> List[Message]:
    """The ideal three calls and the answer for task content ``t``."""
    value = t["records"][t["code"]]
    final = _apply(value, t["op"], t["operand"])
    return [{"role": "assistant", "content": f"<lookup>{t['item']}</lookup>"},
            {"role": "user", "content": f"<result>{t['code']}</result>"},
            {"role": "assistant", "content": f"<fetch>{t['code']}</fetch>"},
            {"role": "user", "content": f"<result>{value}</result>"},
            {"role": "assistant", "content": f"<calc>{value} {t['op']} {t['operand']}</calc>"},
            {"role": "user", "content": f"<result>{final}</result>"},
            {"role": "assistant", "content": f"<answer>{final}</answer>"}]


def _first_action(text: str) -> Tuple[Optional[str], str]:
    """The first complete action tag in ``text``: ``(kind, content)`` or ``(None, "")``."""
    found = []
    for kind in _ACTIONS:
        at = text.find(f"<{kind}>")
        content = extract_tag(text, kind)
        if at >= 0 and content is not None:
            found.append((at, kind, content))
    if not found:
        return None, ""
    _, kind, content = min(found)
    return kind, content


def _as_int(text: str) -> Optional[int]:
    text = text.replace(",", "").strip()
    try:
        return int(text)
    except ValueError:
        return None


class ChainEnv:
    """One chain episode at a time (see the module docstring for the rules)."""

    name = "chain"

    def __init__(self, config: Optional[ChainConfig] = None, **overrides: Any) -> None:
        cfg = config or ChainConfig()
        self.config = replace(cfg, **overrides) if overrides else cfg
        self.max_turns = self.config.max_turns
        self._calc = calculator_tool(ops_per_call=1)
        self._task: Optional[Task] = None
        self._done = True
        self.calls: List[Tuple[str, str]] = []

    def reset(self, task: Task) -> List[Message]:
        if not isinstance(task, Task) or not isinstance(task.metadata.get("records"), dict):
            raise ValueError("task: expected a chain Task (from ChainSource.tasks()) with metadata['records']")
        self._task = task
        self._turns = 0
        self._done = False
        self.calls = []
        system = _INSTRUCTIONS if self.config.system_prompt is None else self.config.system_prompt
        messages: List[Message] = [{"role": "system", "content": system}] if system else []
        if self.config.few_shot:
            for ex in _EXAMPLES[:self.config.examples]:
                messages.append({"role": "user", "content": _question(ex["item"], ex["op"], ex["operand"])})
                messages += _exchange(ex)
        messages.append({"role": "user", "content": task.prompt})
        return messages

    def potential(self) -> float:
        return 0.0

    def _tool(self, kind: str, content: str) -> str:
        """The result text of one call (``error: ...`` for a bad one)."""
        meta = self._task.metadata
        if kind == "lookup":
            code = meta["directory"].get(content.strip().lower())
            return f"error: no item named {content.strip()!r}" if code is None else str(code)
        if kind == "fetch":
            code = _as_int(content)
            value = None if code is None else meta["records"].get(str(code))
            return f"error: no record with code {content.strip()!r}" if value is None else str(value)
        try:
            return str(self._calc.fn(content))
        except (ValueError, ZeroDivisionError) as exc:
            return f"error: {exc}"

    def step(self, action_text: str) -> StepResult:
        if self._task is None or self._done:
            raise RuntimeError("step() called on a finished episode; call reset(task) first")
        if not isinstance(action_text, str):
            raise ValueError(f"action_text: expected a string, got {type(action_text).__name__}")
        self._turns += 1
        kind, content = _first_action(action_text)
        info: Dict[str, Any] = {"potential": 0.0}
        if kind == "answer":
            value = _as_int(content)
            correct = value is not None and value == self._task.answer
            self._done = True
            info.update(success=correct, answer=value)
            return StepResult([], 1.0 if correct else 0.0, True, False, info)
        if kind is None:
            info["tool_error"] = "no action"
            out = "error: no action found; write <lookup>, <fetch>, <calc> or <answer>"
        else:
            out = self._tool(kind, content)
            info["tool"] = kind
            info["tool_error"] = out[len("error: "):] if out.startswith("error: ") else None
            self.calls.append((kind, out))
        if self._turns >= self.max_turns:
            self._done = True
            info["success"] = False
            return StepResult([], 0.0, True, False, info)
        return StepResult([{"role": "user", "content": f"<result>{out}</result>"}], 0.0, False, False, info)


@register_task_source("chain")
class ChainSource:
    """Generates chain tasks; builds :class:`ChainEnv`; demonstrates the three calls.

    Keyword arguments are the fields of :class:`ChainConfig`.
    """

    name = "chain"

    def __init__(self, **kwargs: Any) -> None:
        self.config = ChainConfig(**kwargs)

    def _content(self, rng: random.Random) -> Dict[str, Any]:
        items = rng.sample(ITEMS, 1 + self.config.distractors)
        codes = rng.sample(range(100, 1000), len(items))
        values = [rng.randint(10, 99) for _ in items]
        op = rng.choice("+-*")
        operand = rng.randint(3, 9) if op == "*" else rng.randint(11, 99)
        return {"item": items[0], "code": codes[0], "op": op, "operand": operand,
                "directory": dict(zip(items, codes)), "records": dict(zip(codes, values))}

    def tasks(self, split: str, n: int, seed: int) -> List[Task]:
        """``n`` distinct tasks of ``split``, deterministic in ``seed``."""
        check_task_request(split, n, seed)
        rng = random.Random(f"chain|{seed}|{split}")
        out: List[Task] = []
        seen = set()
        while len(out) < n:
            t = self._content(rng)
            value = t["records"][t["code"]]
            key = f"{t['item']}|{t['code']}|{value}|{t['op']}|{t['operand']}"
            if key in seen or hash_split(f"chain|{key}", self.config.heldout_fraction) != split:
                continue
            seen.add(key)
            meta = {"item": t["item"], "code": t["code"], "value": value, "op": t["op"], "operand": t["operand"],
                    "directory": t["directory"], "records": {str(c): v for c, v in t["records"].items()}}
            out.append(Task(id=f"chain-{split}-{len(out):06d}-{t['item']}-{t['code']}", split=split,
                            prompt=_question(t["item"], t["op"], t["operand"]),
                            answer=_apply(value, t["op"], t["operand"]), metadata=meta))
        return out

    def make_env(self, **kwargs: Any) -> ChainEnv:
        return ChainEnv(self.config, **kwargs)

    def demonstration(self, task: Task) -> List[Message]:
        """The three calls on the task's own results, then the answer."""
        if not isinstance(task, Task) or "records" not in task.metadata:
            raise ValueError("task: expected a chain Task with metadata['records']")
        m = task.metadata
        return _exchange({"item": m["item"], "code": m["code"], "op": m["op"], "operand": m["operand"],
                          "records": {m["code"]: m["value"]}})
