"""``/v1/completions``: sample (through the batcher), score echoed prompts, and build choices."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Dict, List, Optional

from ._tokens import token_strings, top_logprobs
from .requests import Plan, plan_request
from .state import ServerState

__all__ = ["complete"]


def _choice(state: ServerState, plan: Plan, index: int, prompt: List[int], action: List[int], logp: List[float],
            cut: bool, version: int, prompt_logp: Optional[List[Optional[float]]]) -> Dict[str, Any]:
    tok = state.tokenizer
    text = tok.decode(action, skip_special_tokens=plan.skip_special, clean_up_tokenization_spaces=False)
    shown = list(action)
    shown_logp: List[Optional[float]] = [float(x) for x in logp]
    if plan.echo:
        text = tok.decode(prompt, skip_special_tokens=plan.skip_special, clean_up_tokenization_spaces=False) + text
        shown = list(prompt) + shown
        shown_logp = list(prompt_logp or [None] * len(prompt)) + shown_logp
    finish = "length" if cut or not action else "stop"
    choice: Dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": action[-1] if finish == "stop" and action else None,
        "token_ids": list(action),
        "policy_version": version,
    }
    if plan.logprobs is not None:
        decoded = token_strings(tok, shown, False)
        tokens = token_strings(tok, shown, True) if plan.as_ids else decoded
        offsets, pos = [], 0
        for piece in decoded:
            offsets.append(pos)
            pos += len(piece)
        top = None
        if plan.logprobs > 0:
            top = top_logprobs(state, plan, prompt, action, plan.echo)
            if len(top) != len(shown):  # defensive: never return misaligned lists
                top = None
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": shown_logp, "top_logprobs": top,
                              "text_offset": offsets}
    return choice


async def complete(state: ServerState, req) -> Dict[str, Any]:
    plan = plan_request(state, req)
    rows = [p for p in plan.prompts for _ in range(plan.n)]
    prompt_scores: List[Optional[List[Optional[float]]]] = [None] * len(plan.prompts)
    version_scored = None
    if plan.echo and plan.logprobs is not None:
        scores, version_scored = await asyncio.to_thread(
            state.score, plan.prompts, temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p
        )
        prompt_scores = list(scores)
    if plan.max_tokens > 0:
        key = (plan.temperature, plan.top_k, plan.top_p, plan.max_tokens, plan.eos_ids)
        results, version = await asyncio.wrap_future(state.submit(rows, key, plan.seed))
    else:
        results = [([], [], False)] * len(rows)
        version = version_scored if version_scored is not None else state.policy_version

    def build() -> List[Dict[str, Any]]:
        out = []
        for i, (action, logp, cut) in enumerate(results):
            p = i // plan.n
            out.append(_choice(state, plan, i, plan.prompts[p], action, logp, cut, version, prompt_scores[p]))
            out[-1]["prompt_index"] = p
        return out

    choices = await asyncio.to_thread(build)
    completion_tokens = sum(len(a) for a, _, _ in results)
    prompt_tokens = sum(len(p) for p in plan.prompts)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "policy_version": version,
    }
