"""The parent's strict reading of the sandbox runner's result channel (§22).

The runner writes JSON lines on a pipe: exactly one ``{"kind": "ready"}`` first (before
any user code runs), then any number of ``{"kind": "violation", "message": str}``
(from the in-process guards), then one ``{"kind": "result", "value": str|None,
"error": str|None}`` last. The user code runs in the same process and can write to the
pipe too; it cannot take back what the runner already wrote, so the one way to hide a
violation frame is to make it unreadable (an unfinished frame before it swallows it).
Hence this reading accepts nothing else: a line that is not one of these frames with
exactly these keys, an unfinished last line, a second ``ready``, a second ``result`` or a
frame after the ``result`` is *tampering*, which the parent reports as a violation of
its own. Each frame the runner writes is at most a few KiB and written whole, so an
honest run never produces any of these.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import List, Optional

__all__ = ["Channel", "read_channel", "UNFINISHED"]

_MAX_FRAME_BYTES = 1 << 20
UNFINISHED = "an unfinished frame at the end"
_KEYS = {"ready": {"kind"}, "violation": {"kind", "message"}, "result": {"kind", "value", "error"}}


@dataclass
class Channel:
    """What the channel said: whether the runner got ready, the violations it reported,
    the result frame (None if none), and the first way the channel was tampered with."""

    ready: bool = False
    violations: List[str] = field(default_factory=list)
    result: Optional[dict] = None
    tampered: Optional[str] = None


def _frame(line: bytes) -> Optional[dict]:
    if len(line) > _MAX_FRAME_BYTES:
        return None
    try:
        frame = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(frame, dict) or set(frame) != _KEYS.get(frame.get("kind"), ()):
        return None
    if frame["kind"] == "violation" and not isinstance(frame["message"], str):
        return None
    if frame["kind"] == "result" and not all(v is None or isinstance(v, str) for v in (frame["value"], frame["error"])):
        return None
    return frame


def read_channel(data: bytes) -> Channel:
    """Parse the whole channel (bytes up to EOF) strictly; see the module docstring."""
    out = Channel()
    lines = data.split(b"\n")
    if lines[-1]:
        out.tampered = UNFINISHED
    for index, line in enumerate(lines[:-1]):
        frame = _frame(line)
        problem = None
        if frame is None:
            problem = "a malformed frame"
        elif index == 0:
            out.ready = frame["kind"] == "ready"
            problem = None if out.ready else "the first frame is not 'ready'"
        elif out.result is not None:
            problem = "a frame after the result"
        elif frame["kind"] == "ready":
            problem = "a second 'ready' frame"
        elif frame["kind"] == "violation":
            out.violations.append(frame["message"])
        else:
            out.result = frame
        if problem and out.tampered is None:
            out.tampered = problem
    return out
