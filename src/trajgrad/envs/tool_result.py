"""The outcome of one tool call, as the agent sees it (§22).

Its own module so that the tool registry (:mod:`.tools`) and the sandbox
(:mod:`.sandbox`) both use it without importing each other.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

__all__ = ["ToolResult"]


class ToolResult(NamedTuple):
    """The outcome of one tool call, as the agent will see it.

    Attributes:
      output: the text the tool produced (may be empty; may be partial on error).
      error: ``None`` on success, else a short message meant for the agent.
    """

    output: str
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_text(self) -> str:
        """One string for an observation: the output, or ``"error: ..."``."""
        if self.error is None:
            return self.output
        return f"error: {self.error}"
