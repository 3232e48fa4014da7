"""The configuration reference, generated from the schema: ``trajgrad config --schema`` (JSON
Schema) and ``trajgrad config --markdown`` (``docs/config.md``).

Every key of :class:`~trajgrad.train.config.Config` (dotted), its type, default and
description (the pydantic ``Field`` descriptions, the sections' docstrings), and which
recipes read it (:data:`READ_BY`, evaluated on every recipe at its defaults). The free-form
dicts get their own sections: ``recipe.overrides`` (the fields of
:class:`~trajgrad.objective.Objective`, described by its docstring, with the recipes that
read each one), ``task.options`` of each built-in task source (its options dataclass and
docstring) and ``task.options.adapter`` (the gymnasium and verifiers adapters' keyword
arguments). A test regenerates the Markdown and compares it with ``docs/config.md``.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import re
import typing
from typing import Any, Callable, Dict, List, Tuple

from pydantic import BaseModel

from ..envs.adapters.gym import GymSource
from ..envs.adapters.verifiers import VerifiersSource
from ..envs.calculator import CalculatorConfig
from ..envs.dataset import DatasetConfig
from ..envs.guess import GuessConfig
from ..objective import RECIPES, Objective
from .config import Config

# keys (prefix match, longest first) read only by some recipes: a predicate on the Objective
READ_BY: Dict[str, Callable[[Objective], bool]] = {
    "critic.": lambda o: o.critic,
    "reference.": lambda o: o.uses_reference,
    "teacher.": lambda o: o.kind == "distill",
    "dpo.": lambda o: o.kind == "pairwise",
    "train.group_size": lambda o: o.kind == "token",
    "train.dynamic_sampling_max_tries": lambda o: o.dynamic_sampling,
    "train.skip_zero_gradient_rows": lambda o: o.kind == "token" and o.zero_without_advantage,
    "train.epochs_per_batch": lambda o: o.kind == "token",
    "train.old_logp": lambda o: o.uses_old_logp,
    "train.no_signal_steps": lambda o: o.kind == "token",
    "train.stop_on_no_signal": lambda o: o.kind == "token",
    "task.shaping": lambda o: o.kind == "token",
    "constraint.": lambda o: o.kind == "token",
}

_TYPE_NAMES = {"NoneType": "null", "str": "string", "int": "integer", "float": "number", "bool": "boolean"}


def _type_name(ann: Any) -> str:
    """A short readable type: ``integer or null``, ``'hf' | 'openai'``, ``list of string``."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is typing.Union:
        return " or ".join(_type_name(a) for a in args)
    if origin in (list, List):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin in (dict, Dict):
        return f"mapping {_type_name(args[0])} to {_type_name(args[1])}" if args else "mapping"
    if origin is typing.Annotated:
        return _type_name(args[0])
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    name = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
    return {"Any": "any"}.get(name, _TYPE_NAMES.get(name, name))


