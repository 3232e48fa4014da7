"""Tools an agent can call, with authorization and confirmation (§22).

§22 ends: "Tool authorization, sandbox, and irreversible-action confirmation remain hard
external constraints." A Lagrangian cost only controls an *expectation*; the three
guards here hold on every single call:

* **Authorization.** :meth:`ToolRegistry.call` takes the task's allowlist. A tool that
  is not on it is never run; the call returns an error :class:`ToolResult` that the
  agent sees as its observation.
* **Confirmation.** A tool declared ``irreversible=True`` runs only when the
  confirmation hook ``confirm(name, argument)`` returns ``True``. Without a hook it is
  refused. A hook that raises counts as a refusal.
* **Sandbox.** Code execution goes through :class:`trajgrad.envs.sandbox.SandboxedPython`
  (see :func:`python_tool`).

Every call, refused or not, is recorded in :attr:`ToolRegistry.calls` as a
:class:`ToolCall` (name, argument, ok, error, duration).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Union

from .sandbox import SandboxedPython
from .tool_result import ToolResult

__all__ = ["ToolResult", "Tool", "ToolCall", "ToolRegistry", "python_tool"]


ToolFn = Callable[[str], Union[str, ToolResult]]


@dataclass(frozen=True)
class Tool:
    """A named function from one string argument to text.

    Attributes:
      name: the name the agent uses.
      fn: ``fn(argument) -> str | ToolResult``; an exception it raises becomes an error
        result (``"TypeName: message"``), never a crash of the caller.
      description: one line shown to the agent.
      irreversible: if True the call needs a confirmation hook that returns True.
      schema: the OpenAI function-tool schema of a tool made from a typed Python function
        (:func:`trajgrad.envs.schema.function_tool`; its argument is then JSON), else None.
    """

    name: str
    fn: ToolFn
    description: str
    irreversible: bool = False
    schema: Optional[dict] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty string, got {self.name!r}")
        if not callable(self.fn):
            raise ValueError(f"fn: expected a callable, got {type(self.fn).__name__}")
        if not isinstance(self.description, str):
            raise ValueError(f"description: expected a string, got {type(self.description).__name__}")


class ToolCall(NamedTuple):
    """One entry of the call log."""

    name: str
    argument: str
    ok: bool
    error: Optional[str]
    duration_s: float


class ToolRegistry:
    """Tools by name, with a per-call allowlist, confirmation, and a call log.

    Example::

        reg = ToolRegistry([Tool("calculator", calc, "evaluates arithmetic")])
        reg.call("calculator", "2 + 3", allowed={"calculator"})   # ToolResult("5", None)
        reg.call("shell", "rm -rf /", allowed={"calculator"})      # error, never runs
    """

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: Dict[str, Tool] = {}
        self.calls: List[ToolCall] = []
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> Tool:
        """Add ``tool``; a second tool with the same name raises ``ValueError``."""
        if not isinstance(tool, Tool):
            raise ValueError(f"tool: expected a Tool, got {type(tool).__name__}")
        if tool.name in self._tools:
            raise ValueError(f"tool: a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    @property
    def names(self) -> List[str]:
        return sorted(self._tools)

    def describe(self, allowed: Optional[Iterable[str]] = None) -> str:
        """One line per (allowed) tool, ``"name: description"``, for a system prompt."""
        keep = None if allowed is None else set(allowed)
        return "\n".join(
            f"{name}: {self._tools[name].description}"
            + (" (irreversible: needs confirmation)" if self._tools[name].irreversible else "")
            for name in self.names
            if keep is None or name in keep
        )

    def schemas(self, allowed: Optional[Iterable[str]] = None) -> List[dict]:
        """The function-tool schemas of the (allowed) tools that have one, in name order
        (what a chat template's ``tools=`` takes)."""
        keep = None if allowed is None else set(allowed)
        return [self._tools[n].schema for n in self.names
                if self._tools[n].schema is not None and (keep is None or n in keep)]

    def clear_log(self) -> None:
        self.calls.clear()

    def call(
        self,
        name: str,
        argument: str,
        *,
        allowed: Optional[Iterable[str]] = None,
        confirm: Optional[Callable[[str, str], bool]] = None,
    ) -> ToolResult:
        """Run tool ``name`` on ``argument`` under the guards; never raises for the agent.

        Args:
          name: the tool the agent asked for.
          argument: its argument (text).
          allowed: the task's allowlist (names; a single string is one name); ``None``
            allows every registered tool. A tool not on the list returns an error result
            and is not run.
          confirm: ``confirm(name, argument) -> bool`` for irreversible tools. ``None``
            refuses every irreversible call; a hook that raises refuses too.

        Returns:
          The :class:`ToolResult`. The call is appended to :attr:`calls`.
        """
        start = time.perf_counter()
        result = self._guarded_call(name, argument, allowed, confirm)
        self.calls.append(
            ToolCall(str(name), str(argument), result.error is None, result.error, time.perf_counter() - start)
        )
        return result

    def _guarded_call(self, name, argument, allowed, confirm) -> ToolResult:
        if not isinstance(argument, str):
            return ToolResult("", f"tool argument must be text, got {type(argument).__name__}")
        tool = self._tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return ToolResult("", f"unknown tool {name!r}; available: {', '.join(self.names) or 'none'}")
        if isinstance(allowed, str):
            allowed = (allowed,)
        if allowed is not None and name not in set(allowed):
            return ToolResult("", f"tool {name!r} is not authorized for this task")
        if tool.irreversible:
            if confirm is None:
                return ToolResult("", f"tool {name!r} is irreversible and no confirmation is available; refused")
            try:
                approved = confirm(name, argument) is True
            except Exception as exc:  # a failing hook is a refusal
                return ToolResult("", f"confirmation of {name!r} failed ({type(exc).__name__}: {exc}); refused")
            if not approved:
                return ToolResult("", f"tool {name!r} was not confirmed; refused")
        try:
            out = tool.fn(argument)
        except Exception as exc:
            return ToolResult("", f"{type(exc).__name__}: {exc}")
        if isinstance(out, ToolResult):
            return out
        return ToolResult("" if out is None else str(out), None)


def python_tool(sandbox=None, name: str = "python") -> Tool:
    """A :class:`Tool` that runs code in a :class:`~trajgrad.envs.sandbox.SandboxedPython`."""
    if sandbox is None:
        sandbox = SandboxedPython()
    return Tool(name, sandbox.run, "runs Python code in a sandbox and returns its output and last value")
