"""`trajgrad serve` /v1/responses (OpenAI Responses API, stateless) through the official openai client's
`client.responses.create`: text and function_call output, the Responses event stream, a tool loop with
function_call_output items recorded token in / token out with the learner's recomputation matching
(§4, §7, §16), stateful and distribution-changing fields refused with 400 naming the field."""
from __future__ import annotations

import json
import sys
from concurrent.futures import Future
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_serve_chat import NAME, _finish, _Scripted, check_recorded, qmodel, qtok, served  # noqa: E402,F401

from trajgrad.rollout.chat import end_of_turn_id, prompt_ids  # noqa: E402

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("one_thread")

TOOLS = [
    {"type": "function", "name": "lookup", "description": "Look a key up.", "strict": False,
     "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}},
    {"type": "function", "name": "add", "description": "a + b.", "strict": False,
     "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}},
]
CHAT_TOOLS = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}} for t in TOOLS]


def _client(served, session=None):
    base = f"{served.url}/v1" if session is None else f"{served.url}/s/{session}/v1"
    return openai.OpenAI(base_url=base, api_key="none", max_retries=0)


# ----------------------------------------------------------------------------- shape
def test_response_shape_usage_and_extensions(served, qtok):
    r = _client(served).responses.create(model=NAME, instructions="Answer briefly.", tools=TOOLS, max_output_tokens=10,
                                         input=[{"role": "user", "content": [{"type": "input_text", "text": "hel"},
                                                                             {"type": "input_text", "text": "lo"}]}])
    assert r.object == "response" and r.model == NAME and r.id.startswith("resp_") and r.store is False
    prompt = prompt_ids(qtok, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "hello"}],
                        CHAT_TOOLS)
    extra = r.model_extra
    assert extra["prompt_token_ids"] == prompt and r.usage.input_tokens == len(prompt)
    ids = extra["token_ids"]
    assert r.usage.output_tokens == len(ids) == len(extra["token_logprobs"])
    assert r.usage.total_tokens == len(prompt) + len(ids)
    cut = ids[-1] != end_of_turn_id(qtok)
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == ("max_output_tokens" if cut else None)
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    assert r.output_text == qtok.decode(ids if cut else ids[:-1], skip_special_tokens=False)


def test_session_from_the_user_field(served):
    r = _client(served).responses.create(model=NAME, input="u", max_output_tokens=3, user="resp-by-user")
    assert r.model_extra["session"] == "resp-by-user" and r.user == "resp-by-user"
    assert _finish(served, "resp-by-user").turns[0].action_ids == r.model_extra["token_ids"]


def test_stream_is_the_responses_event_sequence(served, monkeypatch):
    c = _client(served)
    with _Scripted(served.state, ["Hi there."]):
        events = list(c.responses.create(model=NAME, input="hello", stream=True))
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    assert n == len("Hi there.") and kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"] + [
        "response.output_text.delta"] * n + ["response.output_text.done", "response.content_part.done",
                                            "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hi there."
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "Hi there."
    assert final.model_extra["token_logprobs"] == [-0.5] * (n + 1)
    # the SDK's stream helper accumulates a function call from its argument deltas
    call = 'Sure. <tool_call>{"name": "lookup", "arguments": {"key": "a long key value"}}</tool_call>'
    with _Scripted(served.state, [call]):
        with c.responses.stream(model=NAME, input="hello", tools=TOOLS) as stream:
            deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
            got = stream.get_final_response()
    assert [o.type for o in got.output] == ["message", "function_call"] and got.output_text == "Sure."
    fc = got.output[1]
    assert fc.name == "lookup" and json.loads(fc.arguments) == {"key": "a long key value"} and len(deltas) > 1
    assert "".join(deltas) == fc.arguments and fc.call_id.startswith("call_")
    # cut at max_output_tokens: the last event is response.incomplete
    def cut_at_max(rows, key, seed):  # four tokens, no end of turn: cut at max_output_tokens
        f = Future()
        f.set_result(([([70, 71, 72, 73], [-0.5] * 4, True) for _ in rows], 0))
        return f

    monkeypatch.setattr(served.state, "submit", cut_at_max)
    cut = list(c.responses.create(model=NAME, input="hello", stream=True, max_output_tokens=4))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.status == "incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"


# ----------------------------------------------------------------------------- recording (§4, §7, §16)
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9, top_k=20)],
                         ids=["T1", "T0.7-p0.9-k20"])
