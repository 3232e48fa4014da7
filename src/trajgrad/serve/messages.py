r"""``POST /v1/messages``: the Anthropic Messages API over the chat sampler and session recorder.

A Messages request is translated into the chat conversation that
``/v1/chat/completions`` renders (:mod:`trajgrad.serve.chat_requests`) and answered by the
same :func:`~trajgrad.serve.chat.answer_chat`: the same chat template, batcher and sampler,
so every token's reported value is its behaviour log-probability
:math:`\log\mu(x_j\mid x_{<j})` under the processed distribution (§7), and a session
(``X-Trajgrad-Session`` header or the ``/s/{session}`` base-URL prefix) records the episode
token in / token out with the prefix check and the policy version of each turn (§16),
exactly as for chat completions.

Translation (the request → the chat conversation):

* ``system`` (a string or text blocks) → a ``system`` message;
* ``messages[i]`` with string content, or blocks: ``text`` blocks join into the message's
  text; an assistant's ``tool_use`` blocks become its tool calls (``id``, ``name``,
  ``input``); a user's ``tool_result`` blocks become ``tool`` messages (their string or
  text-block content; ``is_error`` is not rendered: the chat template has no place for it),
  in block order, its text blocks a ``user`` message;
* ``tools`` (``name``, ``description``, ``input_schema``) → OpenAI function schemas passed to
  the chat template; ``tool_choice`` ``{"type": "auto"}`` / ``{"type": "none"}``.

Refused with 400 naming the field (Anthropic's error shape): ``tool_choice`` ``any`` or a
named tool, ``disable_parallel_tool_use: true`` and ``strict`` tools (they constrain decoding,
which changes the sampling distribution without showing in the log-probs), non-empty
``stop_sequences``, ``thinking`` other than disabled, content blocks other than text /
tool_use / tool_result, a conversation that ends with an assistant message (prefill),
unknown fields. ``temperature``, ``top_p``, ``top_k`` are checked as for chat completions
(the official SDK sends them through ``extra_body``).

The reply: ``content`` holds the reply's text block (when not empty) and one ``tool_use``
block per parsed tool call (ids ``toolu_...``), ``stop_reason`` ``end_turn`` / ``tool_use`` /
``max_tokens``, ``usage`` the prompt and sampled token counts. Extensions:
``token_ids`` and ``token_logprobs`` (every sampled token, the end-of-turn token included, and
its behaviour log-prob), ``policy_version``, ``prompt_token_ids``, ``session``.
``stream: true`` answers with the Messages event sequence
(:mod:`~trajgrad.serve.messages_stream`). ``POST /v1/messages/count_tokens``
(:func:`count_tokens`) gives the tokens the conversation renders to.
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Dict, List, Optional, Union

from .chat import answer_chat, recorded_fields
from .chat_requests import (ChatRequest, SamplingRequest, canonical_tools, function_tool, join_text, normalize_messages,
                            plan_chat, render_prompt)
from .errors import RequestError
from .sessions import Sessions
from .state import ServerState

__all__ = ["CountTokensRequest", "MessagesRequest", "chat_request", "count_tokens", "create_message"]

_TOOL_KEYS = {"name", "description", "input_schema", "type", "cache_control", "strict"}
_STOP = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


def _schema():
    from pydantic import StrictInt

    class MessagesRequest(SamplingRequest):
        max_tokens: StrictInt
        messages: List[Dict[str, Any]]
        system: Optional[Union[str, List[Dict[str, Any]]]] = None
        tool_choice: Optional[Dict[str, Any]] = None
        service_tier: Optional[str] = None
        cache_control: Optional[Dict[str, Any]] = None
        # accepted only at their neutral values (they would change the distribution)
        stop_sequences: Optional[List[str]] = None
        thinking: Optional[Dict[str, Any]] = None

    return MessagesRequest


MessagesRequest = _schema()


class CountTokensRequest(MessagesRequest):
    """``/v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    max_tokens: Optional[int] = None


def _text(blocks: Any, where: str) -> str:
    """A string, or text blocks joined."""
    return join_text(blocks, where, ("text",))


def _blocks(i: int, role: str, content: List[Any]) -> List[Dict[str, Any]]:
    """The chat messages of ``messages[i]`` given as content blocks (see the module doc)."""
    where = f"messages[{i}].content"
    if not content:
        raise RequestError(f"{where}: empty", param=where)
    out: List[Dict[str, Any]] = []
    text: List[str] = []
    calls: List[Dict[str, Any]] = []

    def flush_text():
        if text and role == "user":
            out.append({"role": "user", "content": "".join(text)})
            text.clear()

    for k, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}[{k}]"
        if kind == "text":
            if not isinstance(b.get("text"), str):
                raise RequestError(f"{at}.text: required (a string)", param=f"{at}.text")
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("name"), str) or not b["name"] or not isinstance(b.get("input"), dict):
                raise RequestError(f"{at}: a tool_use block needs a 'name' (string) and an 'input' (object)",
                                   param=at)
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b["name"], "arguments": b["input"]}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise RequestError(f"{at}.tool_use_id: required (a string)", param=f"{at}.tool_use_id")
            flush_text()
            result = b.get("content", "")
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                        "content": _text(result if result is not None else "", f"{at}.content")})
        else:
            allowed = "text, tool_use" if role == "assistant" else "text, tool_result"
            raise RequestError(f"{at}.type: {kind!r} blocks are not supported in {role} messages (supported: "
                               f"{allowed})", param=f"{at}.type")
    if role == "assistant":
        msg: Dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    else:
        flush_text()
    return out


