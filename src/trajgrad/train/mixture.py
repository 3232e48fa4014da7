r"""Several environments in one run (``tasks:``): the prompt split, per-environment advantages.

A config with ``tasks: [{name, weight, group_size, advantage, <the keys of task:>}, ...]``
trains one policy with one policy term on several environments at once. Each step:

1. **Split** (:func:`split_counts`): the step's ``P = train.prompts_per_step`` prompts are
   divided by weight, :math:`w_e = \mathrm{weight}_e / \sum_k \mathrm{weight}_k`, with
   stratified counts :math:`n_e = \lfloor w_e P + \tfrac12 \rceil` (round half up); the
   remainder :math:`P - \sum_e n_e` (positive or negative) goes one prompt at a time to
   environments drawn from the run's seed and the step (``step_seed(train.seed, step, 7)``)
   among those whose count is below (above) :math:`w_e P`, so that
   :math:`|n_e - w_e P| < 1`. An environment left with 0 prompts (:math:`w_e P < \tfrac12`)
   takes one from the environment furthest above its share: with ``P`` at least the number
   of environments (checked at load time) none is starved.
2. **Rollouts**: each environment samples its ``n_e`` prompts with its own group size
   (``tasks[i].group_size``, else ``train.group_size``, else the recipe's) and its own
   dynamic-sampling setting; each trajectory records its environment
   (``metadata["environment"]``; task and episode ids ``<environment>/<id>``).
3. **Advantages** (:meth:`Mixture.sequence_advantages`): computed within each environment's
   own groups and reward scale, by that environment's objective (the run's recipe with its
   ``group_size`` and ``advantage`` overrides, :func:`environment_objective`); a group never
   mixes environments, and batch statistics (``batch_std``, REINFORCE++) are that
   environment's batch.
4. **One policy loss** over the whole batch with the run's aggregation and denominator
   (the trainer's unchanged policy update).

Metrics ``env/<name>/prompts``, ``/episodes``, ``/reward``, ``/success``,
``/zero_variance_frac`` each step; held-out evaluation on each environment's own held-out
split (``eval/<name>/success``, ``/reward``, ``/n``) next to the overall ``eval/success``.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..advantages.baselines import GroupAdvantages
from ..envs import get_task_source
from ..objective import Objective, explain, sections
from ..registry import ADVANTAGE_ESTIMATORS
from .collect import STAT_KEYS, collect_groups, next_in_order
from .heldout import distinct_tasks, heldout_problem
from .seeding import step_seed

__all__ = ["split_counts", "advantage_fields", "environment_objective", "Member", "Mixture", "explain_config",
           "SPLIT_SALT"]

SPLIT_SALT = 7  # the split's draw: step_seed(train.seed, step, SPLIT_SALT)
_SEED_STRIDE = 100_000  # environment e samples with salt (e + 1) * _SEED_STRIDE (+ try * 1000 + rank)


def split_counts(weights: Sequence[float], P: int, seed: int) -> List[int]:
    """``P`` prompts split over environments of ``weights`` (stratified; see the module docstring).

    Deterministic in ``seed``; the counts sum to ``P``; ``|n_e − w_e P| < 1`` whenever every
    ``w_e P ≥ 1``; every count is at least 1. Raises ValueError naming ``weights`` (empty, not
    finite and positive) or ``P`` (fewer prompts than environments).
    """
    w = [float(x) for x in weights]
    if not w or any(not math.isfinite(x) or x <= 0 for x in w):
        raise ValueError(f"weights: expected positive finite numbers, got {list(weights)!r}")
    if isinstance(P, bool) or not isinstance(P, int) or P < len(w):
        raise ValueError(f"P: {P!r} prompts cannot give each of the {len(w)} environments one")
    total = sum(w)
    target = [x / total * P for x in w]
    counts = [int(math.floor(t + 0.5)) for t in target]
    rng = random.Random(seed)
    rest = P - sum(counts)
    if rest > 0:  # rounded down too often: add to environments below their share
        below = [i for i, (c, t) in enumerate(zip(counts, target)) if c < t]
        for i in rng.sample(below, rest):
            counts[i] += 1
    elif rest < 0:  # rounded up too often: take from environments above their share (not from a 1 if avoidable)
        above = [i for i, (c, t) in enumerate(zip(counts, target)) if c > t]
        spare = [i for i in above if counts[i] >= 2]
        picks = rng.sample(spare, min(-rest, len(spare)))
        picks += rng.sample([i for i in above if i not in picks], -rest - len(picks))
        for i in picks:
            counts[i] -= 1
    for i in range(len(counts)):  # w_e P < 1/2 rounds to 0: one prompt from the env furthest above its share
        if counts[i] == 0:
            donor = max((j for j in range(len(counts)) if counts[j] >= 2), key=lambda j: (counts[j] - target[j], -j))
            counts[donor] -= 1
            counts[i] = 1
    return counts


def advantage_fields() -> Tuple[str, ...]:
    """The ``Objective`` fields an environment may override (``tasks[i].advantage``): the
    estimator (``advantage``, sequence level), the fields of the sequence-level estimators,
    and ``dynamic_sampling``. The policy term, its aggregation and the KL are the run's."""
    fields = ["advantage", "dynamic_sampling"]
    for est in ADVANTAGE_ESTIMATORS.values():
        if est.level == "sequence":
            fields += list(est.fields)
    return tuple(dict.fromkeys(fields))