def test_recorded_episode_matches_the_learner(served, qmodel, sampling):
    """Three turns, the agent appending `response.output` (the SDK's objects) to its input: each prompt
    extends the previous prompt + sample; the learner's ratio is 1 within 1e-5 on every action token."""
    sid = f"resp-episode-{sampling['temperature']}"
    c = _client(served, sid)
    items = [{"role": "user", "content": "first"}]
    served_turns, prompts = [], []
    for k in range(3):
        r = c.responses.create(model=NAME, instructions="Answer briefly.", input=items, max_output_tokens=8,
                               temperature=sampling["temperature"], top_p=sampling.get("top_p"),
                               extra_body={"top_k": sampling["top_k"]} if "top_k" in sampling else None)
        served_turns.append((r.model_extra["token_ids"], r.model_extra["token_logprobs"]))
        prompts.append(r.model_extra["prompt_token_ids"])
        items = items + list(r.output) + [{"role": "user", "content": f"more {k}"}]
    check_recorded(_finish(served, sid), served_turns, prompts, qmodel, sampling)


def test_tool_loop_with_function_call_outputs(served, qtok):
    first = 'Checking. <tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
    second = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    sid = "resp-tools"
    c = _client(served, sid)
    items = [{"role": "user", "content": "a + 2?"}]
    with _Scripted(served.state, [first, second, "3"]):
        r1 = c.responses.create(model=NAME, input=items, tools=TOOLS, tool_choice="auto", store=False)
        msg, fc = r1.output
        assert msg.content[0].text == "Checking." and fc.type == "function_call" and fc.name == "lookup"
        assert json.loads(fc.arguments) == {"key": "a"} and fc.id.startswith("fc_") and r1.status == "completed"
        items += list(r1.output) + [{"type": "function_call_output", "call_id": fc.call_id, "output": "1"}]
        r2 = c.responses.create(model=NAME, input=items, tools=TOOLS)
        (fc2,) = r2.output  # a call alone: no message item
        assert fc2.type == "function_call" and json.loads(fc2.arguments) == {"a": 1, "b": 2}
        # the client sends the call back as a plain dict, without its item id or status
        items += [{"type": "function_call", "call_id": fc2.call_id, "name": "add", "arguments": fc2.arguments},
                  {"type": "function_call_output", "call_id": fc2.call_id, "output": "3"}]
        r3 = c.responses.create(model=NAME, input=items, tools=TOOLS)
        assert r3.output_text == "3" and [o.type for o in r3.output] == ["message"]
    traj = _finish(served, sid)
    assert "diverged" not in traj.metadata and [t.action_text for t in traj.turns] == [first, second, "3"]
    text = qtok.decode(traj.token_ids(), skip_special_tokens=False)
    assert "<tool_response>\n1\n</tool_response>" in text and "<tool_response>\n3\n</tool_response>" in text
    assert sum(traj.action_mask()) == sum(len(t.action_ids) for t in traj.turns)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("body,field", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "add"}}, "tool_choice"),
    ({"input": "x", "tools": [dict(TOOLS[0], strict=True)]}, "tools[0].strict"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
])
def test_bad_requests_are_400_naming_the_field(served, body, field):
    r = httpx.post(f"{served.url}/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field), err


def test_sdk_raises_the_servers_errors(served):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        _client(served).responses.create(model=NAME, input="x", previous_response_id="resp_1")