def _messages(req) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    if req.system is not None:
        system = _text(req.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    if not req.messages:
        raise RequestError("messages: must contain at least one message", param="messages")
    for i, m in enumerate(req.messages):
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise RequestError(f"messages[{i}].role: expected 'user' or 'assistant', got {role!r}",
                               param=f"messages[{i}].role")
        unknown = set(m) - {"role", "content"}
        if unknown:
            raise RequestError(f"messages[{i}]: unknown key(s) {sorted(unknown)}", param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out.extend(_blocks(i, role, content))
        else:
            raise RequestError(f"messages[{i}].content: expected a string or a list of content blocks",
                               param=f"messages[{i}].content")
    if req.messages[-1].get("role") == "assistant":
        raise RequestError("messages: the last message is an assistant message (prefill), which is not supported; "
                           "end with a user message", param="messages")
    return out


def _tools(tools: Optional[List[Dict[str, Any]]]) -> Optional[List[Dict[str, Any]]]:
    if not tools:
        return None
    out = []
    for k, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
            raise RequestError(f"tools[{k}].type: only custom tools (name, description, input_schema) are "
                               f"supported, got {t.get('type') if isinstance(t, dict) else t!r}", param=f"tools[{k}]")
        unknown = set(t) - _TOOL_KEYS
        if unknown:
            raise RequestError(f"tools[{k}]: unsupported key(s) {sorted(unknown)}", param=f"tools[{k}]")
        if not isinstance(t.get("name"), str) or not t["name"] or not isinstance(t.get("input_schema"), dict):
            raise RequestError(f"tools[{k}]: needs a 'name' (string) and an 'input_schema' (object)",
                               param=f"tools[{k}]")
        out.append(function_tool(k, t, "input_schema"))
    return out


def _tool_choice(choice: Optional[Dict[str, Any]]) -> Optional[str]:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind not in ("auto", "none"):
        raise RequestError(f"tool_choice: only {{\"type\": \"auto\"}} and {{\"type\": \"none\"}} are supported, got "
                           f"{kind!r} (forcing a tool call needs constrained decoding, which changes the sampling "
                           f"distribution)", param="tool_choice")
    if choice.get("disable_parallel_tool_use"):
        raise RequestError("tool_choice.disable_parallel_tool_use: not supported (limiting the calls needs "
                           "constrained decoding); omit it", param="tool_choice.disable_parallel_tool_use")
    return kind


def chat_request(req):
    """The :class:`~trajgrad.serve.chat_requests.ChatRequest` a Messages request ``req`` stands for."""
    if req.stop_sequences:
        raise RequestError("stop_sequences: not supported (the model stops at its end-of-turn token)",
                           param="stop_sequences")
    if req.thinking not in (None, {"type": "disabled"}):
        raise RequestError("thinking: only {\"type\": \"disabled\"} is supported", param="thinking")
    return ChatRequest(model=req.model, messages=_messages(req), tools=_tools(req.tools),
                       tool_choice=_tool_choice(req.tool_choice), temperature=req.temperature, top_p=req.top_p,
                       top_k=req.top_k, max_tokens=req.max_tokens, stream=bool(req.stream), logprobs=True)


def _content(message: Dict[str, Any]) -> List[Dict[str, Any]]:
    blocks: List[Dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for c in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                       "input": json.loads(c["function"]["arguments"])})
    return blocks or [{"type": "text", "text": ""}]


async def create_message(state: ServerState, sessions: Sessions, req, session_id: Optional[str], *,
                         fixed_sampling: Optional[Dict[str, Any]] = None,
                         default_max_tokens: int = 256) -> Dict[str, Any]:
    """The Anthropic ``Message`` answering ``req`` (recorded under ``session_id`` when given)."""
    plan = plan_chat(state, chat_request(req), fixed_sampling=fixed_sampling, default_max_tokens=default_max_tokens)
    out = await answer_chat(state, sessions, dataclasses.replace(plan, call_prefix="toolu_"), session_id)
    choice = out["choices"][0]
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": out["model"],
        "content": _content(choice["message"]),
        "stop_reason": _STOP[choice["finish_reason"]],
        "stop_sequence": None,
        "usage": {"input_tokens": out["usage"]["prompt_tokens"], "output_tokens": out["usage"]["completion_tokens"]},
        **recorded_fields(out),
    }


def count_tokens(state: ServerState, req) -> Dict[str, int]:
    """``{"input_tokens": n}``: the tokens the conversation of ``req`` renders to with the chat template
    (rendered afresh, outside any session; the request checked as ``/v1/messages`` checks it)."""
    chat = chat_request(req)
    return {"input_tokens": len(render_prompt(state.tokenizer, normalize_messages(chat.messages),
                                              canonical_tools(chat.tools)))}
