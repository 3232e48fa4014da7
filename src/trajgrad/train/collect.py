"""One step's rollouts: ``P`` groups of ``G`` episodes, with DAPO's dynamic sampling (§11).

:func:`collect_groups` is the trainer's collection for one task source; a run with several
environments (:mod:`trajgrad.train.mixture`) calls it once per environment with that
environment's source, prompt count, group size and dynamic-sampling setting.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import distributed as dist_lib
from ..rollout import Trajectory
from . import fsdp
from .seeding import step_seed

STAT_KEYS = ("dynamic/discarded_groups", "dynamic/discarded_tokens", "dynamic/tries", "time/generate", "gen_tokens",
             "rollout/template_mismatch")


def collect_groups(trainer, source, take: Callable[[int], list], G: int, P: int, dynamic: bool, *, salt: int = 0,
                   environment: Optional[str] = None) -> Tuple[List[Trajectory], Dict[str, float]]:
    """``P`` groups of ``G`` episodes of ``source``'s tasks (``take(n)``: the next ``n`` tasks).

    With ``dynamic`` (and ``G > 1``) a group whose rewards are all equal is logged as
    discarded and replaced, up to ``train.dynamic_sampling_max_tries`` tries. The sampling
    seed of try ``a`` on rank ``r`` is ``step_seed(train.seed, step, a * 1000 + r + salt)``.
    ``environment``: the name of the run's environment these tasks belong to (several
    environments in one run): each trajectory records it in ``metadata["environment"]`` and
    its task and episode ids become ``<environment>/<id>`` (groups of different environments
    never share an id).
    """
    cfg = trainer.cfg
    kept: List[Trajectory] = []
    stats = dict.fromkeys(STAT_KEYS, 0.0)
    need = P
    for attempt in range(cfg.train.dynamic_sampling_max_tries if dynamic else 1):
        tasks = dist_lib.shard(take(need), trainer.rank, trainer.world)
        t0 = time.perf_counter()
        seed = step_seed(cfg.train.seed, trainer.step, attempt * 1000 + trainer.rank + salt)
        with fsdp.gathered(trainer.model):  # ranks sample different lengths: no collective per forward
            trajs = trainer.sampler.rollout(source, tasks, group_size=G, seed=seed) if tasks else []
        if environment is not None:
            for t in trajs:
                t.metadata["environment"] = environment
                t.task_id, t.episode_id = f"{environment}/{t.task_id}", f"{environment}/{t.episode_id}"
        stats["time/generate"] += time.perf_counter() - t0
        stats["gen_tokens"] += sum(t.num_action_tokens for t in trajs)
        stats["dynamic/tries"] += 1
        # episodes a chat template would have re-rendered differently (ended, never trained past it)
        stats["rollout/template_mismatch"] += sum(bool(t.metadata.get("template_mismatch")) for t in trajs)
        for key, count in getattr(trainer.sampler, "step_stats", dict)().items():  # a proxy's counts
            stats[key] = stats.get(key, 0.0) + count
        groups: Dict[str, List[Trajectory]] = {}
        for t in trajs:
            groups.setdefault(t.task_id, []).append(t)
        for members in groups.values():
            rewards = [m.total_reward for m in members]
            if dynamic and G > 1 and max(rewards) == min(rewards):
                stats["dynamic/discarded_groups"] += 1
                stats["dynamic/discarded_tokens"] += sum(m.num_action_tokens for m in members)
                for m in members:
                    m.metadata["discarded"] = "zero_variance_group"
                trainer.traj_log.extend(members)
                continue
            kept.extend(members)
        need = P - int(dist_lib.sum_over_ranks(len(kept) // G))
        if need <= 0:
            break
    return kept, stats


def task_in_order(tasks: list, index: int, seed: int):
    """The task at data position ``index``: one fixed permutation per epoch, ``torch.randperm``
    seeded with ``seed * 31 + epoch``."""
    epoch, pos = divmod(int(index), len(tasks))
    perm = torch.randperm(len(tasks), generator=torch.Generator().manual_seed(seed * 31 + epoch)).tolist()
    return tasks[perm[pos]]


def next_in_order(tasks: list, cursor: int, n: int, seed: int) -> Tuple[list, int]:
    """The next ``n`` of ``tasks`` from position ``cursor`` (see :func:`task_in_order`) and the new cursor."""
    return [task_in_order(tasks, cursor + i, seed) for i in range(n)], cursor + n
