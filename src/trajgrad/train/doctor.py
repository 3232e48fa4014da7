"""``trajgrad doctor CONFIG``: will this run learn? Measured before spending hours on it.

The run's own setup builds the task and the policy (:class:`~trajgrad.train.trainer.Trainer`
in a temporary directory; with ``sft.steps`` the warm start runs first, since RL starts from
its result, stopped early when it has used :data:`SFT_SHARE` of the budget, which the report
says), and the run's own sampler draws ``groups`` groups of the recipe's group size on
the first training prompts, at the training temperature, within a time budget (by default
2 minutes for the tiny model, 5 otherwise; the budget counts from the start, the model's
build and the warm start included; a batch of 4 prompts is not started when the previous
one's time would end it past the budget, and at least one batch is always sampled).
:func:`measure` turns the episodes into facts with 95% intervals (Wilson for proportions,
Student t for means) and the recipe's own signal (:mod:`trajgrad.train.learning_signal`);
:mod:`trajgrad.train.doctor_report` gives the verdict and the advice.
"""
from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from .config import Config, load_config
from .learning_signal import episode_rewards, signal_facts, signal_kind
from .loop import progress_bar
from .seeding import step_seed
from ..stats import mean_ci, wilson_interval
from .trainer import Trainer

DEFAULT_GROUPS = 16
CHUNK_PROMPTS = 4  # prompts per batched rollout call: the budget is checked between calls
SFT_SHARE = 0.6    # the SFT warm start stops once this share of the budget is spent
TINY_BUDGET_S, BUDGET_S = 120.0, 300.0


def _proportion(k: int, n: int) -> Dict[str, float]:
    lo, hi = wilson_interval(k, n) if n else (0.0, 1.0)
    return {"k": k, "n": n, "p": k / n if n else 0.0, "low": lo, "high": hi}


def _mean(values: Sequence[float]) -> Dict[str, float]:
    xs = [float(v) for v in values]
    if len(xs) < 2 or max(xs) == min(xs):
        m = xs[0] if xs else 0.0
        return {"mean": m, "low": m, "high": m, "n": len(xs)}
    m, lo, hi = mean_ci(xs)
    return {"mean": m, "low": lo, "high": hi, "n": len(xs)}


def measure(cfg: Config, trajs: Sequence[Any]) -> Dict[str, Any]:
    """The doctor's facts about sampled episodes (``trajs``: the sampler's trajectories)."""
    obj = cfg.objective()
    firsts = [t for t in trajs if getattr(t, "segment", 0) == 0]
    rewards = [float(t.metadata.get("episode_reward", t.total_reward)) for t in firsts]
    judged = [t for t in firsts if t.success is not None]
    turns = [turn for t in trajs for turn in t.turns]
    errors = Counter(str(turn.info["tool_error"]) for turn in turns if turn.info.get("tool_error"))
    invalid_seen = any("invalid_action" in turn.info for turn in turns)
    facts: Dict[str, Any] = {
        "recipe": obj.name, "group_size": obj.group_size, "signal_kind": signal_kind(obj),
        "episodes": len(firsts), "groups": len(episode_rewards(trajs)),
        "reward": {**_mean(rewards), "min": min(rewards, default=0.0), "max": max(rewards, default=0.0),
                   "values": Counter(round(r, 6) for r in rewards).most_common(5)},
        "success": _proportion(sum(bool(t.success) for t in judged), len(judged)),
        "tool_errors": {**_proportion(sum(errors.values()), len(turns)), "top": errors.most_common(3)},
        "invalid_actions": _proportion(sum(bool(turn.info.get("invalid_action")) for turn in turns), len(turns))
        if invalid_seen else None,
        "cut_turns": _proportion(sum(bool(turn.cut) for turn in turns), len(turns)),
        "turn_limit": _proportion(sum(bool(t.truncated) for t in firsts), len(firsts)),
        "template_mismatch": _proportion(sum(bool(t.metadata.get("template_mismatch")) for t in firsts),
                                         len(firsts)),
        "turns": _mean([sum(len(u.turns) for u in trajs if u.episode_id == t.episode_id) for t in firsts]),
        "action_tokens": _mean([sum(u.num_action_tokens for u in trajs if u.episode_id == t.episode_id)
                                for t in firsts]),
    }
    sig = signal_facts(obj, trajs)
    if "signal/groups" in sig:
        facts["zero_variance_groups"] = _proportion(int(sig["signal/zero_variance_groups"]), int(sig["signal/groups"]))
    if "signal/reward_var" in sig:
        facts["reward_var"] = sig["signal/reward_var"]
    facts["signal_present"] = sig.get("signal/present")
    return facts


