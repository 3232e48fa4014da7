"""Chat-completion requests: the accepted fields, message normalization, and the checked plan.

The messages of a request are normalized to what :mod:`trajgrad.rollout.chat` renders:
``{"role", "content"}`` with string content (text parts joined, ``developer`` read as
``system``); an assistant message's structured ``tool_calls`` become their Hermes text
(``<tool_call>{...}</tool_call>``) unless the session recognizes the message as one it
served, in which case the sampled text is rendered verbatim (:mod:`trajgrad.serve.sessions`).
Tool messages keep their ``name`` when given.

Fields that would change the distribution without being reflected in the log-probs
(penalties, ``logit_bias``, stop strings, structured output, forced tool choices) are
refused with 400 naming the field unless they hold their neutral value.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from ..envs.toolcalls import format_tool_call
from ..rollout.chat import prompt_ids
from .errors import RequestError
from ._fields import finite_field, neutral_field
from .requests import Plan
from .state import ServerState

__all__ = ["ChatRequest", "ChatPlan", "SamplingRequest", "RewardRequest", "plan_chat", "normalize_messages",
           "canonical_tools", "function_tool", "join_text", "render_prompt"]

_MAX_TOP_LOGPROBS = 20
_MIN_TEMPERATURE = 1e-6
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _schemas():
    from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt

    Number = Union[StrictInt, StrictFloat]

    class SamplingRequest(BaseModel):
        """The fields every chat-like request (chat completions, Messages, Responses) shares."""

        model_config = ConfigDict(extra="forbid")

        model: Optional[str] = None
        tools: Optional[List[Dict[str, Any]]] = None
        temperature: Optional[Number] = None
        top_p: Optional[Number] = None
        top_k: Optional[StrictInt] = None
        stream: Optional[StrictBool] = False
        metadata: Optional[Dict[str, Any]] = None

    class ChatRequest(SamplingRequest):
        messages: List[Dict[str, Any]]
        tool_choice: Optional[Union[str, Dict[str, Any]]] = None
        parallel_tool_calls: Optional[StrictBool] = None
        max_tokens: Optional[StrictInt] = None
        max_completion_tokens: Optional[StrictInt] = None
        seed: Optional[StrictInt] = None
        logprobs: Optional[StrictBool] = None
        top_logprobs: Optional[StrictInt] = None
        n: StrictInt = 1
        stream_options: Optional[Dict[str, Any]] = None
        user: Optional[str] = None
        store: Optional[StrictBool] = None
        # accepted only at their neutral values (they would change the distribution)
        stop: Optional[Union[str, List[str]]] = None
        presence_penalty: Optional[Number] = None
        frequency_penalty: Optional[Number] = None
        repetition_penalty: Optional[Number] = None
        min_p: Optional[Number] = None
        logit_bias: Optional[Dict[str, Number]] = None
        response_format: Optional[Dict[str, Any]] = None

    class RewardRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")

        reward: Number
        success: Optional[StrictBool] = None
        info: Optional[Dict[str, Any]] = None

    return SamplingRequest, ChatRequest, RewardRequest


SamplingRequest, ChatRequest, RewardRequest = _schemas()


@dataclass
class ChatPlan:
    """The checked sampling settings and the normalized conversation of one request."""

    messages: List[Dict[str, Any]]  # normalized, structured tool calls kept (for matching)
    tools: Optional[List[Dict[str, Any]]]
    parse_tools: bool
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    max_tokens: int
    n: int
    seed: Optional[int]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    call_prefix: str = "call_"  # the prefix of the ids given to parsed tool calls

    def logprob_plan(self, state: ServerState) -> Plan:
        """The completions :class:`~trajgrad.serve.requests.Plan` that ``top_logprobs`` reads."""
        return Plan(prompts=[], temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                    max_tokens=self.max_tokens, n=self.n, seed=self.seed, logprobs=self.top_logprobs, echo=False,
                    eos_ids=(), as_ids=False, skip_special=True)


def _content(i: int, m: Dict[str, Any]) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for k, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text") \
                    or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content[{k}]: only text parts are supported, got {part!r:.80}",
                                   param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content: expected a string or a list of text parts, got "
                       f"{type(c).__name__}", param=f"messages[{i}].content")


def join_text(content: Any, where: str, kinds: Tuple[str, ...]) -> str:
    """``content`` as one string: a string, or a list of ``{"type": <one of kinds>, "text": ...}`` parts
    joined; a :class:`RequestError` naming ``where`` (or the bad part's ``type``) otherwise."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: expected a string or a list of text parts, got {type(content).__name__}",
                           param=where)
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{k}].type: only {' / '.join(kinds)} parts with a text are supported here, "
                               f"got {kind!r}", param=f"{where}[{k}].type")
        parts.append(part["text"])
    return "".join(parts)


