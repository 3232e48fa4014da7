"""`trajgrad serve` /v1/messages (Anthropic Messages API) through the official anthropic client:
text and tool_use replies, the Messages event stream, a two-tool loop recorded token in / token out
with the learner's recomputation matching (§4, §7, §16), bad requests answered in Anthropic's error
shape naming the field."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_serve_chat import NAME, _finish, _Scripted, check_recorded, qmodel, qtok, served  # noqa: E402,F401

from trajgrad.rollout.chat import end_of_turn_id, prompt_ids  # noqa: E402

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.usefixtures("one_thread")

TOOLS = [
    {"name": "lookup", "description": "Look a key up.",
     "input_schema": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}},
    {"name": "add", "description": "a + b.",
     "input_schema": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}},
]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]


def _client(served, session=None):
    base = served.url if session is None else f"{served.url}/s/{session}"
    return anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)


# ----------------------------------------------------------------------------- shape
def test_message_shape_usage_and_extensions(served, qtok):
    r = _client(served).messages.create(model=NAME, max_tokens=10, system="Answer briefly.", tools=TOOLS,
                                        messages=[{"role": "user", "content": [{"type": "text", "text": "hel"},
                                                                               {"type": "text", "text": "lo"}]}])
    assert r.type == "message" and r.role == "assistant" and r.model == NAME and r.id.startswith("msg_")
    prompt = prompt_ids(qtok, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "hello"}],
                        OPENAI_TOOLS)
    extra = r.model_extra
    assert extra["prompt_token_ids"] == prompt and r.usage.input_tokens == len(prompt)
    ids = extra["token_ids"]
    assert r.usage.output_tokens == len(ids) == len(extra["token_logprobs"]) and extra["policy_version"] == 0
    eot = end_of_turn_id(qtok)
    assert (r.stop_reason == "max_tokens") == (ids[-1] != eot) and r.stop_reason in ("max_tokens", "end_turn")
    body = ids[:-1] if r.stop_reason == "end_turn" else ids
    (block,) = r.content
    assert block.type == "text" and block.text == qtok.decode(body, skip_special_tokens=False)
    assert all(lp <= 0 for lp in extra["token_logprobs"])


def test_stream_is_the_messages_event_sequence(served, qtok):
    with _Scripted(served.state, ["Hi there, friend."]):
        events = list(_client(served).messages.create(model=NAME, max_tokens=32, stream=True,
                                                      messages=[{"role": "user", "content": "hello"}]))
    kinds = [e.type for e in events]
    n = kinds.count("content_block_delta")
    assert kinds == ["message_start", "content_block_start"] + ["content_block_delta"] * n + [
        "content_block_stop", "message_delta", "message_stop"] and n == len("Hi there, friend.")  # one per token
    assert events[0].message.content == [] and events[0].message.usage.input_tokens > 0
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "Hi there, friend."
    delta = events[-2]
    assert delta.delta.stop_reason == "end_turn" and delta.usage.output_tokens == n + 1  # the end of turn too
    assert delta.model_extra["token_logprobs"] == [-0.5] * (n + 1)
    # the SDK's own accumulator rebuilds the same message
    with _Scripted(served.state, ['Sure. <tool_call>{"name": "lookup", "arguments": {"key": "a long key value"}}'
                                  '</tool_call>']):
        with _client(served).messages.stream(model=NAME, max_tokens=64, tools=TOOLS,
                                             messages=[{"role": "user", "content": "hello"}]) as stream:
            raw = [e for e in stream if e.type in ("content_block_start", "content_block_delta")]
            final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].text == "Sure." and final.content[1].input == {"key": "a long key value"}
    parts = [e.delta.partial_json for e in raw if e.type == "content_block_delta" and e.index == 1]
    assert len(parts) > 1 and json.loads("".join(parts)) == {"key": "a long key value"}


# ----------------------------------------------------------------------------- recording (§4, §7, §16)
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9, top_k=20)],
                         ids=["T1", "T0.7-p0.9-k20"])
def test_recorded_episode_matches_the_learner(served, qmodel, sampling):
    """Three turns under one session (the /s/{session} base URL): each prompt extends the previous prompt
    + sample; the trajectory holds the served tokens and log-probs; the learner's ratio is 1 within 1e-5."""
    sid = f"msg-episode-{sampling['temperature']}"
    c = _client(served, sid)
    msgs = [{"role": "user", "content": "first"}]
    served_turns, prompts = [], []
    for k in range(3):
        r = c.messages.create(model=NAME, max_tokens=8, system="Answer briefly.", messages=msgs, extra_body=sampling)
        served_turns.append((r.model_extra["token_ids"], r.model_extra["token_logprobs"]))
        prompts.append(r.model_extra["prompt_token_ids"])
        assert r.model_extra["session"] == sid
        msgs = msgs + [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                       {"role": "user", "content": f"more {k}"}]
    check_recorded(_finish(served, sid), served_turns, prompts, qmodel, sampling)



