"""Python functions as tools: OpenAI function-tool JSON schemas and checked calls.

A function with type hints and a docstring is the whole definition of a tool::

    def lookup(entity: str, attribute: str) -> str:
        \"\"\"Look up one attribute of an entity.

        Args:
          entity: the entity's name, e.g. "Mont Blanc".
          attribute: what to look up, e.g. "height_m".
        \"\"\"

:func:`function_schema` turns it into the schema chat templates render
(``{"type": "function", "function": {"name", "description", "parameters"}}``, the
``parameters`` a JSON schema object); :func:`function_tool` turns it into a
:class:`~trajgrad.envs.tools.Tool` whose argument is the JSON object of the call's
arguments, so the :class:`~trajgrad.envs.tools.ToolRegistry` guards (allowlist,
confirmation of irreversible tools, call log) apply to it like to every tool. Arguments
are checked against the schema before the function runs (:func:`check_arguments`); a
bad argument is a tool error the agent sees, never an exception of the caller.

Supported hints: ``str``, ``int``, ``float``, ``bool``, ``list[X]``, ``dict[str, X]``,
``Optional[X]``, ``Literal[...]``. A parameter without a hint, ``*args`` / ``**kwargs``,
an unsupported hint or a missing docstring raise ``ValueError`` naming the function and
the parameter.
"""
from __future__ import annotations

import inspect
import json
import math
import re
import typing
from typing import Any, Callable, Dict, List, Optional, Tuple

from .tools import Tool
from .tool_result import ToolResult

__all__ = ["function_schema", "function_tool", "check_arguments", "parse_docstring"]

_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Raises|Yields|Example|Examples|Note|Notes)\s*:\s*$")
_PARAM = re.compile(r"^\s*\*{0,2}([A-Za-z_][A-Za-z0-9_]*)\s*(\([^)]*\))?\s*:\s*(.*)$")