def environment_objective(base: Objective, group_size: Optional[int], advantage: Dict[str, Any]) -> Objective:
    """The run's objective with one environment's ``group_size`` and advantage overrides.

    Raises ValueError starting with the field (``group_size: ...``, ``std_eps: ...``) for a
    field that is not the advantage estimator's, a token-level estimator, or a bad value."""
    allowed = advantage_fields()
    for key in advantage:
        if key == "group_size":
            raise ValueError("group_size: give the environment's group_size beside advantage, not in it")
        if key not in allowed:
            raise ValueError(f"{key}: not a field of the advantage estimator; known: {', '.join(sorted(allowed))}")
    name = advantage.get("advantage")
    if name is not None and (name not in ADVANTAGE_ESTIMATORS or ADVANTAGE_ESTIMATORS[name].level != "sequence"):
        seq = sorted(k for k, e in ADVANTAGE_ESTIMATORS.items() if e.level == "sequence")
        raise ValueError(f"advantage: {name!r} is not a sequence-level estimator; known: {', '.join(seq)}")
    changes = dict(advantage)
    if group_size is not None:
        changes["group_size"] = group_size
    return base.replace(**changes) if changes else base


@dataclass
class Member:
    """One environment of the run: its source, tasks, weight, objective and data cursor."""

    name: str
    weight: float
    source: Any
    train: list
    heldout: list
    objective: Objective
    task_seed: int
    cursor: int = 0

    def take(self, n: int) -> list:
        out, self.cursor = next_in_order(self.train, self.cursor, n, self.task_seed)
        return out


