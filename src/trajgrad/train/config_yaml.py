"""The YAML of a training config: a file's text, ``--set key=value`` items.

A YAML mapping that gives a key twice is refused, naming its dotted path (``yaml.safe_load``
keeps the last silently); values of ``--set`` are YAML too.
"""
from __future__ import annotations

import re
from typing import Any, Dict

import yaml


def _check_unique_keys(node, path: str, what: str) -> None:
    """Refuse a YAML mapping that gives a key twice (``yaml.safe_load`` keeps the last silently)."""
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            dotted = f"{path}.{key}" if path else str(key)
            if key is not None:
                if key in seen:
                    raise ValueError(f"{dotted}: given twice in {what} (line {key_node.start_mark.line + 1})")
                seen.add(key)
            _check_unique_keys(value_node, dotted, what)
    elif isinstance(node, yaml.SequenceNode):
        for k, item in enumerate(node.value):
            _check_unique_keys(item, f"{path}.{k}" if path else str(k), what)


def parse_yaml(text: str, *, what: str) -> Any:
    """YAML ``text`` (safe types only) or ValueError naming ``what``; a key given twice is refused,
    naming its dotted path."""
    try:
        _check_unique_keys(yaml.compose(text, Loader=yaml.SafeLoader), "", what)
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ValueError(" ".join(f"{what}: invalid YAML{where}: {problem}".split())) from None


_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


def parse_overrides(items) -> Dict[str, Any]:
    """``["train.steps=3", ...]`` -> ``{"train.steps": 3}``; values are YAML.

    Raises ValueError naming the key for a missing ``=``, a malformed dotted key, a key given
    twice, or a value that is not valid YAML.
    """
    out: Dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set: expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        key = key.strip()
        if not _DOTTED.match(key):
            raise ValueError(f"--set: {key!r} is not a dotted key such as train.steps")
        if key in out:
            raise ValueError(f"{key}: given twice with --set")
        clash = [k for k in out if k.startswith(key + ".") or key.startswith(k + ".")]
        if clash:
            raise ValueError(f"{key}: overlaps {clash[0]} (both given with --set)")
        out[key] = parse_yaml(value, what=key)
    return out
