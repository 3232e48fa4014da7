"""``trajgrad.train(...)``: one call from Python to a trained run and its summary.

::

    import trajgrad

    summary = trajgrad.train(model="tiny", env="my_pkg.envs:make_source", recipe="grpo",
                             overrides={"train.steps": 20})
    summary = trajgrad.train(dataset="prompts.jsonl", rewards=["my_rewards:correct"],
                             recipe="grpo", preset="tiny")

The arguments become the config the CLI would build (``trajgrad train --preset ...
--set ...``): the same validation, the same run directory, the same
:class:`~trajgrad.train.trainer.Trainer`. An environment or reward function given as a
Python object instead of an import string is registered for this process (a task source
under a generated name; a reward function by its importable ``module:qualname``).
"""
from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

from .envs.adapters import as_task_source, is_task_source
from .envs.base import register_task_source, registered_task_source
from .train.asynchronous import AsyncTrainer
from .train.config import load_config
from .train.config_sources import recipe_defaults_line
from .train.mixture import explain_config
from .train.rundir import check_new_run_dir, create_run_dir
from .train.trainer import Trainer

__all__ = ["train", "build_config"]

_PRESET_MODELS = ("tiny", "smollm2")


def _env_name(env: Any) -> str:
    if isinstance(env, str):
        return env
    is_source = is_task_source(env) and not isinstance(env, type)
    if is_source or callable(env):
        name = f"py-{type(env).__name__ if is_source else getattr(env, '__name__', 'factory')}-{id(env):x}"
        if registered_task_source(name) is None:
            if is_source:
                register_task_source(name)(lambda **kw: env if not kw else _no_options(name, kw))
            else:
                def factory(**kw):
                    adapter = kw.pop("adapter", None) or {}
                    return as_task_source(env(**kw), remake=lambda: env(**kw), **adapter)

                register_task_source(name)(factory)
        return name
    raise ValueError(f"env: expected a task name, an import string 'package.module:factory', a task source or a "
                     f"factory, got {type(env).__name__}")


def _no_options(name: str, kw: dict):
    raise ValueError(f"options: task source object {name} takes no options, got {sorted(kw)}")


def _reward_ref(fn: Any, k: int) -> str:
    if isinstance(fn, str):
        return fn
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not callable(fn) or not mod or "<" in qual:
        raise ValueError(f"rewards.{k}: a reward function object must be defined at module level (importable as "
                         f"'module:function'), got {fn!r}")
    try:
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        obj = None
    if obj is not fn:
        raise ValueError(f"rewards.{k}: {fn!r} is not importable as '{mod}:{qual}'")
    return f"{mod}:{qual}"


def _rewards(rewards: Any) -> Union[str, List[str], Dict[str, float]]:
    if rewards is None:
        raise ValueError("rewards: required with dataset (reward functions or 'module:function' strings)")
    if isinstance(rewards, dict):
        return {_reward_ref(fn, k): float(w) for k, (fn, w) in enumerate(rewards.items())}
    if isinstance(rewards, (list, tuple)):
        return [_reward_ref(fn, k) for k, fn in enumerate(rewards)]
    return _reward_ref(rewards, 0)


def build_config(*, model: Optional[str] = None, env: Any = None, dataset: Optional[Union[str, Path]] = None,
                 rewards: Any = None, heldout: Optional[Union[float, str, Path]] = None,
                 recipe: Optional[str] = None, preset: Optional[str] = None, config: Optional[Union[str, Path]] = None,
                 overrides: Optional[Dict[str, Any]] = None):
    """The validated :class:`~trajgrad.train.config.Config` that :func:`train` runs.

    Precedence (later wins): ``preset`` / ``config`` file, then ``model`` / ``env`` /
    ``dataset`` / ``rewards`` / ``recipe``, then ``overrides`` (dotted keys).
    """
    if env is not None and dataset is not None:
        raise ValueError("env: give an environment or a dataset, not both")
    if rewards is not None and dataset is None:
        raise ValueError("rewards: reward functions score a dataset's prompts; give dataset too")
    sets: Dict[str, Any] = {}
    if model is not None:
        if not isinstance(model, (str, Path)):
            raise ValueError(f"model: expected a preset name ('tiny', 'smollm2') or a path, got {type(model).__name__}")
        sets.update({"model.name": str(model)} if str(model) in _PRESET_MODELS else {"model.path": str(model)})
    if env is not None:
        sets["task.name"] = _env_name(env)
        # a preset's task options belong to its own task, not to this one
        if not any(k == "task.options" or k.startswith("task.options.") for k in (overrides or {})):
            sets["task.options"] = {}
    if dataset is not None:
        sets["task.dataset"] = str(dataset)
        sets["task.reward"] = _rewards(rewards)
        if heldout is not None:
            sets["task.heldout"] = heldout if isinstance(heldout, float) else str(heldout)
    if recipe is not None:
        sets["recipe.name"] = recipe
    for key, value in (overrides or {}).items():
        if not isinstance(key, str):
            raise ValueError(f"overrides: keys must be dotted strings such as 'train.steps', got {key!r}")
        sets[key] = value
    clash = [k for k in sets for j in sets if j != k and j.startswith(k + ".")]
    if clash:
        raise ValueError(f"overrides: {clash[0]} is given both as a whole and by its keys")
    if config is None and preset is None:
        preset = "tiny" if str(model) == "tiny" else None
    sets.update({k: v for k, v in _own_task_defaults(env, dataset, config, overrides).items() if k not in sets})
    return load_config(config, preset=preset, overrides=sets)


