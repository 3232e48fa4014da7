"""A multi-turn environment over typed Python tools (the base of user tool environments).

Each assistant turn either calls tools (Hermes ``<tool_call>`` tags or a bare JSON call,
:mod:`trajgrad.envs.toolcalls`) or answers. Calls run through one
:class:`~trajgrad.envs.tools.ToolRegistry` (the task's allowlist
``task.metadata["allowed_tools"]``, the confirmation hook of irreversible tools, the call
log); their results come back as ``tool``-role messages, errors included (a malformed
call, an unknown tool, bad arguments). A turn without a call is the final answer: the
episode terminates with ``reward = score(answer, task)`` and ``info["success"] = reward
>= success_threshold``. Running out of ``max_turns`` ends the episode with reward 0
(truncated, or terminated with ``max_turns_terminates``).

The system prompt lists the tools' JSON schemas in the Hermes layout
(``<tools>...</tools>``); :attr:`ToolEnv.tool_schemas` holds them for a chat template's
``tools=``.

Tools of MCP servers (``mcp=[...]``, :mod:`trajgrad.envs.mcp`) join the same registry: each
episode (``reset``) gets its own server connection unless the server is ``shared``; the
episode's end (a final answer, the turn limit, or :meth:`ToolEnv.close`) stops it. Every
step of such an environment records ``info["mcp_calls"]`` and ``info["mcp_errors"]``
(``{reason: count}``).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Iterable, List, Optional, Sequence

from .base import Message, StepResult, Task
from .mcp import MCPSession, MCPTools
from .schema import function_tool
from .toolcalls import parse_tool_calls, run_tool_calls, tool_messages
from .tools import Tool, ToolRegistry

__all__ = ["ToolEnv", "tools_system_prompt"]


def _brief(schema: dict) -> str:
    fn = schema["function"]
    params = ", ".join(fn["parameters"]["properties"])
    return f"{fn['name']}({params}): {fn['description']}"


def tools_system_prompt(schemas: Sequence[dict], preamble: str = "", *, listing: str = "json") -> str:
    """A system prompt listing ``schemas`` and the call format: ``listing="json"`` writes each
    schema as JSON inside ``<tools></tools>`` (Hermes layout), ``"brief"`` one line per tool
    (``name(parameters): description``, for small models with short contexts)."""
    if listing not in ("json", "brief"):
        raise ValueError(f"listing: expected 'json' or 'brief', got {listing!r}")
    lines = [preamble.strip()] if preamble.strip() else []
    if listing == "json":
        lines.append("You may call the following tools. Tool signatures are inside <tools></tools>:")
        lines.append("<tools>")
        lines.extend(json.dumps(s) for s in schemas)
        lines.append("</tools>")
    else:
        lines.append("Tools:")
        lines.extend(_brief(s) for s in schemas)
    lines.append('To call a tool, write <tool_call>{"name": <tool name>, "arguments": <arguments object>}'
                 "</tool_call>. When you know the answer, reply with the answer only.")
    return "\n".join(lines)


class ToolEnv:
    """One episode over ``tools`` (functions with type hints and docstrings, or :class:`Tool`).

    Args:
      tools: typed functions (wrapped with :func:`~trajgrad.envs.schema.function_tool`)
        or ready :class:`Tool` objects.
      score: ``score(answer_text, task) -> float``, the final answer's reward.
      max_turns: assistant turns before the episode is cut.
      system_prompt: text before the tool list; ``None`` gives no system message at all
        (the tools are then listed in front of the first user message).
      success_threshold: reward at or above which the episode counts as a success.
      confirm: confirmation hook of irreversible tools (``None`` refuses them).
      max_turns_terminates: running out of turns terminates (a failure) instead of truncating.
      tool_listing: ``"json"`` (schemas in the system prompt) or ``"brief"`` (one line each).
      name: the environment's name.
      mcp: MCP servers whose tools join ``tools``: configs (``{"command": ..., "args": [...],
        "env": {...}}`` or ``{"url": ...}``, see :mod:`trajgrad.envs.mcp`) or
        :class:`~trajgrad.envs.mcp.MCPTools`; a server that cannot start raises ``ValueError``
        naming ``mcp.<k>``.
    """

    def __init__(self, tools: Iterable[Any], score: Callable[[str, Task], float], *, max_turns: int = 4,
                 system_prompt: Optional[str] = "", success_threshold: float = 1.0,
                 confirm: Optional[Callable[[str, str], bool]] = None, max_turns_terminates: bool = False,
                 tool_listing: str = "json", name: str = "tools", mcp: Optional[Sequence[Any]] = None) -> None:
        built: List[Tool] = [t if isinstance(t, Tool) else function_tool(t) for t in tools]
        if mcp is not None and (isinstance(mcp, (str, dict)) or not isinstance(mcp, (list, tuple))):
            raise ValueError(f"mcp: expected a list of MCP server configs, got {type(mcp).__name__}")
        if not built and not mcp:
            raise ValueError("tools: expected at least one tool (or an MCP server in mcp)")
        if not callable(score):
            raise ValueError(f"score: expected a callable, got {type(score).__name__}")
        if not (isinstance(max_turns, int) and not isinstance(max_turns, bool) and max_turns >= 1):
            raise ValueError(f"max_turns: expected an integer >= 1, got {max_turns!r}")
        self.registry = ToolRegistry(built)
        self._mcp = [MCPSession(m if isinstance(m, MCPTools) else MCPTools(m, key=f"mcp.{k}"))
                     for k, m in enumerate(mcp or [])]
        for session in self._mcp:
            for tool in session.tools():
                if tool.name in self.registry:
                    raise ValueError(f"{session.server.config.where}: the server's tool {tool.name!r} has the name "
                                     "of another tool")
                self.registry.register(tool)
        self.score = score
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        self.success_threshold = float(success_threshold)
        self.confirm = confirm
        self.max_turns_terminates = bool(max_turns_terminates)
        tools_system_prompt([], listing=tool_listing)  # validates the listing
        self.tool_listing = tool_listing
        self.name = name
        self._task: Optional[Task] = None
        self._turns = 0

    @property
    def tool_schemas(self) -> List[dict]:
        """Schemas of the tools the current task allows (all before :meth:`reset`)."""
        return self.registry.schemas(self._allowed())

    def _allowed(self) -> Optional[Sequence[str]]:
        return None if self._task is None else self._task.metadata.get("allowed_tools")

    def reset(self, task: Task) -> List[Message]:
        self._task, self._turns = task, 0
        self.registry.clear_log()
        for session in self._mcp:
            session.begin()
        listing = tools_system_prompt(self.tool_schemas, self.system_prompt or "", listing=self.tool_listing)
        if self.system_prompt is None:
            return [{"role": "user", "content": f"{listing}\n\n{task.prompt}"}]
        return [{"role": "system", "content": listing}, {"role": "user", "content": task.prompt}]

    def potential(self) -> float:
        return 0.0

    def close(self) -> None:
        """End the episode's MCP servers (shared ones keep running); safe to call twice."""
        for session in self._mcp:
            session.end()

    def _finish(self, result: StepResult) -> StepResult:
        if self._mcp:
            calls, errors = 0, {}
            for session in self._mcp:
                n, errs = session.take_counts()
                calls += n
                for reason, count in errs.items():
                    errors[reason] = errors.get(reason, 0) + count
            result.info.update(mcp_calls=calls, mcp_errors=errors)
            if result.terminated or result.truncated:
                self.close()
        return result

    def step(self, action_text: str) -> StepResult:
        if self._task is None:
            raise ValueError("step: call reset(task) first")
        self._turns += 1
        calls = parse_tool_calls(action_text)
        if not calls:
            reward = float(self.score(action_text, self._task))
            return self._finish(StepResult([], reward, True, False, {"success": reward >= self.success_threshold}))
        results = run_tool_calls(self.registry, calls, allowed=self._allowed(), confirm=self.confirm)
        errors = [r.error for r in results if r.error is not None]
        info = {"tool": ",".join(c.name or "?" for c in calls), "tool_error": "; ".join(errors) if errors else None}
        if self._turns >= self.max_turns:
            info["success"] = False
            return self._finish(StepResult([], 0.0, self.max_turns_terminates, not self.max_turns_terminates, info))
        return self._finish(StepResult(tool_messages(results, calls), 0.0, False, False, info))
