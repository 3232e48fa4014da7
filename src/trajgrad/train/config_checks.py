"""Checks of a :class:`~trajgrad.train.config.Config` beyond its schema, made at load time.

Everything here runs before any model is built, and every error names its dotted key:

* :func:`check_config` (every config): the recipe and its overrides (known fields, strict
  types, finite numbers, clip bounds inside their domain), the tiny models' shapes, the
  checkpoints ``model.path`` / ``teacher.path`` / ``reference.path`` / ``critic.path`` name (a
  directory or a hub id in the local cache, holding config, weights and tokenizer; nothing
  loaded or downloaded), the task's options (validated by the task source itself, with
  strict types taken from its options dataclass), the environment latency spec, and whether
  the task can provide
  ``task.n_train`` training and ``eval.n`` / ``task.n_heldout`` held-out tasks (distinct
  ones, :mod:`trajgrad.train.heldout`) and the demonstrations SFT and DPO need
  (:mod:`trajgrad.train.task_checks`).
* :func:`check_effective` (configs given by a user: YAML file and ``--set``): a key the
  user set to a non-default value that has no effect in the chosen mode is refused
  (``asynchronous.workers`` without ``asynchronous.enabled``, ``recipe.overrides.beta``
  with a recipe that is not DPO, ...).

Both raise ``ValueError("dotted.key: message; other.key: message")`` on one line.
"""
from __future__ import annotations

import dataclasses
import os
import re
import typing
from typing import Any, Dict, Iterable, List, Optional

from pydantic import ConfigDict, TypeAdapter, ValidationError

from ..logprobs.correction import RolloutCorrection
from ..envs import available_task_sources, calculator as calc, get_task_source
from ..envs.base import registered_task_source
from ..envs.latency import with_latency
from ..model.pretrained import resolve_model_path
from ..objective import Objective, RECIPES
from .constraint_checks import cost_advantages_supplied
from .mixture_checks import check_mixture
from ..serve.proxy import check_proxy_config
from .task_checks import check_demonstrations, check_heldout
from .tracking import missing_backends

__all__ = ["check_config", "check_effective", "user_keys", "ray_backend_error"]

_ENUMERATE_LIMIT = 50_000  # calculator expression spaces up to this size are counted exactly