def function_tool(k: int, tool: Dict[str, Any], schema_key: str) -> Dict[str, Any]:
    """``tools[k]`` of a Messages (``schema_key="input_schema"``) or Responses (``"parameters"``) request as
    the chat template's OpenAI function schema. ``strict`` is refused: it needs constrained decoding."""
    if tool.get("strict"):
        raise RequestError(f"tools[{k}].strict: strict arguments need constrained decoding, which changes the "
                           f"sampling distribution; omit it or send false", param=f"tools[{k}].strict")
    fn = {"name": tool["name"]}
    if tool.get("description"):
        fn["description"] = tool["description"]
    if tool.get(schema_key) is not None:
        fn["parameters"] = tool[schema_key]
    return {"type": "function", "function": fn}


def _tool_calls(i: int, calls: Any) -> List[Dict[str, Any]]:
    """Structured tool calls as ``[{"id", "name", "arguments": dict}]``."""
    if not isinstance(calls, list):
        raise RequestError(f"messages[{i}].tool_calls: expected a list, got {type(calls).__name__}",
                           param=f"messages[{i}].tool_calls")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise RequestError(f"messages[{i}].tool_calls[{k}].function.name: required (a non-empty string)",
                               param=f"messages[{i}].tool_calls")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise RequestError(f"messages[{i}].tool_calls[{k}].function.arguments: not valid JSON",
                                   param=f"messages[{i}].tool_calls") from None
        if not isinstance(args, dict):
            raise RequestError(f"messages[{i}].tool_calls[{k}].function.arguments: must encode a JSON object",
                               param=f"messages[{i}].tool_calls")
        out.append({"id": call.get("id"), "name": name, "arguments": args})
    return out


def normalize_messages(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The request's messages as ``{"role", "content"[, "tool_calls"][, "name"]}`` (see module doc)."""
    if not messages:
        raise RequestError("messages: must contain at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in _ROLES:
            raise RequestError(f"messages[{i}].role: expected one of {sorted(_ROLES)}, got {role!r}",
                               param=f"messages[{i}].role")
        msg: Dict[str, Any] = {"role": _ROLES[role], "content": _content(i, m)}
        if m.get("tool_calls"):
            if role != "assistant":
                raise RequestError(f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                                   param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = _tool_calls(i, m["tool_calls"])
        if role == "tool" and isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def rendered(message: Dict[str, Any]) -> Dict[str, Any]:
    """A normalized message as the chat template renders it: tool calls as Hermes text."""
    msg = {"role": message["role"], "content": message["content"]}
    calls = message.get("tool_calls")
    if calls:
        text = "".join(format_tool_call(c["name"], c["arguments"]) for c in calls)
        msg["content"] = message["content"] + text
    if "name" in message:
        msg["name"] = message["name"]
    return msg


def render_prompt(tokenizer, messages: List[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]]) -> List[int]:
    """The prompt tokens of normalized ``messages`` rendered afresh by the chat template; a
    :class:`RequestError` naming ``tools`` or ``messages`` when the template refuses them."""
    try:
        return prompt_ids(tokenizer, [rendered(m) for m in messages], tools)
    except ValueError as exc:
        raise RequestError(str(exc), param="tools" if str(exc).startswith("tools") else "messages") from None


def canonical_tools(tools: Optional[List[Dict[str, Any]]]) -> Optional[List[Dict[str, Any]]]:
    if not tools:
        return None
    for k, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"tools[{k}]: expected an OpenAI function tool {{\"type\": \"function\", "
                               f"\"function\": {{\"name\", \"description\", \"parameters\"}}}}", param="tools")
    return [dict(t) for t in tools]


def _sampling(state: ServerState, req, fixed: Optional[Dict[str, Any]]) -> Tuple[float, Optional[int], Optional[float]]:
    temperature = 1.0 if req.temperature is None else finite_field("temperature", req.temperature)
    if temperature < 0:
        raise RequestError(f"temperature: must be >= 0 (0 = greedy), got {req.temperature!r}", param="temperature")
    if 0 < temperature < _MIN_TEMPERATURE:
        raise RequestError(f"temperature: positive values below {_MIN_TEMPERATURE} are not supported; use 0 for "
                           f"greedy, got {req.temperature!r}", param="temperature")
    top_p = None
    if req.top_p is not None:
        top_p = finite_field("top_p", req.top_p)
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"top_p: must lie in (0, 1], got {req.top_p!r}", param="top_p")
        top_p = None if top_p == 1.0 else top_p
    top_k = req.top_k
    if top_k is not None:
        if top_k < -1:
            raise RequestError(f"top_k: must be -1 or 0 (off) or >= 1, got {top_k}", param="top_k")
        top_k = None if top_k <= 0 else top_k
    if fixed is not None:  # a trainer's server: the learner recomputes under these settings
        for name, given, value, was_set in (("temperature", temperature, fixed["temperature"], req.temperature),
                                            ("top_k", top_k, fixed["top_k"], req.top_k),
                                            ("top_p", top_p, fixed["top_p"], req.top_p)):
            if was_set is not None and given != value:
                raise RequestError(f"{name}: this server samples for training at {name}={value!r} (the run's "
                                   f"sampling.{name}); omit {name} or send {value!r}", param=name)
        temperature, top_k, top_p = fixed["temperature"], fixed["top_k"], fixed["top_p"]
    return temperature, top_k, top_p


