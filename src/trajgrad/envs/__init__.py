"""Environments, tools, the Python sandbox and the built-in tasks (§19, §21, §22).

The core layers never import this package. Task sources, by name
(:func:`get_task_source`): ``"calculator"`` (multi-step arithmetic with a calculator
tool) and ``"guess"`` (find a hidden integer from higher/lower replies).

* :mod:`.base` - the contract with the rollout collector: :class:`Task`,
  :class:`StepResult`, :class:`Environment`, :class:`TaskSource`, the registry.
* :mod:`.tools` - :class:`Tool`, :class:`ToolRegistry` (allowlist, confirmation of
  irreversible tools, call log), :class:`ToolResult`.
* :mod:`.sandbox` - :class:`SandboxedPython` and :func:`safe_eval_arithmetic`.
* :mod:`.schema` - typed Python functions as OpenAI function-tool schemas and tools.
* :mod:`.toolcalls` - Hermes ``<tool_call>`` / bare-JSON calls parsed from replies, run
  under the registry's guards, results as ``tool``-role messages.
* :mod:`.toolenv` - :class:`ToolEnv`, a multi-turn environment over typed tools.
* :mod:`.mcp` - tools of MCP servers (stdio or streamable HTTP) for :class:`ToolEnv`.
* :mod:`.dataset` - task source ``"dataset"``: prompts from files, reward functions by import path.
* :mod:`.adapters` - gymnasium, ``verifiers`` and OpenEnv environments as task sources.

A ``task.name`` of the form ``"package.module:factory"`` is imported (:func:`resolve_import`).
"""
from .base import (
    Environment,
    Message,
    StepResult,
    Task,
    TaskError,
    TaskSource,
    available_task_sources,
    extract_tag,
    get_task_source,
    register_task_source,
    resolve_import,
)
from .calculator import CalculatorEnv, CalculatorSource
from .guess import GuessEnv, GuessSource
from .sandbox import SandboxedPython, safe_eval_arithmetic
from .schema import check_arguments, function_schema, function_tool
from .toolcalls import ParsedCall, format_tool_call, parse_tool_calls, run_tool_calls, tool_messages
from .toolenv import ToolEnv
from .tools import Tool, ToolCall, ToolRegistry, ToolResult, python_tool

__all__ = [
    "CalculatorEnv",
    "CalculatorSource",
    "Environment",
    "GuessEnv",
    "GuessSource",
    "ParsedCall",
    "ToolEnv",
    "check_arguments",
    "format_tool_call",
    "function_schema",
    "function_tool",
    "parse_tool_calls",
    "resolve_import",
    "run_tool_calls",
    "tool_messages",
    "Message",
    "SandboxedPython",
    "StepResult",
    "Task",
    "TaskError",
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