class Mixture:
    """The run's environments (built from ``cfg.tasks`` by :meth:`build`)."""

    def __init__(self, members: List[Member], seed: int) -> None:
        self.members, self.seed = members, seed
        self.by_name = {m.name: m for m in members}

    @classmethod
    def build(cls, cfg, objective: Objective) -> Optional["Mixture"]:
        """None for a run with one ``task:``."""
        if cfg.tasks is None:
            return None

        members = []
        for i, entry in enumerate(cfg.tasks):
            t = entry.task_config()
            source = get_task_source(t.name, **t.options)
            n_heldout = cfg.eval.n or t.n_heldout
            heldout = distinct_tasks(source, source.tasks("heldout", n_heldout, t.seed))  # each distinct task once
            problem = heldout_problem(cfg, n_heldout, len(heldout))
            if problem is not None:
                raise ValueError(f"{'eval.n' if cfg.eval.n else f'tasks[{i}].n_heldout'}: {problem}")
            members.append(Member(
                name=entry.name, weight=entry.weight, source=source, train=source.tasks("train", t.n_train, t.seed),
                heldout=heldout, task_seed=t.seed,
                objective=environment_objective(objective, entry.group_size, entry.advantage)))
        return cls(members, cfg.train.seed)

    def tasks(self) -> Tuple[None, list, list]:
        """(no single source, every training task, every held-out task): the trainer's task lists."""
        return None, [t for m in self.members for t in m.train], [t for m in self.members for t in m.heldout]

    def counts(self, P: int, step: int) -> List[int]:
        """The step's prompts per environment (:func:`split_counts`, drawn from the run's seed and ``step``)."""
        return split_counts([m.weight for m in self.members], P, step_seed(self.seed, step, SPLIT_SALT))

    def collect(self, trainer) -> Tuple[list, Dict[str, float]]:
        """Each environment's share of the step's groups (:func:`collect_groups` per environment)."""
        counts = self.counts(trainer.cfg.train.prompts_per_step, trainer.step)
        trajs: list = []
        stats = dict.fromkeys(STAT_KEYS, 0.0)
        for e, (m, n) in enumerate(zip(self.members, counts)):
            got, s = collect_groups(trainer, m.source, m.take, m.objective.group_size, n, m.objective.dynamic_sampling,
                                    salt=(e + 1) * _SEED_STRIDE, environment=m.name)
            trajs += got
            for k, v in s.items():
                stats[k] = stats.get(k, 0.0) + v
            stats[f"env/{m.name}/prompts"] = float(n)
            stats[f"env/{m.name}/discarded_groups"] = s["dynamic/discarded_groups"]
        return trajs, stats

    def rows(self, trajs) -> List[torch.Tensor]:
        """Per member, the batch rows (indices into ``trajs``) of its trajectories."""
        names = [t.metadata.get("environment") for t in trajs]
        unknown = sorted({n for n in names if n not in self.by_name}, key=str)
        if unknown:
            raise ValueError(f"trajs: trajectories of no environment of this run ({unknown[0]!r})")
        return [torch.tensor([i for i, n in enumerate(names) if n == m.name], dtype=torch.long) for m in self.members]

    def sequence_advantages(self, seq_r: torch.Tensor, group_ids: torch.Tensor, trajs,
                            metrics: Optional[Dict[str, float]] = None) -> GroupAdvantages:
        """``[B]`` advantages, each environment's rows by its own objective on its own groups.

        ``seq_r``: ``[B]`` sequence rewards; ``group_ids``: the batch's ``[B]`` group ids. The
        result's ``advantages`` is ``[B]``; ``zero_variance`` holds every environment's groups
        (in member order); ``mean`` and ``std`` likewise. ``metrics`` receives
        ``env/<name>/zero_variance_frac``."""
        adv = torch.zeros_like(seq_r)
        parts: Dict[str, List[torch.Tensor]] = {"mean": [], "std": [], "zero_variance": []}
        for m, idx in zip(self.members, self.rows(trajs)):
            if idx.numel() == 0:
                continue
            local = torch.unique(group_ids[idx], return_inverse=True)[1]
            ga = m.objective.sequence_advantages(seq_r[idx], group_ids=local)
            adv[idx] = ga.advantages.to(adv.dtype)
            for k in parts:
                parts[k].append(getattr(ga, k).reshape(-1))
            if metrics is not None:
                zv = ga.zero_variance
                metrics[f"env/{m.name}/zero_variance_frac"] = float(zv.float().mean()) if zv.numel() else 0.0
        cat = {k: torch.cat(v) if v else torch.zeros(0) for k, v in parts.items()}
        return GroupAdvantages(advantages=adv, mean=cat["mean"], std=cat["std"],
                               zero_variance=cat["zero_variance"].bool())

    def metrics(self, trajs) -> Dict[str, float]:
        """Per environment: ``env/<name>/episodes``, ``/reward`` (mean total reward), ``/success``."""
        out: Dict[str, float] = {}
        for m, idx in zip(self.members, self.rows(trajs)):
            mine = [trajs[i] for i in idx.tolist()]
            out[f"env/{m.name}/episodes"] = float(len(mine))
            if mine:
                out[f"env/{m.name}/reward"] = sum(float(t.total_reward) for t in mine) / len(mine)
                out[f"env/{m.name}/success"] = sum(bool(t.success) for t in mine) / len(mine)
        return out

    def heldout_parts(self, during_n: Optional[int] = None) -> List[Tuple[str, Any, list]]:
        """(name, source, held-out tasks) per environment; ``during_n``: the first that many of each."""
        return [(m.name, m.source, m.heldout[:during_n] if during_n else m.heldout) for m in self.members]

    def state_dict(self) -> Dict[str, int]:
        return {m.name: m.cursor for m in self.members}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        for name, cursor in (state or {}).items():
            if name in self.by_name:
                self.by_name[name].cursor = int(cursor)


def explain_config(cfg) -> str:
    """``trajgrad explain CONFIG``: the config's objective; with ``tasks:`` the environments, then
    each part of the objective that differs between them per environment, then the parts they share
    (from the same :class:`~trajgrad.objective.Objective` objects the loss and advantages use)."""
    base = cfg.objective()
    if cfg.tasks is None:
        return explain(base)
    objs = [environment_objective(base, e.group_size, e.advantage) for e in cfg.tasks]
    total = sum(e.weight for e in cfg.tasks)
    lines = [f"environments ({len(cfg.tasks)}): each step's train.prompts_per_step = {cfg.train.prompts_per_step} "
             "prompts split by weight (stratified; docs: README 'Several environments in one run')"]
    for e, o in zip(cfg.tasks, objs):
        lines.append(f"  {e.name}: weight {e.weight:g} ({e.weight / total:.1%} of the prompts), "
                     f"task {e.task_config().name!r}, {o.group_size} rollout(s) per prompt")
    secs = [sections(o) for o in objs]
    differ = [k for k in secs[0] if any(s[k] != secs[0][k] for s in secs[1:])]
    if differ:
        lines += ["", "per environment (advantages are computed within each environment's own groups):"]
        for k in differ:
            lines.append(f"{k}:")
            for e, s in zip(cfg.tasks, secs):
                lines += [f"  {e.name}:"] + ["    " + x for x in s[k].splitlines()]
    else:
        lines += ["", "every environment has the same advantage estimator and settings"]
    lines += ["", "shared by every environment (one policy term for the whole batch):", explain(objs[0], skip=differ)]
    return "\n".join(lines)
