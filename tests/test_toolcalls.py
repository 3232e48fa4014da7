"""Tool calls parsed from replies (Hermes tags, bare JSON), run under the guards, rendered as tool messages."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.envs import (Task, Tool, ToolEnv, ToolRegistry, format_tool_call, function_tool, parse_tool_calls,
                           run_tool_calls, tool_messages)
from trajgrad.envs.toolcalls import has_tool_call


def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


def wipe(target: str) -> str:
    """Wipe a target."""
    return "wiped"


def test_hermes_calls_with_text_around():
    text = ('Let me compute. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n</tool_call> done')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None),
                                                               ("add", {"a": 3, "b": 4}, None)]


def test_bare_json_calls_fenced_or_not():
    assert parse_tool_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}')[0].arguments == {"a": 1, "b": 2}
    fenced = '```json\n[{"name": "add", "arguments": {"a": 1, "b": 1}}, {"name": "wipe", "parameters": {"target": "x"}}]\n```'
    assert [c.name for c in parse_tool_calls(fenced)] == ["add", "wipe"]
    assert parse_tool_calls(fenced)[1].arguments == {"target": "x"}
    # answers are not calls: prose, a number, JSON without a name, bare JSON switched off
    for text in ["42", "The answer is {x}.", '{"answer": 3}', "{not json at all", ""]:
        assert parse_tool_calls(text) == [] and not has_tool_call(text)
    assert parse_tool_calls('{"name": "add", "arguments": {}}', bare_json=False) == []


@pytest.mark.parametrize("text, want", [
    ("<tool_call>{bad json}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "needs a \"name\""),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "add", "arguments": {}, "extra": 1}</tool_call>', "unexpected 'extra'"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "not closed"),
    ("<tool_call>[]</tool_call>", "empty list"),
    ("<tool_call>3</tool_call>", "JSON object"),
])
def test_malformed_calls_are_errors_the_agent_sees(text, want):
    calls = parse_tool_calls(text)
    assert len(calls) == 1 and calls[0].error is not None and want in calls[0].error
    reg = ToolRegistry([function_tool(add)])
    (msg,) = tool_messages(run_tool_calls(reg, calls))
    assert msg["role"] == "tool" and msg["content"].startswith("error: ") and want in msg["content"]
    assert reg.calls == []  # nothing ran


def test_unknown_tool_bad_arguments_allowlist_and_confirmation():
    reg = ToolRegistry([function_tool(add), function_tool(wipe, irreversible=True),
                        Tool("echo", lambda s: s.upper(), "echoes")])
    text = "".join(format_tool_call(n, a) for n, a in [
        ("add", {"a": 2, "b": 3}), ("nope", {}), ("add", {"a": "2", "b": 3}), ("wipe", {"target": "db"}),
        ("echo", {"text": "hi"}), ("echo", {"x": 1})])
    calls = parse_tool_calls(text)
    msgs = tool_messages(run_tool_calls(reg, calls), calls, with_name=True)
    contents = [m["content"] for m in msgs]
    assert contents[0] == "5"
    assert contents[1].startswith("error: unknown tool 'nope'")
    assert "expected integer" in contents[2]
    assert "irreversible" in contents[3]
    assert contents[4] == "HI"  # a one-text-argument tool gets the value
    assert "one text argument" in contents[5]
    assert [m["name"] for m in msgs] == ["add", "nope", "add", "wipe", "echo", "echo"]
    # the allowlist and a confirming hook
    r = run_tool_calls(reg, calls[:1] + calls[3:4], allowed=["wipe"], confirm=lambda n, a: json.loads(a) == {"target": "db"})
    assert "not authorized" in r[0].error and r[1].output == "wiped"


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet="abcdefghij_", min_size=1, max_size=8),
       st.dictionaries(st.text(alphabet="xyz", min_size=1, max_size=3),
                       st.one_of(st.integers(), st.text(max_size=6), st.booleans(), st.none()), max_size=3),
       st.text(alphabet=" abc.\n", max_size=10), st.text(alphabet=" abc.\n", max_size=10))
def test_format_then_parse_round_trips(name, args, before, after):
    calls = parse_tool_calls(before + format_tool_call(name, args) + after)
    assert [(c.name, c.arguments, c.error) for c in calls] == [(name, args, None)]


def test_tool_env_episode_with_errors_then_answer():
    env = ToolEnv([add], lambda text, task: float(text.strip() == str(task.answer)), max_turns=4)
    task = Task("t0", "train", "What is 2 + 3?", 5)
    msgs = env.reset(task)
    assert msgs[0]["role"] == "system" and '"name": "add"' in msgs[0]["content"] and msgs[1]["content"] == task.prompt
    r = env.step('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
    assert r.messages[0]["role"] == "tool" and "missing required" in r.messages[0]["content"]
    assert not r.terminated and r.info["tool"] == "add" and r.info["tool_error"]
    r = env.step(format_tool_call("add", {"a": 2, "b": 3}))
    assert r.messages == [{"role": "tool", "content": "5"}] and r.info["tool_error"] is None
    r = env.step("5")
    assert r.terminated and r.reward == 1.0 and r.info["success"] is True
    # out of turns: a failure
    env.reset(task)
    for _ in range(3):
        env.step(format_tool_call("add", {"a": 1, "b": 1}))
    r = env.step(format_tool_call("add", {"a": 1, "b": 1}))
    assert r.truncated and r.reward == 0.0 and r.info["success"] is False and r.messages == []
    # the task's allowlist
    env.reset(Task("t1", "train", "q", 1, metadata={"allowed_tools": []}))
    assert "not authorized" in env.step(format_tool_call("add", {"a": 1, "b": 1})).messages[0]["content"]


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="^text:"):
        parse_tool_calls(None)
    with pytest.raises(ValueError, match="^registry:"):
        run_tool_calls({}, [])
    with pytest.raises(ValueError, match="^arguments:"):
        format_tool_call("a", [1])
    with pytest.raises(ValueError, match="^tools:"):
        ToolEnv([], lambda t, k: 0.0)
    with pytest.raises(ValueError, match="^listing:"):
        ToolEnv([add], lambda t, k: 0.0, tool_listing="xml")
