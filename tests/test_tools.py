"""Tests for trajgrad.envs.tools: authorization, confirmation, call log (§22)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.envs.tools import Tool, ToolCall, ToolRegistry, ToolResult, python_tool


class Counter:
    """A tool function that records the arguments it was run with."""

    def __init__(self, reply="done"):
        self.runs = []
        self.reply = reply

    def __call__(self, argument):
        self.runs.append(argument)
        return self.reply


def make_registry():
    echo, delete = Counter("echoed"), Counter("deleted")
    reg = ToolRegistry(
        [
            Tool("echo", echo, "repeats its argument"),
            Tool("delete_file", delete, "deletes a file", irreversible=True),
        ]
    )
    return reg, echo, delete


def test_call_runs_an_allowed_tool():
    reg, echo, _ = make_registry()
    result = reg.call("echo", "hi", allowed={"echo"})
    assert result == ToolResult("echoed", None)
    assert result.ok and result.as_text() == "echoed"
    assert echo.runs == ["hi"]


def test_a_single_string_allowlist_is_one_name():
    reg, echo, _ = make_registry()
    assert "not authorized" in reg.call("echo", "x", allowed="echoes").error  # not a set of letters
    assert reg.call("echo", "x", allowed="echo").ok
    assert echo.runs == ["x"]


def test_allowed_none_means_every_registered_tool():
    reg, echo, _ = make_registry()
    assert reg.call("echo", "x").ok
    assert echo.runs == ["x"]


def test_tool_outside_the_allowlist_is_refused_and_never_runs():
    reg, echo, delete = make_registry()
    result = reg.call("echo", "hi", allowed={"calculator"})
    assert not result.ok and "not authorized" in result.error
    assert result.as_text().startswith("error: ")
    # An empty allowlist refuses everything, the irreversible tool included (even confirmed).
    result = reg.call("delete_file", "/data", allowed=set(), confirm=lambda n, a: True)
    assert "not authorized" in result.error
    assert echo.runs == [] and delete.runs == []


def test_unknown_tool_is_an_error_result():
    reg, _, _ = make_registry()
    result = reg.call("shell", "rm -rf /")
    assert "unknown tool 'shell'" in result.error
    assert "echo" in result.error  # the agent is told what exists


def test_irreversible_tool_is_refused_without_a_confirmation_hook():
    reg, _, delete = make_registry()
    result = reg.call("delete_file", "/data", allowed={"delete_file"})
    assert "irreversible" in result.error and "refused" in result.error
    assert delete.runs == []


def test_irreversible_tool_runs_only_when_confirmed():
    reg, _, delete = make_registry()
    seen = []

    def deny(name, argument):
        seen.append((name, argument))
        return False

    assert "not confirmed" in reg.call("delete_file", "/a", confirm=deny).error
    assert delete.runs == []
    assert seen == [("delete_file", "/a")]  # the hook sees the tool and its argument

    # Only an explicit True confirms; a truthy value such as "yes" or 1 does not.
    assert not reg.call("delete_file", "/b", confirm=lambda n, a: "yes").ok
    assert not reg.call("delete_file", "/b", confirm=lambda n, a: 1).ok
    assert delete.runs == []

    assert reg.call("delete_file", "/c", confirm=lambda n, a: True) == ToolResult("deleted", None)
    assert delete.runs == ["/c"]


def test_a_failing_confirmation_hook_refuses():
    reg, _, delete = make_registry()

    def broken(name, argument):
        raise RuntimeError("ui closed")

    result = reg.call("delete_file", "/a", confirm=broken)
    assert "confirmation" in result.error and "ui closed" in result.error
    assert delete.runs == []


def test_reversible_tools_ignore_the_hook():
    reg, echo, _ = make_registry()
    assert reg.call("echo", "a", confirm=lambda n, a: False).ok
    assert echo.runs == ["a"]


def test_tool_exceptions_become_error_results():
    def boom(argument):
        raise KeyError("missing")

    reg = ToolRegistry([Tool("boom", boom, "fails")])
    result = reg.call("boom", "x")
    assert result == ToolResult("", "KeyError: 'missing'")


def test_tool_may_return_a_tool_result_or_none():
    reg = ToolRegistry(
        [
            Tool("partial", lambda a: ToolResult("half", "stopped early"), "returns a result"),
            Tool("silent", lambda a: None, "returns nothing"),
            Tool("number", lambda a: 42, "returns a number"),
        ]
    )
    assert reg.call("partial", "") == ToolResult("half", "stopped early")
    assert reg.call("silent", "") == ToolResult("", None)
    assert reg.call("number", "") == ToolResult("42", None)


def test_non_text_argument_is_an_error_result():
    reg, echo, _ = make_registry()
    result = reg.call("echo", 5)
    assert "must be text" in result.error
    assert echo.runs == []


def test_every_call_is_logged_in_order():
    reg, _, _ = make_registry()
    reg.call("echo", "1", allowed={"echo"})
    reg.call("echo", "2", allowed=set())
    reg.call("delete_file", "3")
    reg.call("nope", "4")
    assert [c.name for c in reg.calls] == ["echo", "echo", "delete_file", "nope"]
    assert [c.argument for c in reg.calls] == ["1", "2", "3", "4"]
    assert [c.ok for c in reg.calls] == [True, False, False, False]
    assert reg.calls[0].error is None and "not authorized" in reg.calls[1].error
    assert all(isinstance(c, ToolCall) and c.duration_s >= 0.0 for c in reg.calls)
    reg.clear_log()
    assert reg.calls == []


def test_describe_lists_allowed_tools():
    reg, _, _ = make_registry()
    text = reg.describe()
    assert "echo: repeats its argument" in text
    assert "delete_file: deletes a file (irreversible: needs confirmation)" in text
    assert reg.describe({"echo"}) == "echo: repeats its argument"
    assert reg.names == ["delete_file", "echo"]
    assert "echo" in reg and "shell" not in reg


def test_bad_tool_definitions_raise_value_error():
    with pytest.raises(ValueError, match="name"):
        Tool("", lambda a: a, "empty name")
    with pytest.raises(ValueError, match="fn"):
        Tool("x", "not callable", "bad fn")
    with pytest.raises(ValueError, match="description"):
        Tool("x", lambda a: a, None)
    reg = ToolRegistry([Tool("x", lambda a: a, "first")])
    with pytest.raises(ValueError, match="tool"):
        reg.register(Tool("x", lambda a: a, "second"))
    with pytest.raises(ValueError, match="tool"):
        reg.register("x")


@settings(max_examples=40, deadline=None)
@given(
    irreversible=st.lists(st.booleans(), min_size=1, max_size=4),
    allowed=st.one_of(st.none(), st.sets(st.integers(0, 5), max_size=6)),
    requested=st.integers(0, 5),
    hook=st.sampled_from(["none", "yes", "no"]),
)
def test_a_tool_runs_exactly_when_registered_allowed_and_confirmed(irreversible, allowed, requested, hook):
    fns = [Counter() for _ in irreversible]
    reg = ToolRegistry(
        Tool(f"t{i}", fn, "a tool", irreversible=irr) for i, (fn, irr) in enumerate(zip(fns, irreversible))
    )
    confirm = {"none": None, "yes": lambda n, a: True, "no": lambda n, a: False}[hook]
    allowed_names = None if allowed is None else {f"t{i}" for i in allowed}
    result = reg.call(f"t{requested}", "arg", allowed=allowed_names, confirm=confirm)
    registered = requested < len(fns)
    authorized = allowed is None or requested in allowed
    confirmed = registered and (not irreversible[requested] or hook == "yes")
    should_run = registered and authorized and confirmed
    assert result.ok == should_run
    assert sum(len(fn.runs) for fn in fns) == int(should_run)
    assert len(reg.calls) == 1 and reg.calls[0].ok == should_run


def test_python_tool_goes_through_the_sandbox():
    reg = ToolRegistry([python_tool()])
    assert reg.call("python", "sum(range(5))", allowed={"python"}) == ToolResult("10", None)
    result = reg.call("python", "import os", allowed={"python"})
    assert "import of 'os' is not allowed" in result.error


def _envs_import_graph():
    """Module -> set of sibling modules of trajgrad.envs it imports (relative or absolute)."""
    import ast
    from pathlib import Path

    import trajgrad.envs as envs

    root = Path(envs.__file__).parent
    names = {p.stem for p in root.glob("*.py")}
    graph = {}
    for path in root.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level == 1:
                    target = module.split(".")[0] if module else None
                    deps |= {target} if target else {a.name for a in node.names}
                elif module.startswith("trajgrad.envs."):
                    deps.add(module.split(".")[2])
        graph[path.stem] = {d for d in deps if d in names and d != path.stem}
    return graph


def test_envs_modules_import_no_circle():
    graph = _envs_import_graph()
    assert "tools" not in graph["sandbox"] and "sandbox" in graph["tools"]
    state = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", f"import circle: {' -> '.join(trail + [node])}"
        state[node] = "open"
        for dep in sorted(graph[node]):
            visit(dep, trail + [node])
        state[node] = "done"

    for module in sorted(graph):
        if module != "__init__":
            visit(module, [])


def test_tool_result_is_one_type():
    from trajgrad.envs import tool_result, tools

    assert tools.ToolResult is tool_result.ToolResult
