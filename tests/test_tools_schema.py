"""Typed Python functions as OpenAI function-tool schemas, and the tools made from them."""
import json
from typing import Dict, List, Literal, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.envs import ToolRegistry, check_arguments, function_schema, function_tool


def lookup(entity: str, attribute: Literal["height_m", "country"], limit: Optional[int] = None) -> str:
    """Look up one attribute of an entity.

    Args:
      entity: the entity's name, e.g. "Mont Blanc".
      attribute: which attribute;
        continued on a second line.
      limit: at most this many characters.
    """
    out = f"{entity}.{attribute}"
    return out[:limit] if limit else out


def mix(xs: List[float], tags: Dict[str, int], flag: bool = False) -> dict:
    """Sum the numbers."""
    return {"sum": sum(xs), "n": len(tags), "flag": flag}


def test_schema_of_a_typed_function_is_the_openai_function_tool_form():
    s = function_schema(lookup)
    assert s == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up one attribute of an entity.",
            "parameters": {
                "type": "object",
                "properties": {
                    "entity": {"type": "string", "description": 'the entity\'s name, e.g. "Mont Blanc".'},
                    "attribute": {"type": "string", "enum": ["height_m", "country"],
                                  "description": "which attribute; continued on a second line."},
                    "limit": {"type": "integer", "nullable": True, "default": None,
                              "description": "at most this many characters."},
                },
                "required": ["entity", "attribute"],
                "additionalProperties": False,
            },
        },
    }
    json.dumps(s)  # plain JSON


def test_containers_and_defaults():
    p = function_schema(mix)["function"]["parameters"]
    assert p["properties"]["xs"] == {"type": "array", "items": {"type": "number"}}
    assert p["properties"]["tags"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert p["properties"]["flag"] == {"type": "boolean", "default": False}
    assert p["required"] == ["xs", "tags"]


def _no_hint(x) -> str:
    """Doc."""


def _no_doc(x: int) -> str:
    pass


def _varargs(*xs: int) -> str:
    """Doc."""


def _bad_hint(x: set) -> str:
    """Doc."""


def _doc_names_missing(x: int) -> str:
    """Doc.

    Args:
      y: not a parameter.
    """


@pytest.mark.parametrize("fn, words", [
    (_no_hint, ["parameter 'x'", "no type hint"]),
    (_no_doc, ["no docstring"]),
    (_varargs, ["parameter 'xs'", "*args"]),
    (_bad_hint, ["parameter 'x'", "unsupported type hint"]),
    (_doc_names_missing, ["does not have", "y"]),
])
def test_a_schema_that_cannot_be_built_is_one_clear_error(fn, words):
    with pytest.raises(ValueError) as e:
        function_schema(fn)
    msg = str(e.value)
    assert msg.startswith("fn:") and fn.__name__ in msg
    for w in words:
        assert w in msg


def test_function_tool_checks_arguments_before_calling():
    calls = []

    def spy(n: int) -> str:
        """Record n."""
        calls.append(n)
        return "ok"

    reg = ToolRegistry([function_tool(spy)])
    assert reg.call("spy", json.dumps({"n": 3})).output == "ok"
    for bad, want in [({"n": "3"}, "expected integer"), ({"n": True}, "expected integer"), ({}, "missing"),
                      ({"n": 1, "m": 2}, "unknown argument"), ("[1]", "JSON object")]:
        arg = bad if isinstance(bad, str) else json.dumps(bad)
        r = reg.call("spy", arg)
        assert r.error is not None and want in r.error, (bad, r)
    assert reg.call("spy", "{not json").error.startswith("arguments of spy are not valid JSON")
    assert calls == [3]  # no bad call reached the function
    assert reg.schemas() == [function_schema(spy)]


def test_function_tool_keeps_the_registry_guards():
    def delete(path: str) -> str:
        """Delete a file."""
        return "deleted"

    reg = ToolRegistry([function_tool(delete, irreversible=True), function_tool(lookup)])
    args = json.dumps({"path": "/x"})
    assert "irreversible" in reg.call("delete", args).error
    assert "not confirmed" in reg.call("delete", args, confirm=lambda n, a: False).error
    assert reg.call("delete", args, confirm=lambda n, a: True).output == "deleted"
    assert "not authorized" in reg.call("lookup", json.dumps({"entity": "a", "attribute": "country"}),
                                        allowed={"delete"}).error
    r = reg.call("lookup", json.dumps({"entity": "a", "attribute": "colour"}))
    assert "expected one of" in r.error
    assert [c.ok for c in reg.calls] == [False, False, True, False, False]


def test_non_string_results_are_json_and_exceptions_are_errors():
    reg = ToolRegistry([function_tool(mix)])
    assert json.loads(reg.call("mix", json.dumps({"xs": [1, 2.5], "tags": {"a": 1}})).output) == \
        {"sum": 3.5, "n": 1, "flag": False}

    def boom(x: int) -> str:
        """Fails."""
        raise KeyError("nope")

    reg.register(function_tool(boom))
    assert reg.call("boom", '{"x": 1}').error == "KeyError: 'nope'"


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["entity", "attribute", "limit", "other"]),
                       st.one_of(st.text(max_size=5), st.integers(), st.booleans(), st.none(),
                                 st.sampled_from(["height_m", "country"]))))
def test_check_arguments_accepts_exactly_the_valid_calls(args):
    s = function_schema(lookup)
    valid = (set(args) <= {"entity", "attribute", "limit"} and isinstance(args.get("entity"), str)
             and args.get("attribute") in ("height_m", "country")
             and ("limit" not in args or args["limit"] is None
                  or (isinstance(args["limit"], int) and not isinstance(args["limit"], bool))))
    assert (check_arguments(s, args) is None) == valid
