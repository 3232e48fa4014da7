r"""``POST /v1/responses``: the OpenAI Responses API, stateless, over the chat sampler and session recorder.

A Responses request is translated into the chat conversation that ``/v1/chat/completions``
renders (:mod:`trajgrad.serve.chat_requests`) and answered by the same
:func:`~trajgrad.serve.chat.answer_chat`: the same chat template, batcher and sampler (each
token's reported value is its behaviour log-probability :math:`\log\mu(x_j\mid x_{<j})` under
the processed distribution, §7), and a session (``X-Trajgrad-Session`` header, the
``/s/{session}/v1`` base URL or ``user``) records the episode token in / token out, with the
prefix check and the policy version of each turn (§16), exactly as for chat completions.

Translation (the request → the chat conversation):

* ``instructions`` → a ``system`` message first;
* ``input``: a string (one user message), or items: messages (``role`` user / system /
  developer / assistant, string content or ``input_text`` / ``output_text`` parts); a
  ``function_call`` item (``call_id``, ``name``, ``arguments``) becomes a tool call of the
  assistant message before it (or of a new one); a ``function_call_output`` item
  (``call_id``, ``output``) a ``tool`` message;
* ``tools`` (``{"type": "function", "name", "description", "parameters"}``) → the chat
  template's function schemas; ``tool_choice`` ``auto`` / ``none``; ``max_output_tokens``.

Stateless: the server keeps no responses. ``store`` omitted is taken as ``false`` (the reply
says ``"store": false``); ``store: true``, ``previous_response_id`` and ``conversation`` are
refused with 400 naming the field (send the whole conversation in ``input``). Also refused:
``tool_choice`` ``required`` or a named function, ``strict: true`` tools (constrained decoding
changes the sampling distribution without showing in the log-probs), ``text.format`` other
than text, ``reasoning``, ``truncation: "auto"``, ``include``, ``top_logprobs``,
``max_tool_calls``, ``background``, items other than messages, function calls and their
outputs, non-text content parts, unknown fields.

The reply: ``output`` holds a ``message`` item with the reply's ``output_text`` (when not
empty) and one ``function_call`` item per parsed tool call (``call_id`` ``call_...``);
``status`` ``completed``, or ``incomplete`` (``incomplete_details.reason:
"max_output_tokens"``) when cut at ``max_output_tokens``. Extensions as for Messages
(:func:`~trajgrad.serve.chat.recorded_fields`). ``stream: true`` answers with the Responses
event sequence (:mod:`~trajgrad.serve.responses_stream`).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Optional, Union

from .chat import answer_chat, recorded_fields
from .chat_requests import ChatRequest, SamplingRequest, function_tool, join_text, plan_chat
from .errors import RequestError
from .sessions import Sessions
from .state import ServerState

__all__ = ["ResponsesRequest", "chat_request", "create_response"]

_ROLES = ("user", "system", "developer", "assistant")


def _schema():
    from pydantic import StrictBool, StrictInt

    class ResponsesRequest(SamplingRequest):
        input: Union[str, List[Dict[str, Any]]]
        instructions: Optional[str] = None
        tool_choice: Optional[Union[str, Dict[str, Any]]] = None
        parallel_tool_calls: Optional[StrictBool] = None
        max_output_tokens: Optional[StrictInt] = None
        stream_options: Optional[Dict[str, Any]] = None
        user: Optional[str] = None
        service_tier: Optional[str] = None
        prompt_cache_key: Optional[str] = None
        safety_identifier: Optional[str] = None
        # refused unless neutral (state kept by the server, or a changed distribution)
        store: Optional[StrictBool] = None
        previous_response_id: Optional[str] = None
        conversation: Optional[Any] = None
        text: Optional[Dict[str, Any]] = None
        reasoning: Optional[Dict[str, Any]] = None
        truncation: Optional[str] = None
        include: Optional[List[str]] = None
        top_logprobs: Optional[StrictInt] = None
        max_tool_calls: Optional[StrictInt] = None
        background: Optional[StrictBool] = None

    return ResponsesRequest


ResponsesRequest = _schema()


def _parts(content: Any, where: str) -> str:
    return join_text(content, where, ("input_text", "output_text", "text"))


def _input(req) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    if not req.input:
        raise RequestError("input: must contain at least one item", param="input")
    replying = False  # the last message is the assistant's and may still take function calls
    for i, item in enumerate(req.input):
        kind = item.get("type", "message" if "role" in item else None)
        at = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise RequestError(f"{at}.role: expected one of {list(_ROLES)}, got {role!r}", param=f"{at}.role")
            out.append({"role": role, "content": _parts(item.get("content"), f"{at}.content")})
            replying = role == "assistant"
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise RequestError(f"{at}.{key}: required (a string)", param=f"{at}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not replying:
                out.append({"role": "assistant", "content": ""})
                replying = True
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{at}.call_id: required (a string)", param=f"{at}.call_id")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _parts(item.get("output", ""),
                                                                                           f"{at}.output")})
            replying = False
        else:
            raise RequestError(f"{at}.type: {kind!r} items are not supported (supported: message, function_call, "
                               f"function_call_output)", param=f"{at}.type")
    return out


def _tools(tools: Optional[List[Dict[str, Any]]]) -> Optional[List[Dict[str, Any]]]:
    if not tools:
        return None
    out = []
    for k, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise RequestError(f"tools[{k}]: only function tools {{\"type\": \"function\", \"name\", \"parameters\"}} "
                               f"are supported", param=f"tools[{k}]")
        out.append(function_tool(k, t, "parameters"))
    return out


def _refuse(req) -> None:
    checks = (
        ("store", req.store is True, "this server keeps no responses (stateless); send store: false or omit it"),
        ("previous_response_id", req.previous_response_id is not None,
         "this server keeps no responses (stateless); send the whole conversation in input"),
        ("conversation", req.conversation is not None, "this server keeps no conversations; send the whole "
                                                       "conversation in input"),
        ("text", req.text not in (None, {}, {"format": {"type": "text"}}), "only {\"format\": {\"type\": \"text\"}} "
                                                                           "is supported"),
        ("reasoning", bool(req.reasoning), "not supported"),
        ("truncation", req.truncation not in (None, "disabled"), "only 'disabled' is supported"),
        ("include", bool(req.include), "not supported"),
        ("top_logprobs", bool(req.top_logprobs), "not supported (the reply carries token_logprobs)"),
        ("max_tool_calls", req.max_tool_calls is not None, "not supported"),
        ("background", req.background is True, "not supported"),
    )
    for name, bad, why in checks:
        if bad:
            raise RequestError(f"{name}: {why}", param=name)
    if isinstance(req.tool_choice, dict) or req.tool_choice not in (None, "auto", "none"):
        raise RequestError("tool_choice: only 'auto' and 'none' are supported (forcing a call needs constrained "
                           "decoding, which changes the sampling distribution)", param="tool_choice")


def chat_request(req):
    """The :class:`~trajgrad.serve.chat_requests.ChatRequest` a Responses request ``req`` stands for."""
    _refuse(req)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise RequestError(f"max_output_tokens: must be >= 1, got {req.max_output_tokens}", param="max_output_tokens")
    return ChatRequest(model=req.model, messages=_input(req), tools=_tools(req.tools), tool_choice=req.tool_choice,
                       temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                       max_tokens=req.max_output_tokens, stream=bool(req.stream), logprobs=True)


def _output(message: Dict[str, Any], cut: bool) -> List[Dict[str, Any]]:
    items: List[Dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append({"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                      "status": "incomplete" if cut else "completed",
                      "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": [],
                                   "logprobs": []}]})
    for c in calls:
        items.append({"id": f"fc_{uuid.uuid4().hex[:24]}", "type": "function_call", "status": "completed",
                      "call_id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]})
    return items


async def create_response(state: ServerState, sessions: Sessions, req, session_id: Optional[str], *,
                          fixed_sampling: Optional[Dict[str, Any]] = None,
                          default_max_tokens: int = 256) -> Dict[str, Any]:
    """The ``Response`` answering ``req`` (recorded under ``session_id`` when given, else ``req.user``)."""
    plan = plan_chat(state, chat_request(req), fixed_sampling=fixed_sampling, default_max_tokens=default_max_tokens)
    out = await answer_chat(state, sessions, plan, session_id or req.user)
    choice = out["choices"][0]
    cut = choice["finish_reason"] == "length"
    usage = out["usage"]
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "model": out["model"], "output": _output(choice["message"], cut),
        "instructions": req.instructions, "metadata": req.metadata or {}, "parallel_tool_calls": True,
        "temperature": plan.temperature, "top_p": 1.0 if plan.top_p is None else plan.top_p,
        "tool_choice": req.tool_choice or "auto", "tools": list(req.tools or []),
        "max_output_tokens": plan.max_tokens, "previous_response_id": None, "store": False,
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "user": req.user,
        "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
        **recorded_fields(out),
    }