def _own_task_defaults(env: Any, dataset: Any, config: Any, overrides: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """What a preset sets for its own task and a user's task does not inherit (printed by
    :func:`train`): its SFT warm start (demonstrations of the preset's task; an ``env``
    given here has its own, or none) and its held-out count (``eval.distinct: warn``: the
    user's task is evaluated on its distinct tasks, at most that many)."""
    if config is not None or (env is None and dataset is None):
        return {}
    given = set(overrides or {})
    out: Dict[str, Any] = {}
    if env is not None and not given & {"sft", "sft.steps"}:
        out["sft.steps"] = 0
    if not given & {"eval", "eval.n", "eval.distinct", "task", "task.n_heldout"}:
        out["eval.distinct"] = "warn"
    return out


def train(*, model: Optional[str] = None, env: Any = None, dataset: Optional[Union[str, Path]] = None,
          rewards: Any = None, heldout: Optional[Union[float, str, Path]] = None, recipe: Optional[str] = None,
          preset: Optional[str] = None, config: Optional[Union[str, Path]] = None,
          overrides: Optional[Dict[str, Any]] = None, run_dir: Optional[Union[str, Path]] = None,
          overwrite: bool = False, console: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Train and return the run summary (what ``summary.json`` holds).

    Args:
      model: ``"tiny"`` / ``"smollm2"`` (presets; ``"tiny"`` also selects the tiny preset
        when neither ``preset`` nor ``config`` is given) or a checkpoint path (``model.path``).
      env: a task source name, ``"package.module:factory"``, a task source object, or a
        factory returning one or another library's environment (adapted).
      dataset: prompts (``task.dataset``: .jsonl / .json / .parquet / datasets directory).
      rewards: with ``dataset``: reward functions (objects or ``"module:function"``), a list,
        or ``{function: weight}``.
      heldout: held-out rows: a fraction or a file (``task.heldout``).
      recipe: a recipe name (``recipe.name``).
      preset, config: the base config (a preset name, a YAML file).
      overrides: ``{"dotted.key": value}``, as ``--set``.
      run_dir: the run directory (default ``runs/<name>-<time>``); must be new or empty
        unless ``overwrite``.
      console: receives the progress lines (default: print).

    Returns:
      The summary dict: ``steps``, ``recipe``, ``eval_before`` / ``eval_after`` (held-out
      success) when evaluated, and ``run_dir``.
    """
    cfg = build_config(model=model, env=env, dataset=dataset, rewards=rewards, heldout=heldout, recipe=recipe,
                       preset=preset, config=config, overrides=overrides)
    out = Path(run_dir) if run_dir is not None else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_new_run_dir(out, overwrite=overwrite)
    say = console or print
    new_dir = create_run_dir(out, cfg, overwrite=overwrite)
    for key, value in _own_task_defaults(env, dataset, config, overrides).items():
        say(f"{key}: {value} (not set: a preset's value is for its own task; overrides={{{key!r}: ...}} sets it)")
    say(f"run directory: {out}")
    say("objective optimized by every update of this run:\n" + explain_config(cfg))
    say(recipe_defaults_line(cfg))
    try:
        if cfg.asynchronous.enabled:
            trainer = AsyncTrainer(cfg, out, console=say)
        else:
            trainer = Trainer(cfg, out, console=say)
    except BaseException:
        new_dir.abandon()
        raise
    new_dir.keep()
    summary = trainer.run()
    return {**summary, "run_dir": str(out)}