def doctor(path: Optional[Path | str] = None, *, preset: Optional[str] = None,
           overrides: Optional[Dict[str, Any]] = None, groups: int = DEFAULT_GROUPS,
           max_seconds: Optional[float] = None, sft: bool = True, progress: bool = True,
           console=print) -> Dict[str, Any]:
    """Sample the base policy as ``trajgrad train`` would and measure it; the facts, with
    ``seconds`` (wall time) and the sampling settings. ``console`` receives progress lines."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups: must be an integer >= 1, got {groups!r}")
    t0 = time.perf_counter()
    cfg = load_config(path, preset=preset, overrides=overrides)
    if cfg.rollout.backend == "proxy":
        raise ValueError("rollout.backend: 'proxy' runs an external agent; trajgrad doctor samples with 'hf' or "
                         "'openai'")
    tiny = cfg.model.path is None and cfg.model.name == "tiny"
    budget = float(max_seconds) if max_seconds is not None else (TINY_BUDGET_S if tiny else BUDGET_S)
    if not budget > 0:
        raise ValueError(f"max_seconds: must be positive, got {max_seconds!r}")
    log = cfg.log.model_copy(update={"tensorboard": False, "backends": ["jsonl"], "token_log": False,
                                     "progress": progress})
    quiet = cfg.model_copy(update={"log": log})
    obj = cfg.objective()
    G, per_call = obj.group_size, max(1, min(cfg.train.prompts_per_step, groups, CHUNK_PROMPTS))
    with tempfile.TemporaryDirectory(prefix="trajgrad-doctor-") as tmp:
        console(f"building the task and the model ({cfg.model.path or cfg.model.name})...")
        trainer = Trainer(quiet, Path(tmp) / "run", console=lambda *a, **k: None)
        t_sft = time.perf_counter()
        warm = _warm_start(trainer, cfg.sft.steps if sft else 0, t0 + SFT_SHARE * budget)
        t_sft = time.perf_counter() - t_sft
        tasks = trainer.next_tasks(groups)  # the prompts the run's first steps would sample
        bar = progress_bar(trainer, groups * G, f"sampling {groups} groups of {G}")
        trajs, last = [], 0.0
        for start in range(0, groups, per_call):
            if start and time.perf_counter() - t0 + last > budget:  # the next batch would end past the budget
                break
            chunk, t1 = tasks[start:start + per_call], time.perf_counter()
            trajs += trainer.sampler.rollout(trainer.source, chunk, group_size=G,
                                             seed=step_seed(cfg.train.seed, 0, start))
            last = time.perf_counter() - t1
            bar.update(len(chunk) * G)
        bar.close()
        trainer.traj_log.close()
        trainer.metrics.close()
    facts = measure(cfg, trajs)
    facts.update(seconds=time.perf_counter() - t0, budget_s=budget, groups_asked=groups, sft_steps=warm,
                 sft_configured=cfg.sft.steps if sft else 0, sft_seconds=t_sft,
                 temperature=cfg.sampling.sampler_temperature, max_new_tokens=cfg.sampling.max_new_tokens,
                 model=cfg.model.path or cfg.model.name, has_demos=_has_demos(trainer))
    return facts


class _OutOfTime(Exception):
    pass


def _warm_start(trainer, steps: int, deadline: float) -> int:
    """The run's SFT warm start (``Trainer.sft``), stopped after the step that passes
    ``deadline``; the steps done."""
    if steps <= 0:
        return 0
    cfg, done = trainer.cfg, 0
    bar = progress_bar(trainer, steps, "sft warm start (as the run)")

    def step(s, loss):
        nonlocal done
        done = s + 1
        bar.update(1)
        if done < steps and time.perf_counter() > deadline:
            raise _OutOfTime

    try:
        trainer.sft(steps, cfg.sft.batch_size, cfg.sft.lr, progress=step)
    except _OutOfTime:
        pass
    bar.close()
    return done


def _has_demos(trainer) -> bool:
    try:
        return trainer.source.demonstration(trainer.train_tasks[0]) is not None
    except Exception:  # a source without demonstrations
        return False
