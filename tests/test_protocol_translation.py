"""Messages and Responses requests translate into the chat conversation their OpenAI chat-completions
equivalent normalizes to (so both render the same prompt and are recorded the same way): a property
over random conversations of text, tool calls and tool results."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from trajgrad.serve.chat_requests import normalize_messages
from trajgrad.serve.messages import MessagesRequest
from trajgrad.serve.messages import chat_request as messages_chat
from trajgrad.serve.responses import ResponsesRequest
from trajgrad.serve.responses import chat_request as responses_chat

_text = st.text(alphabet=st.sampled_from(list("ab xy{}\":,\n<>/_01é中")), min_size=1, max_size=12)
_args = st.dictionaries(st.sampled_from(["a", "key", "n"]), st.one_of(st.integers(-5, 5), _text), max_size=2)
# a turn: the assistant's text and calls (each answered by a tool result), then the user's next text
_turn = st.tuples(st.one_of(st.just(""), _text), st.lists(st.tuples(st.sampled_from(["lookup", "add"]), _args,
                                                                      _text), max_size=2), _text)


def _chat_form(system, first, turns):
    """The conversation as an OpenAI chat-completions client sends it."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    for k, (text, calls, user) in enumerate(turns):
        reply = {"role": "assistant", "content": text}
        if calls:
            reply["tool_calls"] = [{"id": f"c{k}{j}", "type": "function",
                                    "function": {"name": name, "arguments": json.dumps(args)}}
                                   for j, (name, args, _) in enumerate(calls)]
        msgs.append(reply)
        msgs += [{"role": "tool", "tool_call_id": f"c{k}{j}", "content": out} for j, (_, _, out) in enumerate(calls)]
        msgs.append({"role": "user", "content": user})
    return msgs


@settings(max_examples=60, deadline=None)
@given(system=_text, first=_text, turns=st.lists(_turn, max_size=3))
def test_messages_translate_to_the_chat_conversation(system, first, turns):
    msgs = [{"role": "user", "content": first}]
    for k, (text, calls, user) in enumerate(turns):
        blocks = ([{"type": "text", "text": text}] if text else []) + [
            {"type": "tool_use", "id": f"c{k}{j}", "name": name, "input": args}
            for j, (name, args, _) in enumerate(calls)]
        msgs.append({"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]})
        results = [{"type": "tool_result", "tool_use_id": f"c{k}{j}", "content": out}
                   for j, (_, _, out) in enumerate(calls)]
        msgs.append({"role": "user", "content": results + [{"type": "text", "text": user}]})
    req = MessagesRequest(max_tokens=8, system=[{"type": "text", "text": system}], messages=msgs)
    got = normalize_messages(messages_chat(req).messages)
    assert got == normalize_messages(_chat_form(system, first, turns))


@settings(max_examples=60, deadline=None)
@given(system=_text, first=_text, turns=st.lists(_turn, max_size=3))
def test_responses_input_translates_to_the_chat_conversation(system, first, turns):
    items = [{"role": "user", "content": [{"type": "input_text", "text": first}]}]
    for k, (text, calls, user) in enumerate(turns):
        if text or not calls:
            items.append({"type": "message", "role": "assistant", "id": f"msg_{k}", "status": "completed",
                          "content": [{"type": "output_text", "text": text, "annotations": []}]})
        items += [{"type": "function_call", "id": f"fc_{k}{j}", "call_id": f"c{k}{j}", "name": name,
                   "arguments": json.dumps(args)} for j, (name, args, _) in enumerate(calls)]
        items += [{"type": "function_call_output", "call_id": f"c{k}{j}", "output": out}
                  for j, (_, _, out) in enumerate(calls)]
        items.append({"role": "user", "content": user})
    req = ResponsesRequest(instructions=system, input=items)
    got = normalize_messages(responses_chat(req).messages)
    assert got == normalize_messages(_chat_form(system, first, turns))
