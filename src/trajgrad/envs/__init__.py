"""Environments, tools, the Python sandbox and the built-in tasks (§19, §21, §22).

The core layers never import this package. Task sources: ``"calculator"`` and
``"guess"`` (see :func:`get_task_source`).
"""
from .base import (
    Environment,
    Message,
    StepResult,
    Task,
    TaskSource,
    available_task_sources,
    extract_tag,
    get_task_source,
    register_task_source,
)

__all__ = [
    "Environment",
    "Message",
    "StepResult",
    "Task",
    "TaskSource",
    "available_task_sources",
    "extract_tag",
    "get_task_source",
    "register_task_source",
]
