"""``/v1/responses`` with ``stream: true``: a sampled ``Response`` as the Responses server-sent events.

The sequence (each event with its ``sequence_number``): ``response.created`` and
``response.in_progress`` (the response with no output yet); per output item
``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta`` (one per sampled token that adds text), ``response.output_text.done``,
``response.content_part.done``, and for a function call ``response.function_call_arguments.delta``
pieces and ``response.function_call_arguments.done``; then ``response.output_item.done``; last
``response.completed`` (or ``response.incomplete`` when cut at ``max_output_tokens``) with the
whole response, extensions included. The events are sent once the reply is sampled (sampling
is batched, not token by token).
"""
from __future__ import annotations

import json
from typing import Any, Dict, Iterator

from .chat import text_pieces

__all__ = ["response_events"]

_ARGUMENT_PIECE = 16  # characters of a function call's arguments per delta


def response_events(tokenizer, response: Dict[str, Any]) -> Iterator[str]:
    """The server-sent events of ``response`` (a reply of :func:`~trajgrad.serve.responses.create_response`)."""
    seq = iter(range(1 << 30))

    def event(kind: str, **data) -> str:
        body = {"type": kind, "sequence_number": next(seq), **data}
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    late = ("output", "usage", "token_ids", "token_logprobs", "policy_version")
    start = {**{k: v for k, v in response.items() if k not in late}, "status": "in_progress", "output": [],
             "usage": None, "incomplete_details": None}
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    only_text = all(item["type"] == "message" for item in response["output"])
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            empty = {**part, "text": ""}
            yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                        part=empty)
            pieces = text_pieces(tokenizer, response["token_ids"], part["text"]) if only_text else [part["text"]]
            for piece in pieces:
                if piece:
                    yield event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                                delta=piece, logprobs=[])
            yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=[])
            yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part)
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})
            raw = item["arguments"]
            for at in range(0, len(raw), _ARGUMENT_PIECE):
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=raw[at:at + _ARGUMENT_PIECE])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=raw)
        yield event("response.output_item.done", output_index=index, item=item)
    last = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield event(last, response=response)
