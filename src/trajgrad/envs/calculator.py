r"""Task source ``"calculator"``: multi-step integer arithmetic solved with a calculator tool.

A task is an expression such as ``12 + 7 * 31 - 5`` (2 to 3 operations by default,
operands up to 3 digits, operators ``+ - *``, usual precedence). The agent calls the
calculator, reads the result, then answers. The format (which SmolLM2-135M-Instruct
follows after one example)::

    assistant: <calc>12 + 7 * 31 - 5</calc>
    user:      <result>224</result>              (or <result>error: ...</result>)
    assistant: <answer>224</answer>

Each assistant turn is one :meth:`CalculatorEnv.step`; the first tag it contains
decides the action (``<calc>`` or ``<answer>``). Anything else gets an error
observation (``<result>error: ...</result>``) and costs a turn.

Rewards (per step; the episode return is their sum):

* ``1.0`` on the step with a correct ``<answer>`` (then ``terminated``); a wrong answer
  terminates with 0. With ``require_call=True`` an answer given before any successful
  calculator call is judged wrong.
* ``format_bonus`` (default 0.1), once per episode, on the step of the first
  well-formed calculator call (a tag whose expression the calculator accepts).
* Exceeding ``max_turns`` (default 4) without answering truncates the episode; with
  ``max_turns_terminates=True`` it ends the episode as a failure instead (``terminated``,
  so a critic does not bootstrap a value there).

``ops_per_call=1`` makes the calculator accept a single operation per call
(``<calc>7 * 31</calc>``), so a 3-operation task needs three calls and one answer,
and credit must flow across turns. ``cost_per_call`` is reported as ``info["cost"]``
on every calculator call (the §22 constraint cost; it is not subtracted from the
reward).

Potential (§21): :math:`\Phi(s) = 0.5` once some calculator call in this episode has
returned a correct intermediate value (the value of a sub-expression of the task, the
final value included), else 0; :math:`\Phi = 0` in the terminal state (absorbing-state
convention, so the shaped return is :math:`G_0 - \Phi(s_0) = G_0`). The environment
only reports it in ``info["potential"]``; the trainer applies
``trajgrad.advantages.shape_rewards``.

Splits: the SHA-256 of the canonical expression decides its split (``heldout`` for a
fixed fraction of hashes), so train and heldout are disjoint by construction for every
seed and every call.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import random
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .base import Message, StepResult, Task, extract_tag, register_task_source
from .sandbox import count_operations, format_number, safe_eval_arithmetic
from .tools import Tool, ToolRegistry

__all__ = ["CalculatorConfig", "CalculatorEnv", "CalculatorSource", "calculator_tool"]

_SPLITS = ("train", "heldout")
_OPS = "+-*"


@dataclass(frozen=True)
class CalculatorConfig:
    r"""Options of the calculator tasks and environments (all keyword arguments of
    ``get_task_source("calculator", ...)``).

    Attributes:
      min_ops, max_ops: number of binary operations per task (inclusive range).
      min_operand, max_operand: operand range (inclusive); ``max_operand <= 999``
        gives operands of up to 3 digits.
      operators: the operators tasks draw from (subset of ``"+-*"``).
      heldout_fraction: fraction of the expression-hash space assigned to ``heldout``.
      ops_per_call: ``None`` (any expression) or the maximum number of operations the
        calculator accepts in one call.
      max_turns: assistant turns before truncation.
      max_turns_terminates: if True, running out of turns without answering is a failure
        of the task: the episode is ``terminated`` (return 0 beyond the rewards so far)
        instead of ``truncated``. Critic recipes bootstrap the value of a truncated
        episode's last state, and a policy can exploit that estimate by never answering
        (malformed answers until the turn limit); a terminated episode has nothing to
        bootstrap. Default False.
      format_bonus: reward for the first well-formed calculator call of an episode.
      cost_per_call: ``info["cost"]`` of each calculator call (§22).
      few_shot: include the one-shot example in ``reset``.
      correct_potential: :math:`\Phi` once a correct intermediate value was returned.
      require_call: if True, a correct answer counts only after at least one successful
        calculator call (otherwise it is judged like a wrong answer).
      system_prompt: ``None`` for the built-in instructions, a string to replace them, or
        ``""`` for no system message (small models trained by SFT learn the format from
        the demonstrations and need no instructions).
      direct_demo_fraction: fraction of tasks whose demonstration answers at once, without
        calling the calculator (chosen by a hash of the expression, independently of the
        split), like a teacher that sometimes skips the tool. A model warm-started on such
        demonstrations calls the tool only part of the time, and its direct answers to new
        tasks are guesses: RL has a strategy to learn (the ``tiny`` presets). Default 0.
    """

    min_ops: int = 2
    max_ops: int = 3
    min_operand: int = 1
    max_operand: int = 999
    operators: str = _OPS
    heldout_fraction: float = 0.2
    ops_per_call: Optional[int] = None
    max_turns: int = 4
    max_turns_terminates: bool = False
    format_bonus: float = 0.1
    cost_per_call: float = 0.0
    few_shot: bool = True
    correct_potential: float = 0.5
    require_call: bool = False
    system_prompt: Optional[str] = None
    direct_demo_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"system_prompt: expected a string or None, got {type(self.system_prompt).__name__}")
        if not (isinstance(self.min_ops, int) and isinstance(self.max_ops, int) and 1 <= self.min_ops <= self.max_ops):
            raise ValueError(f"min_ops: expected integers 1 <= min_ops <= max_ops, got {self.min_ops}, {self.max_ops}")
        if self.max_ops > 8:
            raise ValueError(f"max_ops: at most 8 operations, got {self.max_ops}")
        if not (isinstance(self.min_operand, int) and isinstance(self.max_operand, int)):
            raise ValueError("min_operand: operands must be integers")
        if not 0 <= self.min_operand < self.max_operand <= 10**6:
            raise ValueError(
                "min_operand: expected 0 <= min_operand < max_operand <= 10**6, "
                f"got {self.min_operand}, {self.max_operand}"
            )
        if not self.operators or any(op not in _OPS for op in self.operators):
            raise ValueError(f"operators: expected a non-empty subset of {_OPS!r}, got {self.operators!r}")
        if not 0.0 < float(self.heldout_fraction) < 1.0:
            raise ValueError(f"heldout_fraction: expected a number in (0, 1), got {self.heldout_fraction}")
        if self.ops_per_call is not None and not (isinstance(self.ops_per_call, int) and self.ops_per_call >= 1):
            raise ValueError(f"ops_per_call: expected None or an integer >= 1, got {self.ops_per_call!r}")
        if not (isinstance(self.max_turns, int) and self.max_turns >= 1):
            raise ValueError(f"max_turns: expected an integer >= 1, got {self.max_turns!r}")
        if not isinstance(self.max_turns_terminates, bool):
            raise ValueError(f"max_turns_terminates: expected a bool, got {self.max_turns_terminates!r}")
        if not (isinstance(self.direct_demo_fraction, (int, float)) and not isinstance(self.direct_demo_fraction, bool)
                and 0.0 <= float(self.direct_demo_fraction) <= 1.0):
            raise ValueError(f"direct_demo_fraction: expected a number in [0, 1], got {self.direct_demo_fraction!r}")
        for name in ("format_bonus", "cost_per_call", "correct_potential"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
                raise ValueError(f"{name}: expected a finite number, got {value!r}")


# --- expressions -------------------------------------------------------------------------


def _answers_directly(expression: str, fraction: float) -> bool:
    """Whether the demonstration of ``expression`` skips the calculator (a hash, not the split's)."""
    if fraction <= 0.0:
        return False
    digest = hashlib.sha256(f"direct|{expression}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


def _split_of(expression: str, heldout_fraction: float) -> str:
    digest = hashlib.sha256(expression.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    return "heldout" if u < heldout_fraction else "train"


def _task_id(split: str, expression: str) -> str:
    return f"calc-{split}-{hashlib.sha256(expression.encode('utf-8')).hexdigest()[:12]}"


def _random_expression(rng: random.Random, cfg: CalculatorConfig) -> str:
    n_ops = rng.randint(cfg.min_ops, cfg.max_ops)
    parts = [str(rng.randint(cfg.min_operand, cfg.max_operand))]
    for _ in range(n_ops):
        parts.append(rng.choice(cfg.operators))
        parts.append(str(rng.randint(cfg.min_operand, cfg.max_operand)))
    return " ".join(parts)


@functools.lru_cache(maxsize=8192)
def _steps(expression: str) -> Tuple[Tuple[str, Any], ...]:
    """Single-operation calls that compute ``expression`` in evaluation order.

    Returns ``((call_expression, value), ...)`` (cached: every episode of a task resets
    with the same expression); later calls use earlier values, e.g.
    ``"12 + 7 * 31"`` gives ``(("7 * 31", 217), ("12 + 217", 229))``.
    """
    symbols = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}
    steps: List[Tuple[str, Any]] = []

    def walk(node: ast.AST):
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            right_text = format_number(right) if right >= 0 else f"({format_number(right)})"
            left_text = f"({format_number(left)})" if left < 0 and isinstance(node.op, ast.Pow) else format_number(left)
            call = f"{left_text} {symbols[type(node.op)]} {right_text}"
            value = safe_eval_arithmetic(call)
            steps.append((call, value))
            return value
        return safe_eval_arithmetic(ast.unparse(node))

    walk(ast.parse(expression, mode="eval").body)
    return tuple(steps)


def _intermediate_values(expression: str) -> List[Any]:
    return [value for _, value in _steps(expression)]


def _parse_answer(text: str) -> Optional[int]:
    cleaned = text.replace(",", "").replace(" ", "").strip()
    try:
        return int(cleaned)
    except ValueError:
        pass
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


def calculator_tool(ops_per_call: Optional[int] = None) -> Tool:
    """The calculator as a :class:`~trajgrad.envs.tools.Tool` (safe AST evaluation)."""

    def calc(expression: str) -> str:
        expression = expression.strip()
        if ops_per_call is not None:
            n = count_operations(expression)
            if n > ops_per_call:
                raise ValueError(
                    f"the calculator accepts at most {ops_per_call} operation{'s' if ops_per_call > 1 else ''} "
                    f"per call, got {n}"
                )
        return format_number(safe_eval_arithmetic(expression))

    limit = "" if ops_per_call is None else f" ({ops_per_call} operation(s) per call)"
    return Tool("calculator", calc, f"evaluates an arithmetic expression with + - * / // % ** and parentheses{limit}")


def _tool_error_text(error: str) -> str:
    # "ValueError: expr: division by zero" -> "division by zero"
    text = error.split(": ", 1)[1] if error.startswith(("ValueError: ", "ZeroDivisionError: ")) else error
    return text[len("expr: "):] if text.startswith("expr: ") else text


# --- prompts ------------------------------------------------------------------------------

_EXAMPLE_MULTI = ("17 + 25 * 2", "67")
_EXAMPLE_SINGLE = ("23 * 4", "92")


def _system_prompt(cfg: CalculatorConfig) -> str:
    per_call = (
        ""
        if cfg.ops_per_call is None
        else f" The calculator accepts only {cfg.ops_per_call} operation{'s' if cfg.ops_per_call > 1 else ''}"
        " per call, so compute step by step."
    )
    return (
        "You solve arithmetic problems with a calculator. To use it, write <calc>EXPRESSION</calc> "
        "and nothing else; the result comes back as <result>VALUE</result>." + per_call + " When you know the "
        "final value, write <answer>NUMBER</answer>."
    )


def _question(expression: str) -> str:
    return f"What is {expression}?"


# --- environment --------------------------------------------------------------------------


class CalculatorEnv:
    """One calculator episode at a time (see the module docstring for the rules)."""

    name = "calculator"

    def __init__(self, config: Optional[CalculatorConfig] = None, **overrides: Any) -> None:
        cfg = config or CalculatorConfig()
        self.config = replace(cfg, **overrides) if overrides else cfg
        self.max_turns = self.config.max_turns
        self.tools = ToolRegistry([calculator_tool(self.config.ops_per_call)])
        self._task: Optional[Task] = None
        self._done = True
        self._terminated = False

    # Environment protocol ---------------------------------------------------------------

    def reset(self, task: Task) -> List[Message]:
        if not isinstance(task, Task):
            raise ValueError(f"task: expected a Task, got {type(task).__name__}")
        expression = task.metadata.get("expression")
        if not isinstance(expression, str):
            raise ValueError("task: metadata['expression'] is missing; use CalculatorSource.tasks()")
        self._task = task
        self._turns = 0
        self._done = False
        self._terminated = False
        self._called_ok = False
        self._reached_intermediate = False
        self._targets = set(_intermediate_values(expression))
        self.tools.clear_log()
        system = _system_prompt(self.config) if self.config.system_prompt is None else self.config.system_prompt
        messages: List[Message] = [{"role": "system", "content": system}] if system else []
        if self.config.few_shot:
            expr, value = _EXAMPLE_SINGLE if self.config.ops_per_call == 1 else _EXAMPLE_MULTI
            messages += [
                {"role": "user", "content": _question(expr)},
                {"role": "assistant", "content": f"<calc>{expr}</calc>"},
                {"role": "user", "content": f"<result>{value}</result>"},
                {"role": "assistant", "content": f"<answer>{value}</answer>"},
            ]
        messages.append({"role": "user", "content": task.prompt})
        return messages

    def potential(self) -> float:
        r"""\Phi of the current state: ``correct_potential`` once a correct intermediate value
        was returned, else 0; 0 in a terminal state (a truncated state keeps its value)."""
        if self._task is None or self._terminated:
            return 0.0
        return float(self.config.correct_potential) if self._reached_intermediate else 0.0

    def step(self, action_text: str) -> StepResult:
        if self._task is None or self._done:
            raise RuntimeError("step() called on a finished episode; call reset(task) first")
        if not isinstance(action_text, str):
            raise ValueError(f"action_text: expected a string, got {type(action_text).__name__}")
        self._turns += 1
        info: Dict[str, Any] = {}
        reward = 0.0

        kind, content = _first_action(action_text)
        if kind == "answer":
            value = _parse_answer(content)
            correct = value is not None and value == self._task.answer
            if self.config.require_call and not self._called_ok:
                correct = False  # no successful calculator call yet
            self._done = self._terminated = True
            info.update(success=correct, answer=value, potential=0.0)
            return StepResult([], 1.0 if correct else 0.0, True, False, info)

        if kind == "calc":
            result = self.tools.call("calculator", content, allowed=self._allowed_tools())
            info["tool"] = "calculator"
            info["tool_error"] = result.error
            info["cost"] = float(self.config.cost_per_call)
            if result.error is None:
                if not self._called_ok:
                    self._called_ok = True
                    reward += float(self.config.format_bonus)
                if _parse_number(result.output) in self._targets:
                    self._reached_intermediate = True
                observation = f"<result>{result.output}</result>"
            else:
                observation = f"<result>error: {_tool_error_text(result.error)}</result>"
        else:
            info["tool_error"] = "no action"
            observation = (
                "<result>error: no action found; write <calc>EXPRESSION</calc> or <answer>NUMBER</answer></result>"
            )

        if self._turns >= self.max_turns:
            self._done = True
            self._terminated = bool(self.config.max_turns_terminates)
            info.update(success=False, potential=self.potential())
            return StepResult([], reward, self._terminated, not self._terminated, info)
        info["potential"] = self.potential()
        return StepResult([{"role": "user", "content": observation}], reward, False, False, info)

    # helpers ----------------------------------------------------------------------------

    def _allowed_tools(self) -> Sequence[str]:
        assert self._task is not None
        return self._task.metadata.get("allowed_tools", ("calculator",))

    @property
    def turns(self) -> int:
        return getattr(self, "_turns", 0)


def _first_action(text: str) -> Tuple[Optional[str], str]:
    """The first complete ``<calc>`` or ``<answer>`` tag: ``(kind, content)``."""
    found = []
    for kind in ("calc", "answer"):
        at = text.find(f"<{kind}>")
        content = extract_tag(text, kind)
        if at >= 0 and content is not None:
            found.append((at, kind, content))
    if not found:
        return None, ""
    _, kind, content = min(found)
    return kind, content


def _parse_number(text: str):
    try:
        return safe_eval_arithmetic(text)
    except ValueError:
        return None


# --- task source --------------------------------------------------------------------------


@register_task_source("calculator")
class CalculatorSource:
    """Generates calculator tasks; builds :class:`CalculatorEnv`; demonstrates solutions.

    Keyword arguments are the fields of :class:`CalculatorConfig`.
    """

    name = "calculator"

    def __init__(self, **kwargs: Any) -> None:
        self.config = CalculatorConfig(**kwargs)

    def tasks(self, split: str, n: int, seed: int) -> List[Task]:
        """``n`` distinct tasks of ``split``, deterministic in ``seed``."""
        if split not in _SPLITS:
            raise ValueError(f"split: expected one of {_SPLITS}, got {split!r}")
        if not (isinstance(n, int) and n >= 0):
            raise ValueError(f"n: expected a non-negative integer, got {n!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed: expected an integer, got {seed!r}")
        cfg = self.config
        rng = random.Random(f"calculator|{seed}|{split}")
        excluded = {_EXAMPLE_MULTI[0], _EXAMPLE_SINGLE[0]}
        seen = set()
        out: List[Task] = []
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 200 * n + 1000:
                raise ValueError(f"n: could not generate {n} distinct {split} tasks with this configuration")
            expression = _random_expression(rng, cfg)
            if expression in seen or expression in excluded or _split_of(expression, cfg.heldout_fraction) != split:
                continue
            seen.add(expression)
            answer = safe_eval_arithmetic(expression)
            out.append(
                Task(
                    id=_task_id(split, expression),
                    split=split,
                    prompt=_question(expression),
                    answer=answer,
                    metadata={"expression": expression, "n_ops": count_operations(expression)},
                )
            )
        return out

    def make_env(self, **kwargs: Any) -> CalculatorEnv:
        return CalculatorEnv(self.config, **kwargs)

    def demonstration(self, task: Task, *, ops_per_call: Optional[int] = None) -> List[Message]:
        """The ideal exchange: calculator call(s), result(s), then the answer.

        With ``ops_per_call`` None (the source's setting by default) one call evaluates
        the whole expression; with ``ops_per_call=1`` one call per operation, in
        evaluation order. For the fraction ``direct_demo_fraction`` of tasks the
        demonstration is the answer alone, without a call.
        """
        expression = task.metadata.get("expression") if isinstance(task, Task) else None
        if not isinstance(expression, str):
            raise ValueError("task: expected a calculator Task with metadata['expression']")
        if _answers_directly(expression, float(self.config.direct_demo_fraction)):
            return [{"role": "assistant", "content": f"<answer>{format_number(task.answer)}</answer>"}]
        per_call = self.config.ops_per_call if ops_per_call is None else ops_per_call
        if per_call is None or per_call >= count_operations(expression):
            calls = [(expression, safe_eval_arithmetic(expression))]
        elif per_call == 1:
            calls = _steps(expression)
        else:
            raise ValueError(f"ops_per_call: demonstrations support None or 1, got {per_call}")
        messages: List[Message] = []
        for call, value in calls:
            messages.append({"role": "assistant", "content": f"<calc>{call}</calc>"})
            messages.append({"role": "user", "content": f"<result>{format_number(value)}</result>"})
        messages.append({"role": "assistant", "content": f"<answer>{format_number(task.answer)}</answer>"})
        return messages