class _Errors:
    def __init__(self) -> None:
        self.items: List[str] = []

    def add(self, key: str, msg: str) -> None:
        self.items.append(f"{key}: {msg}")

    def raise_if_any(self) -> None:
        if self.items:
            raise ValueError("; ".join(dict.fromkeys(self.items)))


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _strict_check(hint: Any, value: Any) -> Optional[str]:
    """None if ``value`` is a ``hint`` without coercion (no bool for int, finite floats)."""
    try:
        TypeAdapter(hint, config=ConfigDict(strict=True, allow_inf_nan=False)).validate_python(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        return f"{err['msg'].rstrip('.')} (got {value!r})"
    except Exception:  # pragma: no cover - a hint pydantic cannot build a schema for
        return None
    return None


def _split_field_message(msg: str, fields: Iterable[str]) -> tuple[Optional[str], str]:
    """``"max_turns: expected ..."`` -> ("max_turns", "expected ...") when the prefix is a field (or a key of
    one: ``"rollout_correction.advantage_level: ..."``)."""
    head, sep, rest = str(msg).partition(":")
    if sep and head.strip().split(".")[0] in set(fields):
        return head.strip(), rest.strip()
    return None, str(msg)


# ----------------------------------------------------------------------------- recipe


def _check_recipe(cfg, errors: _Errors):
    name = cfg.recipe.name
    if name not in RECIPES:
        errors.add("recipe.name", f"unknown recipe {name!r}; known: {', '.join(RECIPES)}")
        return None
    hints = typing.get_type_hints(Objective)
    fields = {f.name for f in dataclasses.fields(Objective)} - {"name", "paper"}
    ok = True
    for key, value in cfg.recipe.overrides.items():
        if key not in fields:
            errors.add(f"recipe.overrides.{key}", f"unknown field of the recipe; known: {', '.join(sorted(fields))}")
            ok = False
            continue
        if key == "rollout_correction" and (value is None or isinstance(value, dict)):
            ok = _check_rollout_correction(value or {}, errors) and ok
            continue
        bad = _strict_check(hints[key], value)
        if bad:
            errors.add(f"recipe.overrides.{key}", bad)
            ok = False
    if not ok:
        return None
    try:
        obj = cfg.objective()
    except ValueError as exc:
        field, rest = _split_field_message(exc, fields)
        if field is None:
            errors.add("recipe.overrides", _one_line(exc))
        elif field == "group_size" and "group_size" not in cfg.recipe.overrides and cfg.train.group_size is not None:
            errors.add("train.group_size", _one_line(rest))
        else:
            errors.add(f"recipe.overrides.{field}", _one_line(rest))
        return None
    where = "recipe.overrides.loss" if "loss" in cfg.recipe.overrides else "recipe.name"
    if "teachers" in obj.term.inputs:  # batch inputs the trainer does not supply (PolicyTerm.inputs)
        errors.add(where, f"loss {obj.loss!r} reads the batch input 'teachers', which the trainer does not supply; "
                   "the trainer builds one teacher (teacher.*; recipes opd, gkd); call "
                   "Objective.distill_loss(teachers=[...]) for this term")
        return None
    if "cost_advantages" in obj.term.inputs and not cost_advantages_supplied(cfg, obj, where, errors):
        return None
    return obj


def _check_rollout_correction(value: Dict[str, Any], errors: _Errors) -> bool:
    """``recipe.overrides.rollout_correction``: known keys, strict types, then the setting's own
    validation, each error under ``recipe.overrides.rollout_correction.<key>``."""
    prefix = "recipe.overrides.rollout_correction"
    hints = typing.get_type_hints(RolloutCorrection)
    ok = True
    for key, v in value.items():
        if key not in hints:
            errors.add(f"{prefix}.{key}", f"unknown key; known: {', '.join(sorted(hints))}")
            ok = False
            continue
        bad = _strict_check(hints[key], tuple(v) if key == "bounds" and isinstance(v, list) else v)
        if bad:
            errors.add(f"{prefix}.{key}", bad)
            ok = False
    if ok:
        try:
            RolloutCorrection.coerce(value)
        except ValueError as exc:
            field, rest = _split_field_message(exc, hints)
            errors.add(f"{prefix}.{field}" if field else prefix, _one_line(rest))
            ok = False
    return ok


def _check_correction_sources(cfg, obj, errors: _Errors) -> None:
    rc = obj.rollout_correction if obj is not None else None
    if rc and rc.mode == "decoupled" and cfg.train.old_logp == "behaviour":
        errors.add("train.old_logp", "'behaviour' makes the old log-probs the sampler's, so the decoupled rollout "
                   "correction's weights pi_old/mu would be exactly 1; use 'auto' or 'recompute', or "
                   "recipe.overrides.rollout_correction.mode 'bypass'")


# ----------------------------------------------------------------------------- models


def _check_tiny(prefix: str, tiny, errors: _Errors) -> None:
    if tiny.hidden_size % tiny.heads:
        errors.add(f"{prefix}.hidden_size", f"must be divisible by {prefix}.heads ({tiny.heads}), got {tiny.hidden_size}")
    elif (tiny.hidden_size // tiny.heads) % 2:
        errors.add(f"{prefix}.hidden_size", f"the head size hidden_size / heads = {tiny.hidden_size // tiny.heads} "
                   "must be even (rotary position embeddings)")


def _check_path(key: str, path: str, errors: _Errors) -> None:
    """The checkpoint ``path`` resolves (directory or cached hub id; files only, nothing loaded)."""
    try:
        resolve_model_path(path, key=key)
    except ValueError as exc:
        msg = str(exc)
        errors.add(key, _one_line(msg[len(key) + 1:] if msg.startswith(key + ":") else msg))


def _check_models(cfg, obj, errors: _Errors) -> None:
    m = cfg.model
    if m.path is not None:
        _check_path("model.path", m.path, errors)
    elif m.name == "tiny":
        _check_tiny("model.tiny", m.tiny, errors)
    if m.lora is not None and m.lora.target_modules is not None and not m.lora.target_modules:
        errors.add("model.lora.target_modules", "empty; leave it unset (null) to detect the modules to adapt")
    if obj is not None and obj.kind == "distill":
        tc = cfg.teacher
        policy = "model.path" if m.path is not None else f"model.name {m.name!r}"
        if tc.path is not None:
            _check_path("teacher.path", tc.path, errors)
        elif tc.name == "smollm2" and (m.path is not None or m.name != "smollm2"):
            errors.add("teacher.name", f"'smollm2' needs model.name 'smollm2' (the same tokenizer), not {policy}; "
                       "give teacher.path for another teacher")
        elif tc.name in ("tiny", "sft"):
            if m.path is not None or m.name != "tiny":
                errors.add("teacher.name", f"{tc.name!r} builds a tiny teacher; it needs model.name 'tiny', not "
                           f"{policy}; give teacher.path for a teacher of this tokenizer")
            _check_tiny("teacher.tiny", tc.tiny, errors)
    if cfg.reference.path is not None:
        _check_path("reference.path", cfg.reference.path, errors)
    if cfg.critic.path is not None and obj is not None and obj.critic:
        _check_path("critic.path", cfg.critic.path, errors)
    if cfg.rollout.backend == "openai" and not cfg.rollout.base_url:
        errors.add("rollout.base_url", "required for rollout.backend 'openai'")
    if (cfg.rollout.backend == "vllm" or (cfg.rollout.backend == "proxy" and cfg.rollout.proxy.engine == "vllm")) \
            and m.path is None and m.name == "tiny":
        errors.add("model.name", "'tiny' has a character tokenizer vLLM cannot load; rollout.backend 'vllm' "
                   "(or rollout.proxy.engine 'vllm') needs a Hugging Face checkpoint (model.name 'smollm2' or model.path)")
    if cfg.asynchronous.enabled and cfg.rollout.backend != "proxy" and ray_backend_error(cfg.rollout.backend):
        errors.add("rollout.backend", ray_backend_error(cfg.rollout.backend) + " (asynchronous.enabled)")
    if cfg.rollout.backend == "vllm" and cfg.asynchronous.enabled and m.lora is None:
        errors.add("model.lora", "SAO (asynchronous.enabled) on rollout.backend 'vllm' needs a LoRA policy: a full-weight "
                   "reload would change the served weights under episodes in flight (trajgrad.train.ray_vllm)")
    if cfg.rollout.backend == "proxy":
        check_proxy_config(cfg, errors.add)


# ----------------------------------------------------------------------------- task


def _option_fields(source) -> Dict[str, Any]:
    """Option name -> type hint, from the source's options dataclass (``source.config``)."""
    opts = getattr(source, "config", None)
    if opts is None or not dataclasses.is_dataclass(opts):
        return {}
    try:
        return typing.get_type_hints(type(opts))
    except Exception:  # pragma: no cover
        return {f.name: Any for f in dataclasses.fields(opts)}


def _calculator_capacity(source, split: str) -> Optional[int]:
    """Distinct tasks of ``split`` the calculator source can generate: the exact count when the
    expression space is small enough to enumerate, else minus the expected count; None when
    the source is not the calculator."""
    if not isinstance(source, calc.CalculatorSource):
        return None
    c = source.config
    ops = sorted(set(c.operators))
    R = c.max_operand - c.min_operand + 1
    total = sum(R ** (k + 1) * len(ops) ** k for k in range(c.min_ops, c.max_ops + 1))
    split_of = getattr(calc, "_split_of", None)
    if total > _ENUMERATE_LIMIT or split_of is None:
        share = c.heldout_fraction if split == "heldout" else 1.0 - c.heldout_fraction
        return -max(1, int(total * share))  # negative: the expected count (not enumerated)
    excluded = {e[0] for e in (getattr(calc, "_EXAMPLE_MULTI", None), getattr(calc, "_EXAMPLE_SINGLE", None)) if e}
    operands = [str(v) for v in range(c.min_operand, c.max_operand + 1)]
    count = 0

    def walk(parts: List[str], left: int) -> None:
        nonlocal count
        if left == 0:
            expr = " ".join(parts)
            if expr not in excluded and split_of(expr, c.heldout_fraction) == split:
                count += 1
            return
        for op in ops:
            for v in operands:
                walk(parts + [op, v], left - 1)

    for k in range(c.min_ops, c.max_ops + 1):
        for v in operands:
            walk([v], k)
    return count


def _check_dataset_keys(cfg, errors: _Errors) -> bool:
    """task.dataset / task.reward / task.heldout given consistently (False: reported)."""
    t = cfg.task
    if t.dataset is None and t.reward is None and t.heldout is None:
        return True
    if t.name == "dataset" and t.dataset is not None:
        for key, field in (("dataset", "path"), ("reward", "reward"), ("heldout", "heldout")):
            given = getattr(t, key)
            if given is not None and t.options.get(field) != given:
                errors.add(f"task.options.{field}", f"differs from task.{key} ({given!r}); give one of them")
                return False
        return True
    if t.dataset is None:
        if t.name != "dataset":
            key = "task.reward" if t.reward is not None else "task.heldout"
            errors.add(key, "needs task.dataset (the prompts it applies to)")
            return False
        return True
    if t.name != "calculator":
        errors.add("task.dataset", f"takes the prompts of a dataset; it cannot be combined with task.name {t.name!r}")
    else:
        errors.add("task.reward", "is required with task.dataset (e.g. 'my_rewards:correct')")
    return False


def _source_error_key(cfg, name: str, head: Optional[str]) -> str:
    """The dotted key of a task source's error whose message starts with ``head:``."""
    if head is None:
        return "task.options"
    if head in ("name", "adapter") and ":" in name:
        return "task.name" if head == "name" else "task.options.adapter"
    first = re.split(r"[.\[]", head)[0]
    if name == "dataset" and cfg.task.dataset is not None and first in ("path", "reward", "heldout"):
        return "task." + {"path": "dataset"}.get(first, first) + head[len(first):]
    return f"task.options.{head}"


_HEAD = re.compile(r"^([A-Za-z_]\w*(?:\.\w+|\[[^\]]*\])*):\s*(.*)$", re.DOTALL)


def _build_source(cfg, errors: _Errors, fields: Dict[str, Any]):
    name, options = cfg.task.name, cfg.task.options
    try:
        return get_task_source(name, **options)
    except TypeError as exc:
        errors.add("task.options", _one_line(exc))
    except ValueError as exc:
        m = _HEAD.match(str(exc))
        head, rest = (m.group(1), m.group(2)) if m else (None, str(exc))
        if head is not None and not (re.split(r"[.\[]", head)[0] in set(fields) | set(options) | {"name", "adapter", "reward",
                                                                                         "path", "heldout", "tools"}):
            head, rest = None, str(exc)
        errors.add(_source_error_key(cfg, name, head), _one_line(rest))
    except Exception as exc:  # a user's factory failing in its own way
        errors.add("task.name", f"building task {name!r} raised {type(exc).__name__}: {_one_line(exc)}")
    return None


def _check_task(cfg, errors: _Errors) -> None:
    if not _check_dataset_keys(cfg, errors):
        return
    name, options = cfg.task.name, cfg.task.options
    fields: Dict[str, Any] = {}
    if ":" not in name:
        if name not in available_task_sources():
            errors.add("task.name", f"unknown task source {name!r}; available: {', '.join(available_task_sources())}; "
                       "or 'package.module:factory'")
            return
        options_class = getattr(registered_task_source(name), "options_class", None)  # sources that need options
        if options_class is not None:
            fields = typing.get_type_hints(options_class)
        else:
            try:
                fields = _option_fields(get_task_source(name))
            except Exception:  # a source that needs options: validate by construction only
                fields = {}
    if fields:
        bad = False
        for key, value in options.items():
            if key not in fields:
                errors.add(f"task.options.{key}", f"unknown option of task {name!r}; known: {', '.join(fields)}")
                bad = True
                continue
            msg = _strict_check(fields[key], value)
            if msg:
                errors.add(f"task.options.{key}", msg)
                bad = True
        if bad:
            return
    source = _build_source(cfg, errors, fields)
    if source is None:
        return
    if ":" in name and cfg.rollout.backend != "proxy":  # the proxy's agent is the environment
        # a user's environment (tools, schemas, adapters) is built once now, not first at run time
        if not callable(getattr(source, "make_env", None)):
            errors.add("task.name", f"{name!r} gives tasks() but no make_env(): only rollout.backend 'proxy' (where "
                       "the agent is the environment) runs a task list without environments")
            return
        try:
            source.make_env()
        except Exception as exc:
            errors.add("task.name", f"building an environment of {name!r} failed: {type(exc).__name__}: "
                       f"{_one_line(exc)}")
            return
    need = (("train", cfg.task.n_train, "task.n_train"),
            ("heldout", cfg.eval.n or cfg.task.n_heldout, "eval.n" if cfg.eval.n else "task.n_heldout"))
    short = False
    for split, n, key in need:
        cap = _calculator_capacity(source, split)
        if cap is not None and n > abs(cap):
            many = f"about {-cap}" if cap < 0 else f"{cap}"
            short = short or split == "heldout"
            errors.add(key, f"asks for {n} {split.replace('heldout', 'held-out')} tasks; task {name!r} with these "
                       f"options has {many} distinct ones")
    try:
        for key, msg in check_demonstrations(cfg, source) + ([] if short else check_heldout(cfg, source)):
            errors.add(key, _one_line(msg))
    except Exception as exc:  # a user's environment failing in its own way while rendering a task
        errors.add("task.name", f"rendering the tasks of {name!r} raised {type(exc).__name__}: {_one_line(exc)}")
    lat = cfg.asynchronous.env_latency
    if lat is not None:
        try:
            with_latency(source, lat)
        except ValueError as exc:
            field, rest = _split_field_message(exc, ("mu", "sigma", "seed", "spec"))
            key = "asynchronous.env_latency" + (f".{field}" if field not in (None, "spec") else "")
            errors.add(key, _one_line(rest))


def _check_tasks(cfg, obj, errors: _Errors) -> None:
    """``tasks:`` (several environments): each entry checked as a ``task:`` would be, its keys under
    ``tasks[i]``; then the mixture's own rules (:func:`trajgrad.train.mixture_checks.check_mixture`)."""
    from types import SimpleNamespace

    typed_bad = set()  # keys already reported with a bad type: not again by the objective's own check
    for i, entry in enumerate(cfg.tasks):
        prefix = f"tasks[{i}]"
        sub = _Errors()
        _check_task(SimpleNamespace(task=entry.task_config(), eval=cfg.eval, rollout=cfg.rollout, sft=cfg.sft,
                                    objective=cfg.objective, asynchronous=cfg.asynchronous), sub)
        for item in sub.items:
            key, _, msg = item.partition(": ")
            if key == "task.name":
                key = f"{prefix}.source" if entry.source is not None else f"{prefix}.name"
            elif key.startswith("task."):
                key = prefix + key[len("task"):]
            errors.add(key, msg)
        for key, value in entry.advantage.items():
            hint = typing.get_type_hints(type(obj)).get(key) if obj is not None else None
            bad = _strict_check(hint, value) if hint is not None else None
            if bad:
                errors.add(f"{prefix}.advantage.{key}", bad)
                typed_bad.add(f"{prefix}.advantage.{key}")
    check_mixture(cfg, obj, lambda key, msg: None if key in typed_bad else errors.add(key, msg))


def _check_log_dist(cfg, errors: _Errors) -> None:
    if len(set(cfg.log.backends)) != len(cfg.log.backends):
        errors.add("log.backends", f"lists a backend twice (got {cfg.log.backends!r})")
    for name, package in missing_backends(cfg.log.backends):
        errors.add("log.backends", f"{name!r} needs the {package!r} package, which is not installed "
                   f"(pip install {package}, or remove {name!r} from log.backends)")
    if cfg.dist.fsdp and cfg.model.lora is not None:
        errors.add("dist.fsdp", "shards full fine-tuning; set model.lora: null (LoRA adapters stay replicated)")
    elif cfg.dist.fsdp:
        try:
            uses_reference = cfg.objective().uses_reference
        except ValueError:  # a bad recipe is reported by _check_recipe
            uses_reference = False
        if uses_reference and cfg.reference.path is None:
            errors.add("dist.fsdp", "pi_ref as a snapshot of the sharded policy is not supported; give reference.path "
                       "(a separate frozen model) or use kl_placement 'none'")
        if cfg.asynchronous.enabled or cfg.rollout.backend != "hf":
            errors.add("dist.fsdp", "runs the synchronous in-process trainer only (asynchronous.enabled false, "
                       "rollout.backend 'hf')")
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)  # under torchrun: every rank needs rows
        if cfg.sft.steps > 0 and cfg.sft.batch_size < world:
            errors.add("sft.batch_size", f"under dist.fsdp every one of the {world} ranks needs a demonstration "
                       f"per step (a sharded forward runs on all of them), got {cfg.sft.batch_size}")
        if cfg.train.prompts_per_step < world:
            errors.add("train.prompts_per_step", f"under dist.fsdp every one of the {world} ranks needs a prompt "
                       f"per step, got {cfg.train.prompts_per_step}")


def ray_backend_error(backend: str) -> str:
    """Why the Ray workers (SAO, the grouped baseline) cannot sample with ``rollout.backend``
    ``backend`` ('' when they can): in process ('hf') or from the learner's vLLM server ('vllm',
    trajgrad.train.ray_vllm)."""
    if backend in ("hf", "vllm"):
        return ""
    return (f"{backend!r} is not what Ray workers sample with (they sample in process with 'hf', or from the "
            "learner's vLLM server with 'vllm'; rollout.base_url attaches 'vllm' to a running server)")


def check_config(cfg) -> None:
    """Raise ValueError (every problem, each with its dotted key, on one line)."""
    errors = _Errors()
    obj = _check_recipe(cfg, errors)
    _check_correction_sources(cfg, obj, errors)
    _check_models(cfg, obj, errors)
    if cfg.tasks is None:
        _check_task(cfg, errors)
    else:
        _check_tasks(cfg, obj, errors)
    _check_log_dist(cfg, errors)
    if cfg.eval.during_n is not None and cfg.eval.during_n > (cfg.eval.n or cfg.task.n_heldout):
        errors.add("eval.during_n", f"is more than the {cfg.eval.n or cfg.task.n_heldout} held-out tasks evaluated")
    errors.raise_if_any()


# ----------------------------------------------------------------------------- no effect


def user_keys(data: Any, prefix: str = "") -> List[str]:
    """Dotted leaf keys of a nested dict (what a YAML file or ``--set`` sets)."""
    if not isinstance(data, dict) or (prefix and not data):
        return [prefix] if prefix else []
    out: List[str] = []
    for k, v in data.items():
        out.extend(user_keys(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _changed(cfg, key: str, default_cfg) -> bool:
    cur, ref = cfg, default_cfg
    for part in key.split("."):
        cur, ref = getattr(cur, part, None), getattr(ref, part, None)
    return cur != ref


def _off_value(cfg, field: str) -> bool:
    """``recipe.overrides.<field>`` is given as the Objective's own default (the value that
    turns the field's feature off, e.g. ``kl_coef: 0``)."""
    default = {f.name: f.default for f in dataclasses.fields(Objective)}.get(field, dataclasses.MISSING)
    value = cfg.recipe.overrides.get(field, dataclasses.MISSING)
    return (default is not dataclasses.MISSING and value is not dataclasses.MISSING
            and isinstance(value, bool) == isinstance(default, bool) and value == default)


def check_effective(cfg, keys: Iterable[str]) -> None:
    """Refuse user-set keys (``keys``, dotted) whose non-default values have no effect."""
    errors = _Errors()
    default = type(cfg)()  # the Config defaults
    obj = cfg.objective()
    keys = list(dict.fromkeys(keys))
    vllm_engine = cfg.rollout.backend == "vllm" or (cfg.rollout.backend == "proxy" and cfg.rollout.proxy.engine == "vllm")
    rules = [
        ("asynchronous.", not cfg.asynchronous.enabled, "has no effect unless asynchronous.enabled is true",
         ("asynchronous.enabled",)),
        ("rollout.vllm.", not vllm_engine, "has no effect unless rollout.backend is 'vllm' (or 'proxy' with "
         "rollout.proxy.engine 'vllm')", ()),
        ("rollout.server", cfg.rollout.backend != "openai", "has no effect unless rollout.backend is 'openai'", ()),
        ("rollout.", cfg.rollout.backend not in ("openai", "vllm") and not vllm_engine,
         "has no effect unless rollout.backend is 'openai' or 'vllm'",
         ("rollout.backend", "rollout.template_mismatch", "rollout.proxy.agent", "rollout.proxy.reward_timeout_s",
          "rollout.proxy.concurrency", "rollout.proxy.engine", "rollout.vllm.")),
        ("rollout.proxy.", cfg.rollout.backend != "proxy", "has no effect unless rollout.backend is 'proxy'", ()),
        ("constraint.", not cfg.constraint.enabled, "has no effect unless constraint.enabled is true",
         ("constraint.enabled",)),
        ("critic.", not obj.critic, f"has no effect: recipe {obj.name!r} trains no critic", ()),
        ("reference.", not obj.uses_reference, f"has no effect: recipe {obj.name!r} has no reference policy "
         "(kl_placement 'none' and not DPO)", ()),
        ("model.tiny.", cfg.model.name != "tiny" or cfg.model.path is not None,
         "has no effect unless model.name is 'tiny' (and model.path is not set)", ()),
        ("model.name", cfg.model.path is not None, "has no effect when model.path is set (the model comes from it)", ()),
        ("teacher.tiny.", cfg.teacher.name == "smollm2" or cfg.teacher.path is not None,
         "has no effect with teacher.name 'smollm2' or teacher.path", ()),
        ("teacher.name", cfg.teacher.path is not None, "has no effect when teacher.path is set", ()),
        ("eval.during_n", cfg.eval.every == 0, "has no effect when eval.every is 0 (no evaluation during training)", ()),
        ("sampling.top_k", cfg.sampling.temperature == 0, "has no effect at sampling.temperature 0 (greedy)", ()),
        ("sampling.top_p", cfg.sampling.temperature == 0, "has no effect at sampling.temperature 0 (greedy)", ()),
        ("sft.", cfg.sft.steps == 0 and not (obj.kind == "distill" and cfg.teacher.name == "sft"),
         "has no effect when sft.steps is 0", ("sft.steps",)),
        ("eval.", not (cfg.eval.before or cfg.eval.after or cfg.eval.every),
         "has no effect: eval.before, eval.after and eval.every turn every evaluation off",
         ("eval.before", "eval.after", "eval.every")),
        ("checkpoint.keep", cfg.checkpoint.every == 0, "has no effect when checkpoint.every is 0 (no checkpoints)", ()),
        ("train.skip_zero_gradient_rows", obj.kind != "token" or not obj.zero_without_advantage,
         f"has no effect: recipe {obj.name!r} has a term that does not vanish with the advantage "
         "(or no token-level policy loss)", ()),
        ("train.no_signal_steps", obj.kind != "token", f"has no effect: recipe {obj.name!r} takes no reward signal",
         ()),
        ("train.stop_on_no_signal", obj.kind != "token", f"has no effect: recipe {obj.name!r} takes no reward signal",
         ()),
        ("train.stop_on_no_signal", cfg.asynchronous.enabled, "is not supported by asynchronous runs (they warn and "
         "log signal/no_signal_warning only)", ()),
        ("train.dynamic_sampling_max_tries", not obj.dynamic_sampling,
         f"has no effect: recipe {obj.name!r} has no dynamic sampling", ()),
    ]
    for key in keys:
        for prefix, inactive, msg, exempt in rules:
            exempted = key in exempt or any(e.endswith(".") and key.startswith(e) for e in exempt)
            if inactive and (key == prefix or key.startswith(prefix)) and not exempted:
                if _changed(cfg, key, default):
                    errors.add(key, msg)
        if key.startswith("recipe.overrides."):
            # the registry says which fields the chosen policy term and estimator read; an unread
            # field set to its off value (kl_coef 0 with kl_placement 'none') changes nothing
            field = key.split(".")[2]
            if field not in obj.read_fields() and not _off_value(cfg, field):
                errors.add(key, f"has no effect with loss {obj.loss!r}, advantage {obj.advantage!r} and "
                                f"kl_placement {obj.kl_placement!r} (recipe {obj.name!r})")
    errors.raise_if_any()

