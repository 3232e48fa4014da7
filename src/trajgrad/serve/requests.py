"""Completion requests: the accepted fields, and the checked sampling plan of a request.

Fields that would change the distribution without being reflected in the log-probs
(penalties, ``logit_bias``, ``min_p``, stop strings, streaming) are refused unless they
hold their neutral value; unknown fields are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

from ..rollout.chat import encode
from ._fields import finite_field, neutral_field
from .errors import RequestError
from .state import ServerState

__all__ = ["CompletionRequest", "Plan", "ReloadRequest", "plan_request"]

_INT64_MAX = 2**63 - 1
_MAX_LOGPROBS = 20
_MIN_TEMPERATURE = 1e-6


def _schemas():
    from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt

    Number = Union[StrictInt, StrictFloat]

    class CompletionRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")

        model: Optional[str] = None
        prompt: Union[str, List[StrictInt], List[str], List[List[StrictInt]]]
        max_tokens: Optional[StrictInt] = 16
        temperature: Optional[Number] = None
        top_p: Optional[Number] = None
        top_k: Optional[StrictInt] = None
        n: StrictInt = 1
        seed: Optional[StrictInt] = None
        logprobs: Optional[StrictInt] = None
        echo: StrictBool = False
        stop: Optional[Union[str, List[str]]] = None
        stop_token_ids: Optional[List[StrictInt]] = None
        ignore_eos: StrictBool = False
        return_tokens_as_token_ids: Optional[StrictBool] = None
        return_token_ids: Optional[StrictBool] = None
        skip_special_tokens: StrictBool = True
        spaces_between_special_tokens: StrictBool = True
        include_stop_str_in_output: StrictBool = False
        stream: Optional[StrictBool] = False
        user: Optional[str] = None
        # accepted only at their neutral values (they would change the distribution)
        presence_penalty: Optional[Number] = None
        frequency_penalty: Optional[Number] = None
        repetition_penalty: Optional[Number] = None
        min_p: Optional[Number] = None
        min_tokens: Optional[StrictInt] = None
        logit_bias: Optional[Dict[str, Number]] = None
        best_of: Optional[StrictInt] = None
        suffix: Optional[str] = None

    class ReloadRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")

        path: str
        version: StrictInt

    return CompletionRequest, ReloadRequest


CompletionRequest, ReloadRequest = _schemas()


@dataclass
class Plan:
    prompts: List[List[int]]
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    max_tokens: int
    n: int
    seed: Optional[int]
    logprobs: Optional[int]
    echo: bool
    eos_ids: Tuple[int, ...]
    as_ids: bool
    skip_special: bool


def plan_request(state: ServerState, req) -> Plan:
    if req.model is not None and req.model != state.model_name:
        raise RequestError(f"model: the model `{req.model}` does not exist (this server serves `{state.model_name}`)",
                           param="model", status=404)
    if req.stream:
        raise RequestError("stream: streaming is not supported; send stream=false", param="stream")
    stop = req.stop
    if stop not in (None, "", []):
        raise RequestError("stop: stop strings are not supported; use stop_token_ids", param="stop")
    for name, neutral in (("presence_penalty", (0, 0.0)), ("frequency_penalty", (0, 0.0)),
                          ("repetition_penalty", (1, 1.0)), ("min_p", (0, 0.0)), ("min_tokens", (0,))):
        neutral_field(req, name, neutral)
    if req.logit_bias:
        raise RequestError("logit_bias: not supported (the reported log-probs would not describe it)",
                           param="logit_bias")
    if req.suffix:
        raise RequestError("suffix: not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of: only best_of == n (or omitted) is supported", param="best_of")

    temperature = 1.0 if req.temperature is None else finite_field("temperature", req.temperature)
    if temperature < 0:
        raise RequestError(f"temperature: must be >= 0 (0 = greedy), got {req.temperature!r}", param="temperature")
    if 0 < temperature < _MIN_TEMPERATURE:
        raise RequestError(
            f"temperature: positive values below {_MIN_TEMPERATURE} are not supported (the scaled logits can "
            f"overflow); use 0 for greedy, "
            f"got {req.temperature!r}",
            param="temperature",
        )
    top_p = None
    if req.top_p is not None:
        top_p = finite_field("top_p", req.top_p)
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"top_p: must lie in (0, 1], got {req.top_p!r}", param="top_p")
        if top_p == 1.0:
            top_p = None
    top_k = req.top_k
    if top_k is not None:
        if top_k < -1:
            raise RequestError(f"top_k: must be -1 or 0 (off) or >= 1, got {top_k}", param="top_k")
        if top_k <= 0:
            top_k = None
    n = req.n
    if n < 1:
        raise RequestError(f"n: must be >= 1, got {n}", param="n")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens < 0 or (max_tokens == 0 and not req.echo):
        raise RequestError(f"max_tokens: must be >= 1 (0 only with echo), got {max_tokens}", param="max_tokens")
    if max_tokens > state.max_tokens_limit:
        raise RequestError(f"max_tokens: at most {state.max_tokens_limit}, got {max_tokens}", param="max_tokens")
    logprobs = req.logprobs
    if logprobs is not None and not 0 <= logprobs <= _MAX_LOGPROBS:
        raise RequestError(f"logprobs: must lie in [0, {_MAX_LOGPROBS}], got {logprobs}", param="logprobs")
    seed = req.seed
    if seed is not None:
        if not -(2**63) <= seed <= _INT64_MAX:
            raise RequestError(f"seed: must fit in a signed 64-bit integer, got {seed}", param="seed")
        seed = seed & 0xFFFFFFFFFFFFFFFF

    raw = req.prompt
    if isinstance(raw, str):
        items: List[Union[str, List[int]]] = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [list(raw)]
    else:
        items = list(raw)
    if not items:
        raise RequestError("prompt: empty", param="prompt")
    prompts: List[List[int]] = []
    for i, item in enumerate(items):
        ids = encode(state.tokenizer, item) if isinstance(item, str) else list(item)
        if not ids:
            raise RequestError(f"prompt: prompt {i} is empty", param="prompt")
        low, high = min(ids), max(ids)
        if low < 0 or high >= state.vocab_size:
            bad = low if low < 0 else high
            raise RequestError(f"prompt: token id {bad} outside the vocabulary [0, {state.vocab_size})", param="prompt")
        if state.max_model_len is not None and len(ids) + max_tokens > int(state.max_model_len):
            raise RequestError(
                f"prompt: prompt {i} has {len(ids)} tokens; with max_tokens={max_tokens} it exceeds the "
                f"context length {state.max_model_len}",
                param="prompt",
            )
        prompts.append(ids)
    if len(prompts) * n > state.max_batch_rows:
        raise RequestError(
            f"n: {len(prompts)} prompt(s) x n={n} exceeds the server limit of {state.max_batch_rows} rows", param="n"
        )
    stop_ids = list(req.stop_token_ids or [])
    for t in stop_ids:
        if not 0 <= t < state.vocab_size:
            raise RequestError(f"stop_token_ids: token id {t} outside the vocabulary", param="stop_token_ids")
    eos = set(stop_ids)
    if not req.ignore_eos:
        eos.add(state.eos_id)
    return Plan(
        prompts=prompts, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, n=n, seed=seed,
        logprobs=logprobs, echo=bool(req.echo), eos_ids=tuple(sorted(eos)),
        as_ids=bool(req.return_tokens_as_token_ids), skip_special=bool(req.skip_special_tokens),
    )