def _default(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "(section)"
    if dataclasses.is_dataclass(value):
        return "off" if not value else json.dumps(dataclasses.asdict(value))
    return json.dumps(value, ensure_ascii=False, default=str)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _doc_summary(cls) -> str:
    doc = inspect.getdoc(cls) or ""
    return " ".join(doc.split("\n\n")[0].split()) if doc and cls.__doc__ else ""


def _read_by(key: str) -> str:
    for prefix in sorted(READ_BY, key=len, reverse=True):
        if key == prefix or key.startswith(prefix):
            names = [n for n, o in RECIPES.items() if READ_BY[prefix](o)]
            return ", ".join(names) if names else "none at their defaults"
    return "all"


def config_rows(model=Config, prefix: str = "") -> List[Tuple[str, str, str, str, str]]:
    """``(dotted key, type, default, description, read by)`` for every key of the schema."""
    rows = []
    for name, f in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = f.annotation
        sub = [a for a in (typing.get_args(ann) or (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        desc = f.description or ""
        if sub and not desc:
            desc = _doc_summary(sub[0])
        rows.append((key, _type_name(ann), _default(f.default), desc, _read_by(key)))
        if sub:
            rows += config_rows(sub[0], key + ".")
    return rows


def _attribute_docs(cls) -> Dict[str, str]:
    """Field -> text from a Google-style ``Attributes:`` docstring (``a, b: text`` entries)."""
    doc = inspect.getdoc(cls) or ""
    if "Attributes:" not in doc:
        return {}
    out: Dict[str, str] = {}
    names: List[str] = []
    for line in doc.split("Attributes:", 1)[1].splitlines():
        m = re.match(r"^  ([A-Za-z_][\w, ]*):\s*(.*)$", line)
        if m and all(re.fullmatch(r"\w+", n.strip()) for n in m.group(1).split(",")):
            names = [n.strip() for n in m.group(1).split(",")]
            for n in names:
                out[n] = m.group(2)
        elif line.startswith("    ") and names:
            for n in names:
                out[n] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break
    return out


def _dataclass_rows(cls, read_by=None) -> List[Tuple[str, ...]]:
    docs = _attribute_docs(cls)
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        row = (f.name, _type_name(hints[f.name]), _default(default), docs.get(f.name, ""))
        rows.append(row + ((read_by(f.name),) if read_by else ()))
    return rows


def _recipes_reading(field: str) -> str:
    names = [n for n, o in RECIPES.items() if field in o.read_fields()]
    return ", ".join(names) if len(names) < len(RECIPES) else "all"


def _task_option_classes() -> List[Tuple[str, type]]:
    """(source name, options dataclass) of the built-in task sources that declare one."""
    return [("calculator", CalculatorConfig), ("guess", GuessConfig), ("dataset", DatasetConfig)]


_ADAPTER_DOCS = {
    "max_turns": "gymnasium: assistant turns per episode (None = the env spec's max_episode_steps, else 8)",
    "system_prompt": "gymnasium: a system message before the first observation (None = none)",
    "heldout_seed_offset": "gymnasium: reset seeds of held-out tasks start here (train seeds below it)",
    "heldout_fraction": "verifiers: fraction of the taskset's rows held out (by hash)",
    "success_threshold": "verifiers: a reward at least this high counts as a success",
    "max_tasks": "verifiers: use at most this many rows of the taskset (None = all)",
}


def _adapter_rows() -> List[Tuple[str, ...]]:
    rows = []
    for cls, skip in ((GymSource, {"make", "first"}), (VerifiersSource, {"env"})):
        hints = typing.get_type_hints(cls.__init__)
        for p in inspect.signature(cls.__init__).parameters.values():
            if p.name in skip or p.name == "self" or p.kind is not p.KEYWORD_ONLY:
                continue
            rows.append((p.name, _type_name(hints.get(p.name, Any)), _default(p.default),
                         _ADAPTER_DOCS.get(p.name, "")))
    return rows


def _table(header: Tuple[str, ...], rows) -> List[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        out.append("| " + " | ".join([f"`{r[0]}`"] + [_cell(c) for c in r[1:]]) + " |")
    return out


def markdown() -> str:
    """``docs/config.md``: every key of the schema and of the documented free-form sections."""
    lines = ["# Configuration reference", "",
             "Generated from the schema (`src/trajgrad/train/config.py`) by `trajgrad config --markdown > "
             "docs/config.md`; a test fails when this file differs from what the code generates. "
             "`trajgrad config CONFIG.yaml [--preset P] [--set k=v ...]` prints a resolved config with where each "
             "value came from; `trajgrad config --schema` prints the JSON Schema.", "",
             "Keys are dotted (`train.steps`), as in `--set train.steps=3`. A key set by a YAML file or `--set` "
             "that has no effect in the chosen mode is refused at load time. \"Read by\" names the recipes (at "
             "their defaults) whose runs read the key; `all` = every recipe.", ""]
    rows = config_rows()
    sections = [r for r in rows if "." not in r[0]]
    for sec in sections:
        key = sec[0]
        lines += [f"## `{key}`", "", _cell(sec[3]) or "", ""]
        if sec[1] != "section":
            lines += _table(("key", "type", "default", "description", "read by"), [sec]) + [""]
            continue
        lines += _table(("key", "type", "default", "description", "read by"),
                        [r for r in rows if r[0].startswith(key + ".")]) + [""]
    lines += ["## `recipe.overrides`", "",
              "Fields of the recipe (`trajgrad.objective.Objective`) to change; `trajgrad explain CONFIG.yaml` "
              "prints the result. \"Read by\" lists the recipes that read the field at their defaults; a field "
              "a recipe does not read is refused unless given its default (off) value.", ""]
    obj_rows = [r for r in _dataclass_rows(Objective, _recipes_reading) if r[0] not in ("name", "paper")]
    lines += _table(("key", "type", "default", "description", "read by"),
                    [(f"recipe.overrides.{r[0]}",) + r[1:] for r in obj_rows]) + [""]
    for source, cls in _task_option_classes():
        lines += [f"## `task.options` of task `{source}`", "", _doc_summary(cls), ""]
        lines += _table(("key", "type", "default", "description"),
                        [(f"task.options.{r[0]}",) + r[1:] for r in _dataclass_rows(cls)]) + [""]
    lines += ["## `task.options.adapter`", "",
              "With `task.name: package.module:factory` the other `task.options` go to the factory; `adapter` "
              "holds the options of the adapter of the environment it returns (gymnasium or verifiers).", ""]
    lines += _table(("key", "type", "default", "description"),
                    [(f"task.options.adapter.{r[0]}",) + r[1:] for r in _adapter_rows()])
    return "\n".join(lines).rstrip() + "\n"


def json_schema() -> Dict[str, Any]:
    """The JSON Schema of a training config (pydantic's, from the same models)."""
    return Config.model_json_schema()