def test_two_tool_loop_is_recorded_verbatim(served, qtok):
    """Scripted replies: lookup, then add, then the answer. tool_use blocks carry toolu_ ids and the
    parsed input; tool_result blocks come back as tool messages; the episode never diverges."""
    first = 'Checking. <tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
    second = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    sid = "msg-tools"
    c = _client(served).with_options(default_headers={"X-Trajgrad-Session": sid})
    msgs = [{"role": "user", "content": "a + 2?"}]
    with _Scripted(served.state, [first, second, "3"]):
        r1 = c.messages.create(model=NAME, max_tokens=64, tools=TOOLS, tool_choice={"type": "auto"}, messages=msgs)
        assert r1.stop_reason == "tool_use" and [b.type for b in r1.content] == ["text", "tool_use"]
        text, use = r1.content
        assert text.text == "Checking." and use.name == "lookup" and use.input == {"key": "a"}
        assert use.id.startswith("toolu_") and "<tools>" in qtok.decode(r1.model_extra["prompt_token_ids"])
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r1.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "1"}]}]
        r2 = c.messages.create(model=NAME, max_tokens=64, tools=TOOLS, messages=msgs)
        (use2,) = r2.content
        assert use2.type == "tool_use" and use2.input == {"a": 1, "b": 2} and r2.stop_reason == "tool_use"
        # the tool_use block alone (no text), the result as text blocks
        msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": use2.id, "name": "add",
                                                    "input": {"a": 1, "b": 2}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use2.id,
                                               "content": [{"type": "text", "text": "3"}]}]}]
        r3 = c.messages.create(model=NAME, max_tokens=64, tools=TOOLS, messages=msgs)
        assert r3.stop_reason == "end_turn" and r3.content[0].text == "3"
    traj = _finish(served, sid)
    assert "diverged" not in traj.metadata and [t.action_text for t in traj.turns] == [first, second, "3"]
    text = qtok.decode(traj.token_ids(), skip_special_tokens=False)
    assert "<tool_response>\n1\n</tool_response>" in text and "<tool_response>\n3\n</tool_response>" in text
    assert all(t.behaviour_logp == [-0.5] * len(t.action_ids) for t in traj.turns)
    assert sum(traj.action_mask()) == sum(len(t.action_ids) for t in traj.turns)


def test_a_fabricated_tool_use_is_a_divergence(served):
    sid = "msg-fabricated"
    c = _client(served, sid)
    with _Scripted(served.state, ['<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>', "x"]):
        r = c.messages.create(model=NAME, max_tokens=64, tools=TOOLS, messages=[{"role": "user", "content": "q"}])
        (use,) = r.content
        c.messages.create(model=NAME, max_tokens=64, tools=TOOLS, messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": "lookup",
                                               "input": {"key": "b"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "1"}]}])
    assert served.state.sessions.get(sid).diverged.startswith("history")
    assert _finish(served, sid) is None


def test_count_tokens_is_the_rendered_prompt(served, qtok):
    msgs = [{"role": "user", "content": "hello"}]
    c = _client(served)
    n = c.messages.count_tokens(model=NAME, system="Answer briefly.", messages=msgs, tools=TOOLS)
    r = c.messages.create(model=NAME, max_tokens=2, system="Answer briefly.", messages=msgs, tools=TOOLS)
    assert n.input_tokens == r.usage.input_tokens == len(prompt_ids(
        qtok, [{"role": "system", "content": "Answer briefly."}, *msgs], OPENAI_TOOLS))
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        c.messages.count_tokens(model=NAME, messages=msgs, tools=TOOLS, tool_choice={"type": "any"})


# ----------------------------------------------------------------------------- errors
U = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("body,field", [
    ({"messages": U}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                   "input": {}}]}]}, "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": U + [{"role": "assistant", "content": "The answer is"}]}, "messages"),
    ({"max_tokens": 4, "messages": U, "tools": TOOLS, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": U, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "add"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": U, "tools": TOOLS,
      "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, "tool_choice.disable_parallel_tool_use"),
    ({"max_tokens": 4, "messages": U, "tools": [dict(TOOLS[0], strict=True)]}, "tools[0].strict"),
    ({"max_tokens": 4, "messages": U, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"max_tokens": 4, "messages": U, "stop_sequences": ["\n"]}, "stop_sequences"),
    ({"max_tokens": 4, "messages": U, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 4, "messages": U, "temperature": -1}, "temperature"),
    ({"max_tokens": 4, "messages": U, "top_p": 0}, "top_p"),
    ({"max_tokens": 0, "messages": U}, "max_tokens"),
    ({"max_tokens": 4, "messages": U, "frobnicate": 1}, "frobnicate"),
])
def test_bad_requests_are_400_in_anthropics_shape(served, body, field):
    r = httpx.post(f"{served.url}/v1/messages", json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(field), err


def test_sdk_raises_the_servers_errors(served):
    c = _client(served)
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
        c.messages.create(model=NAME, max_tokens=4, messages=U, stop_sequences=["END"])
    with pytest.raises(anthropic.NotFoundError, match="gpt-9"):
        c.messages.create(model="gpt-9", max_tokens=4, messages=U)
