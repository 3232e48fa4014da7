"""Tool calls in model output, and their results as ``tool``-role messages.

Two formats are read, the ones instruction-tuned models are trained to write:

* Hermes / Qwen: ``<tool_call>{"name": "lookup", "arguments": {"entity": "x"}}</tool_call>``,
  any number of them in one reply, with free text around;
* bare JSON: the whole reply (optionally inside a ```` ```json ```` fence) is one call
  object ``{"name": ..., "arguments": {...}}`` or a list of them.

``arguments`` may also be given as a JSON-encoded string (the OpenAI wire form), and
``parameters`` is accepted for ``arguments``. A call that cannot be read (bad JSON, no
``name``, arguments not an object, an unclosed tag) is a :class:`ParsedCall` with an
``error``: :func:`run_tool_calls` turns it into an error result without running anything,
so the agent sees what was wrong. Every well-formed call goes through
:meth:`trajgrad.envs.tools.ToolRegistry.call`, so an unknown tool, a tool outside the
task's allowlist, an unconfirmed irreversible tool and bad arguments are tool errors too.

:func:`tool_messages` renders the results as ``{"role": "tool", "content": ...}``
messages (an error as ``error: <message>``) for the chat template.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable, List, NamedTuple, Optional, Sequence

from .tool_result import ToolResult
from .tools import ToolRegistry

__all__ = ["ParsedCall", "parse_tool_calls", "has_tool_call", "format_tool_call", "run_tool_calls",
           "tool_messages"]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_TAGGED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```$", re.DOTALL)


class ParsedCall(NamedTuple):
    """One tool call read from a reply.

    Attributes:
      name: the tool's name ("" when it could not be read).
      arguments: the call's arguments (a dict; ``{}`` when they could not be read).
      error: None for a well-formed call, else what is wrong with it.
      raw: the text the call was read from.
    """

    name: str
    arguments: dict
    error: Optional[str]
    raw: str


def _from_object(obj: Any, raw: str) -> ParsedCall:
    if not isinstance(obj, dict):
        return ParsedCall("", {}, f"a tool call must be a JSON object with \"name\" and \"arguments\", got "
                                  f"{type(obj).__name__}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall("", {}, "a tool call needs a \"name\" (a non-empty string)", raw)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ParsedCall(name, {}, f"arguments of {name} are not valid JSON ({exc.msg})", raw)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParsedCall(name, {}, f"arguments of {name} must be a JSON object, got {type(args).__name__}", raw)
    extra = sorted(set(obj) - {"name", "arguments", "parameters", "id", "type"})
    if extra:
        return ParsedCall(name, args, f"a tool call has only \"name\" and \"arguments\"; unexpected "
                                      f"{', '.join(map(repr, extra))}", raw)
    return ParsedCall(name, args, None, raw)


def _from_json_text(text: str) -> List[ParsedCall]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return [ParsedCall("", {}, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})", text)]
    if isinstance(obj, list):
        if not obj:
            return [ParsedCall("", {}, "an empty list of tool calls", text)]
        return [_from_object(o, text) for o in obj]
    return [_from_object(obj, text)]


def parse_tool_calls(text: str, *, bare_json: bool = True) -> List[ParsedCall]:
    """Every tool call in ``text``; ``[]`` when the reply calls no tool (a final answer).

    Args:
      text: one decoded assistant reply.
      bare_json: also read a reply that is exactly a JSON call (or list of calls), fenced
        or not. A reply that is JSON without a ``name`` key is not a call.

    Returns:
      Tagged calls in order; an opening ``<tool_call>`` without its closing tag is one
      call with an error. Malformed calls carry ``error`` (never raises).
    """
    if not isinstance(text, str):
        raise ValueError(f"text: expected a string, got {type(text).__name__}")
    calls: List[ParsedCall] = []
    for m in _TAGGED.finditer(text):
        calls.extend(_from_json_text(m.group(1).strip()))
    rest = _TAGGED.sub("", text)
    if _OPEN in rest:
        tail = rest[rest.index(_OPEN):]
        calls.append(ParsedCall("", {}, "<tool_call> is not closed with </tool_call>", tail))
    if calls or not bare_json:
        return calls
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    if not body or body[0] not in "[{":
        return []
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return []  # prose that happens to start with a brace: not a call
    objs = obj if isinstance(obj, list) else [obj]
    if not objs or not all(isinstance(o, dict) and "name" in o for o in objs):
        return []
    return [_from_object(o, body) for o in objs]


def has_tool_call(text: str) -> bool:
    """Whether ``text`` contains a tool call (well-formed or not)."""
    return bool(parse_tool_calls(text))


def format_tool_call(name: str, arguments: dict) -> str:
    """The Hermes form of one call: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    if not isinstance(arguments, dict):
        raise ValueError(f"arguments: expected a dict, got {type(arguments).__name__}")
    return f"{_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{_CLOSE}"


def run_tool_calls(
    registry: ToolRegistry,
    calls: Sequence[ParsedCall],
    *,
    allowed: Optional[Iterable[str]] = None,
    confirm: Optional[Callable[[str, str], bool]] = None,
) -> List[ToolResult]:
    """Run each call under the registry's guards; one :class:`ToolResult` per call.

    A malformed call gives its parse error and runs nothing; a well-formed one is
    ``registry.call(name, json.dumps(arguments), allowed=allowed, confirm=confirm)``
    (allowlist, confirmation of irreversible tools and the call log apply). A tool built
    with :func:`trajgrad.envs.schema.function_tool` checks the arguments against its
    schema; a plain :class:`~trajgrad.envs.tools.Tool` (one text argument) receives the
    single argument's value when the call has exactly one string argument.
    """
    if not isinstance(registry, ToolRegistry):
        raise ValueError(f"registry: expected a ToolRegistry, got {type(registry).__name__}")
    allowed = None if allowed is None else ((allowed,) if isinstance(allowed, str) else tuple(allowed))
    out: List[ToolResult] = []
    for call in calls:
        if call.error is not None:
            out.append(ToolResult("", call.error))
            continue
        tool = registry[call.name] if call.name in registry else None
        if tool is not None and tool.schema is None:
            values = list(call.arguments.values())
            if len(values) != 1 or not isinstance(values[0], str):
                out.append(ToolResult("", f"{call.name} takes one text argument, got {json.dumps(call.arguments)}"))
                continue
            argument = values[0]
        else:
            argument = json.dumps(call.arguments)
        out.append(registry.call(call.name, argument, allowed=allowed, confirm=confirm))
    return out


def tool_messages(results: Sequence[ToolResult], calls: Optional[Sequence[ParsedCall]] = None, *,
                  with_name: bool = False) -> List[dict]:
    """``tool``-role messages for ``results``: the output, or ``error: <message>``.

    With ``with_name=True`` (and ``calls``) each message also carries the tool's ``name``
    (templates that show it, e.g. Llama 3's ``ipython`` turns, read it).
    """
    if calls is not None and len(calls) != len(results):
        raise ValueError(f"calls: {len(calls)} calls for {len(results)} results")
    msgs = []
    for k, r in enumerate(results):
        if not isinstance(r, ToolResult):
            raise ValueError(f"results: expected ToolResult items, got {type(r).__name__}")
        msg = {"role": "tool", "content": r.as_text()}
        if with_name and calls is not None and calls[k].name:
            msg["name"] = calls[k].name
        msgs.append(msg)
    return msgs