def parse_docstring(doc: Optional[str]) -> Tuple[str, Dict[str, str]]:
    """(description, {parameter: description}) of a Google-style docstring.

    The description is the text before the first section header; parameter lines of the
    ``Args:`` section are ``name: text`` or ``name (type): text``, continued on more
    deeply indented lines.
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    desc: List[str] = []
    params: Dict[str, str] = {}
    section = None
    current = None
    indent = None
    for line in lines:
        m = _SECTION.match(line)
        if m:
            section, current, indent = m.group(1), None, None
            continue
        if section is None:
            desc.append(line)
            continue
        if section not in ("Args", "Arguments", "Parameters") or not line.strip():
            continue
        lead = len(line) - len(line.lstrip())
        pm = _PARAM.match(line)
        if pm and (indent is None or lead <= indent):
            indent, current = lead, pm.group(1)
            params[current] = pm.group(3).strip()
        elif current is not None:
            params[current] = (params[current] + " " + line.strip()).strip()
    text = " ".join(" ".join(desc).split())
    return text, params


def _type_schema(hint: Any, where: str) -> Dict[str, Any]:
    if hint is str:
        return {"type": "string"}
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer"}
    if hint is float:
        return {"type": "number"}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        if not args or not kinds <= {str, int, float, bool} or len(kinds) != 1:
            raise ValueError(f"{where}: Literal values must all be strings or all numbers, got {args!r}")
        base = _type_schema(kinds.pop(), where)
        return {**base, "enum": list(args)}
    if origin in (list, List, tuple) or hint in (list, List):
        if origin is tuple:
            raise ValueError(f"{where}: tuple hints are not supported; use list[...]")
        item = args[0] if args else None
        return {"type": "array", **({"items": _type_schema(item, where)} if item is not None else {})}
    if origin in (dict, Dict) or hint in (dict, Dict):
        if args and args[0] is not str:
            raise ValueError(f"{where}: dict keys must be str (JSON object keys), got {args[0]!r}")
        return {"type": "object", **({"additionalProperties": _type_schema(args[1], where)} if args else {})}
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            inner = _type_schema(rest[0], where)
            return {**inner, "nullable": True}
        return {"anyOf": [_type_schema(a, where) for a in args]}
    if hint is type(None):
        return {"type": "null"}
    raise ValueError(f"{where}: unsupported type hint {hint!r} (use str, int, float, bool, list, dict, Optional, Literal)")


def function_schema(fn: Callable, *, name: Optional[str] = None, description: Optional[str] = None) -> Dict[str, Any]:
    """The OpenAI function-tool schema of ``fn`` (what ``tools=`` of a chat template takes).

    Args:
      fn: a function with a type hint on every parameter and a docstring (its first
        paragraph is the tool's description; ``Args:`` lines describe the parameters).
      name: the tool's name; default ``fn.__name__``.
      description: overrides the docstring's description.

    Returns:
      ``{"type": "function", "function": {"name", "description", "parameters"}}``;
      parameters without a default are ``required``.

    Raises:
      ValueError: naming ``fn`` and the parameter, when the schema cannot be built.
    """
    if not callable(fn):
        raise ValueError(f"fn: expected a callable, got {type(fn).__name__}")
    tool_name = name or getattr(fn, "__name__", None)
    if not isinstance(tool_name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}", tool_name):
        raise ValueError(f"name: a tool name must be an identifier of at most 64 characters, got {tool_name!r}")
    doc_text, doc_params = parse_docstring(inspect.getdoc(fn))
    text = description if description is not None else doc_text
    if not text:
        raise ValueError(f"fn: {tool_name} has no docstring; its first paragraph is the tool's description")
    try:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError) as exc:
        raise ValueError(f"fn: cannot read the signature of {tool_name} ({type(exc).__name__}: {exc})") from None
    props: Dict[str, Any] = {}
    required: List[str] = []
    for pname, p in sig.parameters.items():
        where = f"fn: {tool_name}, parameter {pname!r}"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"{where}: *args and **kwargs cannot be described by a schema")
        if p.kind is p.POSITIONAL_ONLY:
            raise ValueError(f"{where}: positional-only parameters cannot be passed by name")
        if pname not in hints:
            raise ValueError(f"{where}: has no type hint")
        prop = _type_schema(hints[pname], where)
        if doc_params.get(pname):
            prop["description"] = doc_params[pname]
        if p.default is p.empty:
            required.append(pname)
        else:
            try:
                json.dumps(p.default)
            except (TypeError, ValueError):
                raise ValueError(f"{where}: default {p.default!r} is not JSON") from None
            prop["default"] = p.default
        props[pname] = prop
    unknown = sorted(set(doc_params) - set(props))
    if unknown:
        raise ValueError(f"fn: {tool_name}'s docstring describes parameters it does not have: {', '.join(unknown)}")
    params = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": tool_name, "description": text, "parameters": params}}


def _check_value(schema: Dict[str, Any], value: Any, where: str) -> Optional[str]:
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        if any(_check_value(s, value, where) is None for s in schema["anyOf"]):
            return None
        return f"{where}: {value!r} matches none of the allowed types"
    kind = schema.get("type")
    ok = {
        "string": isinstance(value, str),
        "boolean": isinstance(value, bool),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool)
        and math.isfinite(float(value)),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
        "null": value is None,
    }.get(kind, True)
    if not ok:
        return f"{where}: expected {kind}, got {json.dumps(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where}: expected one of {json.dumps(schema['enum'])}, got {json.dumps(value)}"
    if kind == "array" and "items" in schema:
        for k, item in enumerate(value):
            bad = _check_value(schema["items"], item, f"{where}[{k}]")
            if bad:
                return bad
    if kind == "object" and "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
        for k, item in value.items():
            bad = _check_value(schema["additionalProperties"], item, f"{where}.{k}")
            if bad:
                return bad
    return None


def check_arguments(schema: Dict[str, Any], arguments: Any) -> Optional[str]:
    """None if ``arguments`` (a dict) fit the function schema, else the first problem (text).

    Checks: an object; every required parameter present; no unknown parameter; each value
    of its declared type (no bool for an integer, finite numbers), enum and item types.
    """
    fn = schema.get("function", schema)
    params = fn.get("parameters", {})
    name = fn.get("name", "tool")
    if not isinstance(arguments, dict):
        return f"arguments of {name} must be a JSON object, got {json.dumps(arguments)[:80]}"
    props = params.get("properties", {})
    missing = [p for p in params.get("required", []) if p not in arguments]
    if missing:
        return f"{name}: missing required argument(s) {', '.join(missing)}"
    extra = [k for k in arguments if k not in props]
    if extra:
        return f"{name}: unknown argument(s) {', '.join(map(str, extra))}; expected {', '.join(props) or 'none'}"
    for key, value in arguments.items():
        bad = _check_value(props[key], value, f"{name}.{key}")
        if bad:
            return bad
    return None


def function_tool(fn: Callable, *, name: Optional[str] = None, description: Optional[str] = None,
                  irreversible: bool = False) -> Tool:
    """A :class:`~trajgrad.envs.tools.Tool` calling ``fn`` with JSON object arguments.

    The tool's argument is the JSON text of the call's arguments (what
    :func:`trajgrad.envs.toolcalls.run_tool_calls` passes). Text that is not a JSON object,
    or arguments that do not fit :func:`function_schema`, give an error result and ``fn``
    is not called. ``fn``'s return value is the tool's text (a non-string is written as
    JSON); a :class:`~trajgrad.envs.tool_result.ToolResult` is passed through. The schema
    is the tool's ``schema`` field.
    """
    schema = function_schema(fn, name=name, description=description)
    spec = schema["function"]

    def call(argument: str):
        try:
            args = json.loads(argument) if argument.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolResult("", f"arguments of {spec['name']} are not valid JSON ({exc.msg})")
        bad = check_arguments(schema, args)
        if bad:
            return ToolResult("", bad)
        out = fn(**args)
        if isinstance(out, ToolResult) or isinstance(out, str):
            return out
        try:
            return json.dumps(out)
        except (TypeError, ValueError):
            return str(out)

    call.__name__ = spec["name"]
    return Tool(spec["name"], call, spec["description"], irreversible=irreversible, schema=schema)
