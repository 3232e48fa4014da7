"""Token strings and top-``logprobs`` alternatives, shared by ``/v1/completions`` and ``/v1/chat/completions``."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch

from ..logprobs import sampling_logits
from ..model.learner import head_inputs
from .requests import Plan
from .state import ServerState


def token_strings(tokenizer, ids: Sequence[int], as_ids: bool) -> List[str]:
    if as_ids:
        return [f"token_id:{i}" for i in ids]
    return [tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids]


def top_logprobs(state: ServerState, plan: Plan, prompt: List[int], completion: List[int],
                 echo_positions: bool) -> List[Optional[Dict[str, float]]]:
    """Top-``logprobs`` alternatives at each reported position (recomputed in one forward)."""
    k = plan.logprobs
    seq = prompt + completion
    ids = torch.as_tensor([seq], dtype=torch.long, device=state.device)
    am = torch.ones_like(ids)
    with state.lock, torch.no_grad():
        hidden, weight, bias = head_inputs(state.model, ids, am)
        logits = hidden[0] @ weight.T
        if bias is not None:
            logits = logits + bias
    first = 0 if echo_positions else len(prompt) - 1
    rows = logits[first:]
    if plan.temperature > 0:
        rows = torch.log_softmax(sampling_logits(rows, temperature=plan.temperature, top_k=plan.top_k,
                                                 top_p=plan.top_p), dim=-1)
    else:
        rows = torch.log_softmax(rows, dim=-1)
    vals, idx = rows.topk(min(k, rows.shape[-1]), dim=-1)
    out: List[Optional[Dict[str, float]]] = [None] if echo_positions else []
    for v_row, i_row in zip(vals.tolist(), idx.tolist()):
        names = token_strings(state.tokenizer, i_row, plan.as_ids)
        out.append({name: v for name, v in zip(names, v_row) if math.isfinite(v)})
    return out
