r"""``/v1/chat/completions``: render with the chat template, sample through the batcher, parse tool calls.

The conversation is rendered with the tokenizer's chat template (``tools`` passed as the
template's ``tools=``), or, inside a session, extended token for token
(:mod:`trajgrad.serve.sessions`). Every choice is drawn by the same batcher and sampler as
``/v1/completions`` (:meth:`~trajgrad.serve.state.ServerState.submit`, hence
:func:`trajgrad.rollout.generation.sample_actions` under
:func:`trajgrad.logprobs.sampling_logits`), so the value reported for each token is its
behaviour log-probability :math:`\log\mu(x_j\mid x_{<j})` under the processed distribution
(§7). ``logprobs.content`` lists **every** sampled token, the end-of-turn token included
(its text is the special token), so the recorded action and its log-probs are all there;
``choices[i].token_ids`` and ``policy_version`` are extensions.

Tool calls (Hermes ``<tool_call>{...}</tool_call>`` or a reply that is a bare JSON call,
:func:`trajgrad.envs.toolcalls.parse_tool_calls`) become ``message.tool_calls`` with
``finish_reason: "tool_calls"`` when the request offers ``tools`` and ``tool_choice`` is not
``"none"``; a malformed call stays text. ``stream: true`` answers with server-sent events
in the OpenAI chunk shape, ending with ``data: [DONE]``; the chunks are sent once the
choices are sampled (sampling is batched, not token by token).
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional

from ..envs.toolcalls import parse_tool_calls
from ..rollout.chat import end_of_turn_id
from ._tokens import top_logprobs
from .chat_requests import ChatPlan, plan_chat, render_prompt
from .errors import RequestError
from .sessions import Candidate, Sessions
from .state import ServerState

__all__ = ["answer_chat", "chat_complete", "recorded_fields", "sse_chunks", "text_pieces"]

_TAGGED = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


def _decode(tok, ids: List[int]) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _message(plan: ChatPlan, text: str) -> Dict[str, Any]:
    """The assistant message of one sampled reply: content and the parsed tool calls."""
    calls = parse_tool_calls(text) if plan.parse_tools else []
    if calls and all(c.error is None for c in calls):
        content = _TAGGED.sub("", text).strip() if "<tool_call>" in text else ""
        return {"content": content, "tool_calls": [
            {"id": f"{plan.call_prefix}{uuid.uuid4().hex[:24]}", "name": c.name, "arguments": c.arguments}
            for c in calls]}
    return {"content": text, "tool_calls": []}


def _logprob_entries(state: ServerState, plan: ChatPlan, prompt: List[int], action: List[int],
                     logp: List[float]) -> List[Dict[str, Any]]:
    tok = state.tokenizer
    top = None
    if plan.top_logprobs > 0:
        top = top_logprobs(state, plan.logprob_plan(state), prompt, action, False)
        if len(top) != len(action):
            top = None
    out = []
    for j, (tid, lp) in enumerate(zip(action, logp)):
        s = _decode(tok, [tid])
        alts = []
        if top is not None:
            alts = [{"token": name, "logprob": v, "bytes": list(name.encode("utf-8"))} for name, v in top[j].items()]
        out.append({"token": s, "logprob": float(lp), "bytes": list(s.encode("utf-8")), "top_logprobs": alts})
    return out


def _session_lock(s):
    if s.calls is None:
        s.calls = asyncio.Lock()
    return s.calls


async def chat_complete(state: ServerState, sessions: Sessions, req, session_id: Optional[str], *,
                        fixed_sampling: Optional[Dict[str, Any]] = None,
                        default_max_tokens: int = 256) -> Dict[str, Any]:
    """The chat completion for ``req`` (recorded under ``session_id`` when given); see the module doc."""
    plan = plan_chat(state, req, fixed_sampling=fixed_sampling, default_max_tokens=default_max_tokens)
    return await answer_chat(state, sessions, plan, session_id)


async def answer_chat(state: ServerState, sessions: Sessions, plan: ChatPlan,
                      session_id: Optional[str]) -> Dict[str, Any]:
    """Sample the checked ``plan`` (recorded under ``session_id`` when given): the chat completion.

    The one sampling + recording path of every protocol (chat completions, Messages, Responses)."""
    session = sessions.get(session_id, create=True) if session_id else None
    if session is None:
        return await _answer(state, sessions, plan, None)
    async with _session_lock(session):
        return await _answer(state, sessions, plan, session)


async def _answer(state: ServerState, sessions: Sessions, plan: ChatPlan, session) -> Dict[str, Any]:
    tok = state.tokenizer
    if session is not None:
        prompt = sessions.prepare(session, plan)
    else:
        prompt = render_prompt(tok, plan.messages, plan.tools)
    if not prompt:
        raise RequestError("messages: the conversation renders to no tokens", param="messages")
    if max(prompt) >= state.vocab_size:
        raise RequestError(f"messages: token id {max(prompt)} outside the model's vocabulary", param="messages")
    if state.max_model_len is not None and len(prompt) + plan.max_tokens > int(state.max_model_len):
        raise RequestError(f"messages: the conversation has {len(prompt)} tokens; with max_tokens={plan.max_tokens} "
                           f"it exceeds the context length {state.max_model_len}", param="messages")
    eot = end_of_turn_id(tok)
    eos_ids = tuple(sorted({state.eos_id, int(eot)}))
    key = (plan.temperature, plan.top_k, plan.top_p, plan.max_tokens, eos_ids)
    results, version = await asyncio.wrap_future(state.submit([prompt] * plan.n, key, plan.seed))
    sampling = {"temperature": plan.temperature, "top_k": plan.top_k, "top_p": plan.top_p,
                "max_new_tokens": plan.max_tokens, "model": state.model_name, "greedy": plan.temperature == 0,
                "backend": "proxy"}

    def build():
        choices, candidates = [], []
        for i, (action, logp, cut) in enumerate(results):
            action, logp = list(action), [float(x) for x in logp]
            body = action[:-1] if action and not cut and action[-1] in eos_ids else action
            text = _decode(tok, body)
            msg = _message(plan, text)
            candidates.append(Candidate(action_ids=action, logp=logp, cut=bool(cut), version=int(version), text=text,
                                        content=msg["content"], tool_calls=msg["tool_calls"], sampling=sampling))
            message: Dict[str, Any] = {"role": "assistant", "content": msg["content"] or None}
            if msg["tool_calls"]:
                message["tool_calls"] = [
                    {"id": c["id"], "type": "function",
                     "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                    for c in msg["tool_calls"]]
            else:
                message["content"] = msg["content"]
            finish = "length" if cut else ("tool_calls" if msg["tool_calls"] else "stop")
            choices.append({
                "index": i, "message": message,
                "logprobs": {"content": _logprob_entries(state, plan, prompt, action, logp), "refusal": None}
                if plan.logprobs else None,
                "finish_reason": finish, "token_ids": action, "policy_version": int(version),
            })
        return choices, candidates

    choices, candidates = await asyncio.to_thread(build)
    if session is not None:
        sessions.record(session, candidates)
    completion = sum(len(a) for a, _, _ in results)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model_name,
        "system_fingerprint": None,
        "choices": choices,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion,
                  "total_tokens": len(prompt) + completion},
        "policy_version": int(version),
        "session": session.id if session is not None else None,
        "prompt_token_ids": list(prompt),
        "_stream": (plan.stream, plan.include_usage),
    }


def recorded_fields(out: Dict[str, Any]) -> Dict[str, Any]:
    """The extensions a Messages or Responses reply carries, from :func:`answer_chat`'s first choice
    (sampled with ``logprobs``): ``token_ids`` and ``token_logprobs`` (every sampled token, the end of
    turn included), ``policy_version``, ``prompt_token_ids``, ``session``."""
    choice = out["choices"][0]
    return {"token_ids": choice["token_ids"], "token_logprobs": [e["logprob"] for e in choice["logprobs"]["content"]],
            "policy_version": out["policy_version"], "prompt_token_ids": out["prompt_token_ids"],
            "session": out["session"]}


def text_pieces(tokenizer, ids: List[int], content: str) -> List[str]:
    """The text each sampled token adds to ``content`` (the reply's final text), one piece per token.

    A token that ends inside a multi-byte character adds "" (its text comes with a later one); the
    last token's piece completes ``content``, so the pieces join to it."""
    pieces, shown = [], ""
    for j in range(len(ids)):
        text = content if j == len(ids) - 1 else _decode(tokenizer, ids[:j + 1])
        piece = ""
        if text.startswith(shown) and not text.endswith("\ufffd"):
            piece, shown = text[len(shown):], text
        if j == len(ids) - 1 and not content.startswith(shown):
            piece = content
        pieces.append(piece)
    return pieces


def _event(obj: Dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse_chunks(tokenizer, response: Dict[str, Any], include_usage: bool) -> Iterator[str]:
    """The completed ``response`` as OpenAI ``chat.completion.chunk`` events, then ``data: [DONE]``.

    Per choice: the role, the content token by token (each chunk with that token's
    ``logprobs`` when requested), the tool calls in one delta, then the ``finish_reason``;
    with ``include_usage`` a last chunk carries the usage and no choices.
    """
    head = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"], "system_fingerprint": None}

    def chunk(index, delta, logprobs=None, finish=None, **extra):
        c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        c.update(extra)
        return _event({**head, "choices": [c]})

    for choice in response["choices"]:
        i, msg = choice["index"], choice["message"]
        yield chunk(i, {"role": "assistant", "content": ""})
        entries = (choice["logprobs"] or {}).get("content") if choice["logprobs"] else None
        calls = msg.get("tool_calls")
        if calls:
            if msg.get("content"):
                yield chunk(i, {"content": msg["content"]})
            yield chunk(i, {"tool_calls": [dict(c, index=k) for k, c in enumerate(calls)]},
                        {"content": entries, "refusal": None} if entries is not None else None)
        else:
            for j, piece in enumerate(text_pieces(tokenizer, choice["token_ids"], msg["content"])):
                entry = [entries[j]] if entries is not None else None
                if piece or entry is not None:
                    yield chunk(i, {"content": piece}, {"content": entry, "refusal": None} if entry else None)
        yield chunk(i, {}, finish=choice["finish_reason"], token_ids=choice["token_ids"],
                    policy_version=choice["policy_version"])
    if include_usage:
        yield _event({**head, "choices": [], "usage": response["usage"]})
    yield "data: [DONE]\n\n"