def plan_chat(state: ServerState, req, *, fixed_sampling: Optional[Dict[str, Any]] = None,
              default_max_tokens: int = 256) -> ChatPlan:
    """Check every field of ``req`` (a :class:`ChatRequest`); a :class:`RequestError` names the first bad one."""
    if req.model is not None and req.model != state.model_name and not getattr(state, "accept_any_model", False):
        raise RequestError(f"model: the model `{req.model}` does not exist (this server serves `{state.model_name}`)",
                           param="model", status=404)
    if req.stop not in (None, "", []):
        raise RequestError("stop: stop strings are not supported (the model stops at its end-of-turn token)",
                           param="stop")
    for name, neutral in (("presence_penalty", (0, 0.0)), ("frequency_penalty", (0, 0.0)),
                          ("repetition_penalty", (1, 1.0)), ("min_p", (0, 0.0))):
        neutral_field(req, name, neutral)
    if req.logit_bias:
        raise RequestError("logit_bias: not supported (the reported log-probs would not describe it)",
                           param="logit_bias")
    if req.response_format not in (None, {"type": "text"}):
        raise RequestError("response_format: only {\"type\": \"text\"} is supported (constrained decoding would "
                           "change the sampling distribution)", param="response_format")
    tools = canonical_tools(req.tools)
    choice = req.tool_choice
    if isinstance(choice, dict) or choice not in (None, "auto", "none"):
        raise RequestError("tool_choice: only 'auto' and 'none' are supported (forcing a call would need "
                           "constrained decoding, which changes the sampling distribution)", param="tool_choice")
    if choice == "none" and tools is None:
        choice = None
    temperature, top_k, top_p = _sampling(state, req, fixed_sampling)
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise RequestError("max_completion_tokens: differs from max_tokens; send one of them",
                           param="max_completion_tokens")
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = default_max_tokens if given is None else given
    if max_tokens < 1:
        raise RequestError(f"{name}: must be >= 1, got {max_tokens}", param=name)
    if max_tokens > state.max_tokens_limit:
        raise RequestError(f"{name}: at most {state.max_tokens_limit}, got {max_tokens}", param=name)
    if req.n < 1:
        raise RequestError(f"n: must be >= 1, got {req.n}", param="n")
    if req.n > state.max_batch_rows:
        raise RequestError(f"n: at most {state.max_batch_rows}, got {req.n}", param="n")
    top = req.top_logprobs
    if top is not None:
        if not req.logprobs:
            raise RequestError("top_logprobs: needs logprobs=true", param="top_logprobs")
        if not 0 <= top <= _MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs: must lie in [0, {_MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs")
    seed = req.seed
    if seed is not None:
        if not -(2**63) <= seed < 2**63:
            raise RequestError(f"seed: must fit in a signed 64-bit integer, got {seed}", param="seed")
        seed = seed & 0xFFFFFFFFFFFFFFFF
    opts = req.stream_options or {}
    if set(opts) - {"include_usage", "include_obfuscation"}:
        raise RequestError(f"stream_options: unknown option(s) {sorted(set(opts) - {'include_usage'})}",
                           param="stream_options")
    if opts and not req.stream:
        raise RequestError("stream_options: only with stream=true", param="stream_options")
    return ChatPlan(
        messages=normalize_messages(req.messages), tools=tools, parse_tools=tools is not None and choice != "none",
        temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, n=req.n, seed=seed,
        logprobs=bool(req.logprobs), top_logprobs=int(top or 0), stream=bool(req.stream),
        include_usage=bool(opts.get("include_usage")),
    )
