"""``/v1/messages`` with ``stream: true``: a sampled ``Message`` as the Messages server-sent events.

The sequence: ``message_start`` (the message with empty ``content``), then per content block
``content_block_start``, its deltas (``text_delta`` pieces, one per sampled token that adds
text; a ``tool_use`` block's input as ``input_json_delta`` pieces of its JSON), and
``content_block_stop``; then ``message_delta`` (``stop_reason``, the output token count) and
``message_stop``. The events are sent once the reply is sampled (sampling is batched, not
token by token). The extensions of the reply (``token_ids``, ``token_logprobs``,
``policy_version``) come in ``message_delta``; ``prompt_token_ids`` and ``session`` in
``message_start``.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Iterator

from .chat import text_pieces

__all__ = ["message_events"]

_JSON_PIECE = 16  # characters of a tool input per input_json_delta


def _event(kind: str, data: Dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"


def message_events(tokenizer, message: Dict[str, Any]) -> Iterator[str]:
    """The server-sent events of ``message`` (a reply of :func:`~trajgrad.serve.messages.create_message`)."""
    late = ("token_ids", "token_logprobs", "policy_version")
    head = {k: v for k, v in message.items() if k not in late}
    usage = message["usage"]
    yield _event("message_start", {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0}}})
    only_text = all(b["type"] == "text" for b in message["content"])
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
            # the reply is all text: one delta per sampled token; beside tool calls the text is trimmed: one delta
            pieces = text_pieces(tokenizer, message["token_ids"], block["text"]) if only_text else [block["text"]]
            for piece in pieces:
                if piece:
                    yield _event("content_block_delta", {"index": index,
                                                         "delta": {"type": "text_delta", "text": piece}})
        else:
            yield _event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
            raw = json.dumps(block["input"])
            for start in range(0, len(raw), _JSON_PIECE):
                yield _event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": raw[start:start + _JSON_PIECE]}})
        yield _event("content_block_stop", {"index": index})
    yield _event("message_delta", {"delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                                   "usage": {"output_tokens": usage["output_tokens"]},
                                   **{k: message[k] for k in late}})
    yield _event("message_stop", {})
