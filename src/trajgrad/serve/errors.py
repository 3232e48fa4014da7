"""Client errors of ``trajgrad serve``: error bodies that name the field, in OpenAI's shape or Anthropic's.

OpenAI's (every endpoint but ``/v1/messages``): ``{"error": {"message", "type", "param", "code"}}``.
Anthropic's (``/v1/messages``): ``{"type": "error", "error": {"type", "message"}}``, the message
starting with the field's name."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["RequestError", "anthropic_error_body", "error_body", "validation_message"]


class RequestError(ValueError):
    """A client error: becomes an HTTP 4xx response naming the offending field."""

    def __init__(self, message: str, *, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status



def error_body(message: str, status: int, param: Optional[str]) -> Dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 404:
        kind = "not_found_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    529: "overloaded_error"}


def anthropic_error_body(message: str, status: int) -> Dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


_EXPECTED = {
    "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
    "list_type": "a list", "dict_type": "an object",
}


def validation_message(errors: Sequence[Dict[str, Any]]) -> Tuple[str, Optional[str]]:
    """One readable line per field from pydantic's errors (the first field is the param)."""
    grouped: Dict[str, List[Dict[str, Any]]] = {}
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        grouped.setdefault(loc[0] if loc else "body", []).append(err)
    lines = []
    for name, errs in grouped.items():
        types = {e.get("type", "") for e in errs}
        got = errs[0].get("input")
        if "json_invalid" in types:
            lines.append("body: invalid JSON")
        elif "extra_forbidden" in types:
            lines.append(f"{name}: unknown or unsupported field")
        elif "missing" in types:
            lines.append(f"{name}: required field is missing")
        elif name == "prompt":
            lines.append("prompt: must be a string, a list of token ids, a list of strings or a list of token-id lists")
        elif {"int_type", "float_type"} <= types:
            lines.append(f"{name}: expected a number, got {got!r}")
        elif types & set(_EXPECTED):
            kind = next(_EXPECTED[t] for t in _EXPECTED if t in types)
            lines.append(f"{name}: expected {kind}, got {got!r}")
        else:
            lines.append(f"{name}: {errs[0].get('msg', 'invalid value')} (got {got!r})")
    if not lines:
        return "body: invalid request", None
    return "; ".join(lines), next(iter(grouped))
