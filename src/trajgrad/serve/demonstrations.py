r"""Demonstrations of an agent trained through the proxy (``rollout.backend: proxy``), token for token as recorded.

The agent builds its own conversation, so the task source says what the agent sends:

* ``first_request(task)``: the body of the agent's first chat-completions call for ``task``,
  ``{"messages": [...], "tools": [...]}`` (``tools`` optional), in the OpenAI chat form;
* ``demonstration(task)``: the correct exchange that follows, in the same form, starting with
  an assistant message: the replies (a tool call as ``tool_calls``, or as the text the model
  writes) and the tool results, ending with the final reply.

:func:`proxy_demonstration` renders them exactly as the recording proxy renders the agent's
calls (:mod:`trajgrad.serve.sessions`): the request normalized
(:func:`~trajgrad.serve.chat_requests.normalize_messages`,
:func:`~trajgrad.serve.chat_requests.canonical_tools`), every message as the template renders it
(:func:`~trajgrad.serve.chat_requests.rendered`: a structured tool call as its Hermes text
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), the prompt by the chat template
with ``tools=``, each reply as action tokens (its text + the end-of-turn token), each following
tool result as the observation :meth:`~trajgrad.rollout.chat.ChatSession.observe` appends
(:func:`~trajgrad.rollout.chat.exchange_trajectory`). An episode in which the policy sampled
those replies' tokens is recorded as the same token sequence, with the same action mask.
Like every demonstration it feeds likelihood terms only (SFT, DPO's chosen side).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..rollout.chat import exchange_trajectory
from ..rollout.trajectory import Trajectory
from .chat_requests import canonical_tools, normalize_messages, rendered

__all__ = ["first_request", "proxy_demonstration"]


def first_request(source, task) -> Tuple[List[Dict[str, Any]], Optional[List[Dict[str, Any]]]]:
    """The normalized messages and tools of ``source.first_request(task)``; ValueError naming what is wrong."""
    fn = getattr(source, "first_request", None)
    if not callable(fn):
        raise ValueError("demonstration: with rollout.backend 'proxy' the task source must also give "
                         "first_request(task), the agent's first chat request ({'messages': [...], 'tools': [...]}), "
                         "which the demonstration continues")
    req = fn(task)
    if not isinstance(req, dict) or not isinstance(req.get("messages"), list):
        raise ValueError(f"demonstration: first_request(task) must return a dict with a 'messages' list, got "
                         f"{type(req).__name__}")
    unknown = set(req) - {"messages", "tools"}
    if unknown:
        raise ValueError(f"demonstration: first_request(task) has unknown key(s) {sorted(unknown)} (expected "
                         f"'messages' and 'tools')")
    return normalize_messages(req["messages"]), canonical_tools(req.get("tools"))


def proxy_demonstration(tokenizer, source, task) -> Trajectory:
    """The demonstration of ``task`` as the proxy records the agent's episode (see the module doc)."""
    messages, tools = first_request(source, task)
    demo = source.demonstration(task)
    if not isinstance(demo, list) or not demo:
        raise ValueError(f"demonstration: expected a non-empty list of messages, got {demo!r:.80}")
    exchange = [rendered(m) for m in normalize_messages(demo)]
    return exchange_trajectory(tokenizer, [rendered(m) for m in messages], exchange, task, tools=tools,
                               env_name="proxy")
