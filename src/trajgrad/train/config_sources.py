"""Where each value of a resolved config comes from (``trajgrad config CONFIG.yaml``).

A config is built in layers (:func:`trajgrad.train.config.load_config`): the schema's
defaults, a preset (``--preset`` or the file's ``preset:`` key; ``default`` when neither a
file nor a preset is given), the YAML file, then ``--set``. :func:`config_sources` reports
every leaf key of the resolved config with the last layer that set it, and the recipe's own
fields with theirs (the recipe's default, ``recipe.overrides`` or ``train.group_size``).
:func:`recipe_defaults_line` is the line every run prints at its start: the recipe defaults
in effect that no layer set, the KL term first.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .config import Config, load_config, parse_yaml
from .config_checks import user_keys
from .presets import PRESETS

_NOT_LOSS = ("name", "paper")


def recipe_sources(cfg: Config) -> List[Tuple[str, Any, str]]:
    """``(field, value, source)`` for every field the recipe reads (``Objective.read_fields``)."""
    obj = cfg.objective()
    out = []
    for field in obj.read_fields():
        if field in _NOT_LOSS:
            continue
        if field in cfg.recipe.overrides:
            src = f"recipe.overrides.{field}"
        elif field == "group_size" and cfg.train.group_size is not None:
            src = "train.group_size"
        elif field == "constant" and obj.aggregation == "seq_sum_constant":
            src = "sampling.max_new_tokens x max turns"
        else:
            src = f"recipe {obj.name!r} default"
        value = getattr(obj, field)
        if field == "rollout_correction":
            value = dataclasses.asdict(value) if value else "off"
        out.append((field, value, src))
    return out


def _kl_words(obj) -> str:
    if obj.kl_placement == "none":
        return "no KL term (kl_placement 'none')"
    return f"KL {obj.kl_kind} in the {obj.kl_placement}, kl_coef {obj.kl_coef:g}"


def recipe_defaults_line(cfg: Config) -> str:
    """One line: the KL setting and every recipe default in effect that the config does not set."""
    obj = cfg.objective()
    unset = [(f, v) for f, v, src in recipe_sources(cfg) if src.startswith("recipe ")]
    kl_src = "recipe default" if "kl_placement" not in cfg.recipe.overrides else "recipe.overrides"
    rest = ", ".join(f"{f} {v!r}" if isinstance(v, str) else f"{f} {v}" for f, v in unset
                     if f not in ("kl_placement", "kl_coef", "kl_kind"))
    return (f"recipe {obj.name!r}: {_kl_words(obj)} ({kl_src}); recipe defaults in effect, not set by the config: "
            f"{rest or 'none'}")


def _layers(path, preset, overrides) -> List[Tuple[str, List[str]]]:
    """``(label, dotted keys the layer sets)``, first to last."""
    layers: List[Tuple[str, List[str]]] = []
    loaded: Dict[str, Any] = {}
    if path is not None:
        loaded = parse_yaml(Path(path).read_text(), what=f"config {path}") or {}
        loaded = copy.deepcopy(loaded) if isinstance(loaded, dict) else {}
        file_preset = loaded.pop("preset", None)
        if isinstance(file_preset, str) and file_preset in PRESETS:
            layers.append((f"preset {file_preset} (file)", user_keys(PRESETS[file_preset])))
    if preset is not None or path is None:
        name = preset or "default"
        layers.append((f"preset {name}", user_keys(PRESETS[name])))
    if loaded:
        layers.append((f"file {path}", user_keys(loaded)))
    if overrides:
        keys: List[str] = []
        for k, v in overrides.items():
            keys += user_keys(v, k)
        layers.append(("--set", keys))
    return layers


def _source(key: str, layers) -> str:
    src = "default"
    for label, keys in layers:
        if any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in keys):
            src = label
    return src


def config_sources(path: Optional[Path | str] = None, *, preset: Optional[str] = None,
                   overrides: Optional[Dict[str, Any]] = None) -> Tuple[Config, List[Tuple[str, Any, str]]]:
    """The resolved config and ``(dotted key, value, source)`` for each of its leaf keys,
    then ``recipe.<field>`` for each field the recipe reads."""
    cfg = load_config(path, preset=preset, overrides=overrides)
    layers = _layers(path, preset, overrides)
    data = cfg.model_dump(mode="json")
    rows = []
    for key in user_keys(data):
        value: Any = data
        for part in key.split("."):
            value = value[part]
        src = _source(key, layers)
        if src == "default" and key.startswith("task.options.") and cfg.task.dataset is not None:
            src = _source("task.dataset", layers) + " (task.dataset, task.reward, task.heldout)"
        rows.append((key, value, src))
    rows += [(f"recipe.{f} (resolved)", v, s) for f, v, s in recipe_sources(cfg)]
    return cfg, rows


def format_sources(rows: List[Tuple[str, Any, str]]) -> str:
    """Aligned ``key: value   # source`` lines (values as JSON)."""
    def val(v):
        return json.dumps(dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v, ensure_ascii=False)

    pairs = [(f"{k}: {val(v)}", s) for k, v, s in rows]
    width = min(max(len(a) for a, _ in pairs), 72)
    return "\n".join(f"{a:<{width}}  # {s}" for a, s in pairs)
