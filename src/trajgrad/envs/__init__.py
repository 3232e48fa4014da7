"""Environments, tools, the Python sandbox and the built-in tasks (§19, §21, §22).

The core layers never import this package. Task sources, by name
(:func:`get_task_source`): ``"calculator"`` (multi-step arithmetic with a calculator
tool) and ``"guess"`` (find a hidden integer from higher/lower replies).

* :mod:`.base` - the contract with the rollout collector: :class:`Task`,
  :class:`StepResult`, :class:`Environment`, :class:`TaskSource`, the registry.
* :mod:`.tools` - :class:`Tool`, :class:`ToolRegistry` (allowlist, confirmation of
  irreversible tools, call log), :class:`ToolResult`.
* :mod:`.sandbox` - :class:`SandboxedPython` and :func:`safe_eval_arithmetic`.
"""
from .base import (
    Environment,
    Message,
    StepResult,
    Task,
    TaskSource,
    available_task_sources,
    extract_tag,
    get_task_source,
    register_task_source,
)
from .calculator import CalculatorEnv, CalculatorSource
from .guess import GuessEnv, GuessSource
from .sandbox import SandboxedPython, safe_eval_arithmetic
from .tools import Tool, ToolCall, ToolRegistry, ToolResult, python_tool

__all__ = [
    "CalculatorEnv",
    "CalculatorSource",
    "Environment",
    "GuessEnv",
    "GuessSource",
    "Message",
    "SandboxedPython",
    "StepResult",
    "Task",
    "TaskSource",
    "Tool",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
    "available_task_sources",
    "extract_tag",
    "get_task_source",
    "python_tool",
    "register_task_source",
    "safe_eval_arithmetic",
]
