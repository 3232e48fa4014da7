"""A calendar assistant written only against the official ``anthropic`` client: a loop with two tools.

Nothing here knows about trajgrad. The client is ``anthropic.Anthropic()``, which reads
``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY`` from the environment, so the same code talks to
api.anthropic.com, to any server that speaks the Messages API, or to the policy being trained.

    python calendar_agent.py "How many days are there in March and April together?"
"""
from __future__ import annotations

import os
import sys

import anthropic

DAYS = {"january": 31, "february": 28, "march": 31, "april": 30, "may": 31, "june": 30, "july": 31, "august": 31,
        "september": 30, "october": 31, "november": 30, "december": 31}

TOOLS = [
    {"name": "days_in_month", "description": "The number of days of a month (not a leap year).",
     "input_schema": {"type": "object", "properties": {"month": {"type": "string"}}, "required": ["month"]}},
    {"name": "add", "description": "The sum a + b.",
     "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}},
]

SYSTEM = (
    "You are a calendar assistant. Tools: days_in_month(month) gives the days of a month; add(a, b) gives a+b. "
    'Call a tool by replying <tool_call>{"name": "days_in_month", "arguments": {"month": "march"}}</tool_call>. '
    "When you know the answer, reply with the number only."
)

# one worked exchange shown before the question (small models follow an example better than a rule)
EXAMPLE = [
    {"role": "user", "content": "How many days are there in June and July together?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_example_1", "name": "days_in_month",
                                       "input": {"month": "june"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_example_1", "content": "30"}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_example_2", "name": "days_in_month",
                                       "input": {"month": "july"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_example_2", "content": "31"}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_example_3", "name": "add",
                                       "input": {"a": 30, "b": 31}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_example_3", "content": "61"}]},
    {"role": "assistant", "content": "61"},
]


def call_tool(name: str, args: dict) -> str:
    """The tool's result as text (an error message for a bad call: the model sees it and may retry)."""
    if name == "days_in_month":
        days = DAYS.get(str(args.get("month", "")).strip().lower())
        return str(days) if days is not None else f"error: no month named {args.get('month')!r}"
    if name == "add":
        a, b = args.get("a"), args.get("b")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b)):
            return "error: a and b must be integers"
        return str(a + b)
    return f"error: unknown tool {name!r}"


def run_agent(client: "anthropic.Anthropic", question: str, *, model: str = "claude-sonnet-4-5", max_turns: int = 5,
              max_tokens: int = 64) -> str:
    """Answer ``question``, calling tools as the model asks; the final reply's text."""
    messages = [*EXAMPLE, {"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = client.messages.create(model=model, system=SYSTEM, messages=messages, tools=TOOLS,
                                       max_tokens=max_tokens)
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in reply.content if b.type == "text")
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": call_tool(b.name, b.input)} for b in uses]})
    return ""


if __name__ == "__main__":
    client = anthropic.Anthropic(api_key=os.environ.get("ANTHROPIC_API_KEY", "none"))
    print(run_agent(client, " ".join(sys.argv[1:]) or "How many days are there in March and April together?",
                    model=os.environ.get("AGENT_MODEL", "claude-sonnet-4-5")))
