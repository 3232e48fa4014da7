"""A shop assistant written only against the official ``openai`` client: a loop with two tools.

Nothing here knows about trajgrad. The client is ``openai.OpenAI()``, which reads
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from the environment, so the same code talks to
api.openai.com, to any OpenAI-compatible server, or to the policy being trained.

    python agent.py "How much do 3 apples cost?"
"""
from __future__ import annotations

import json
import os
import sys

import openai

PRICES = {"apple": 3, "banana": 2, "grape": 5, "kiwi": 7, "lemon": 4, "lime": 1, "melon": 9, "orange": 6, "pear": 8,
          "plum": 2}

TOOLS = [
    {"type": "function", "function": {
        "name": "lookup_price", "description": "The price in dollars of one item of the shop.",
        "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}},
    {"type": "function", "function": {
        "name": "multiply", "description": "The product a * b.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}},
]

SYSTEM = (
    "You are a shop assistant. Tools: lookup_price(item) gives the price of one item; multiply(a, b) gives a*b. "
    'Call a tool by replying <tool_call>{"name": "lookup_price", "arguments": {"item": "apple"}}</tool_call>. '
    "When you know the answer, reply with the number only."
)

# one worked exchange shown before the question (small models follow an example better than a rule); its
# count differs from the price, so that it shows which number goes where (with "2 plums" at 2 dollars,
# SmolLM2-135M multiplied the count by itself)
EXAMPLE = [
    {"role": "user", "content": "How much do 3 plums cost?"},
    {"role": "assistant", "content": '<tool_call>{"name": "lookup_price", "arguments": {"item": "plum"}}</tool_call>'},
    {"role": "tool", "content": "2"},
    {"role": "assistant", "content": '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 2}}</tool_call>'},
    {"role": "tool", "content": "6"},
    {"role": "assistant", "content": "6"},
]


def lookup_price(item: str) -> str:
    key = str(item).strip().lower().rstrip("s")
    return str(PRICES[key]) if key in PRICES else f"error: no item named {item!r}"


def multiply(a, b) -> str:
    try:
        x = float(a) * float(b)
    except (TypeError, ValueError):
        return "error: a and b must be numbers"
    return str(int(x)) if x == int(x) else str(x)


def call_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return "error: the arguments are not valid JSON"
    if name == "lookup_price":
        return lookup_price(args.get("item", ""))
    if name == "multiply":
        return multiply(args.get("a"), args.get("b"))
    return f"error: unknown tool {name!r}"


def run_agent(client: "openai.OpenAI", question: str, *, model: str = "gpt-4o-mini", max_turns: int = 4,
              max_tokens: int = 64) -> str:
    """Answer ``question``, calling tools as the model asks; the final reply's text."""
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens)
        msg = reply.choices[0].message
        if not msg.tool_calls:
            return msg.content or ""
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": call_tool(call.function.name, call.function.arguments)})
    return ""


if __name__ == "__main__":
    client = openai.OpenAI(api_key=os.environ.get("OPENAI_API_KEY", "none"))
    print(run_agent(client, " ".join(sys.argv[1:]) or "How much does one mango cost?",
                    model=os.environ.get("AGENT_MODEL", "gpt-4o-mini")))
