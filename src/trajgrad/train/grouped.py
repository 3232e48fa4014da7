"""The synchronous grouped baseline on the same Ray actors (for §20.1 comparisons)."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import numpy as np

from ..rollout import Trajectory
from .async_state import episode_key
from .config import Config
from .lag import group_wait
from .ray_learner import RayLearner
from .seeding import step_seed

__all__ = ["GroupedRayTrainer"]


class GroupedRayTrainer(RayLearner):
    r"""The synchronous grouped baseline on the same Ray actors (for §20.1 comparisons).

    Each step dispatches ``train.prompts_per_step`` prompts :math:`\times G` rollouts
    (``G`` = the recipe's group size), waits for every one of them (the group barrier),
    and performs one update with :meth:`Trainer.learn`. Logged per step: the group wait
    ``group/wait_W`` :math:`=\sum_{groups}\sum_i(T_{ready}-T_i)` with :math:`T_i` the time
    rollout :math:`i` reached the learner (:func:`group_wait`), its mean per rollout, the
    throughput, and the learner's idle time. A group that lost a member to a dead worker
    is dropped whole (``faults/incomplete_groups``).

    Checkpoints fall between steps, behind the group barrier: no episode is in flight and
    none is finished but untrained, so the checkpoint's asynchronous state holds the
    counters and the ledger of trained groups (a resumed run refuses to train a group it
    holds). A step interrupted by a kill is sampled again from the restored data cursor: the
    same prompts, keys and seeds.
    """

    def __init__(self, cfg: Config, run_dir, *, resume: bool = False, console=print):
        super().__init__(cfg, run_dir, resume=resume, console=console)
        self.counters.update({"group_wait_W": 0.0, "rollouts": 0, "incomplete_groups": 0})
        self._load_async_state()

    def _check_recipe(self, cfg: Config) -> None:
        obj = cfg.objective()
        if obj.group_size < 2:
            raise ValueError(f"recipe: {obj.name!r} has group_size {obj.group_size}; the grouped baseline needs >= 2")

    def run(self, *, max_seconds: Optional[float] = None, stall_timeout: float = 900.0) -> Dict[str, Any]:
        tr, cfg = self.trainer, self.cfg
        G = tr.objective.group_size
        P = cfg.train.prompts_per_step
        self._start()
        totals = self.counters
        try:
            bar = self._begin(stall_timeout, "grouped")
            t_run = self._t_start
            while tr.step < cfg.train.steps:
                if max_seconds is not None and time.perf_counter() - t_run >= max_seconds:
                    break
                t0 = time.perf_counter()
                groups: Dict[str, Dict[str, Any]] = {}
                for _ in range(P):
                    idx = tr.cursor
                    task = tr.next_tasks(1)[0]
                    gkey = episode_key(idx, "g")
                    groups[gkey] = {"times": [], "trajs": [], "lost": False}
                    for g in range(G):
                        self.pool.submit(episode_key(idx, "g", g), task, step_seed(cfg.train.seed, idx, salt=100 + g), group=gkey)
                waited = 0.0
                while self.pool.jobs:
                    got = self.pool.wait_one(timeout=1.0)
                    if got is None:
                        waited += 1.0
                        if waited > stall_timeout:
                            raise RuntimeError(f"rollout workers: no episode finished in {stall_timeout:.0f} s")
                        continue
                    job, res, kind = got
                    grp = groups[job.group]
                    if kind != "ok":
                        grp["lost"] = True
                        self.counters["lost_episodes" if kind == "lost" else "failed_episodes"] += 1
                        if kind == "lost":
                            self.lost_keys.append(job.key)
                        continue
                    grp["times"].append(time.perf_counter() - t0)
                    grp["trajs"].extend(res["trajectories"])
                t_ready = time.perf_counter()
                trajs: List[Trajectory] = []
                W = 0.0
                n_roll = 0
                for gkey, grp in groups.items():
                    for t in grp["trajs"]:
                        t.metadata["async"] = {"key": gkey, "status": "dropped_incomplete" if grp["lost"] else "trained"}
                    tr.traj_log.extend(grp["trajs"])
                    if grp["lost"]:
                        totals["incomplete_groups"] += 1
                        continue
                    W += group_wait(grp["times"])
                    n_roll += len(grp["times"])
                    trajs.extend(grp["trajs"])
                self._mark_trained([k for k, grp in groups.items() if not grp["lost"]])
                ntok = sum(t.num_action_tokens for t in trajs)
                self.counters["episodes_finished"] += n_roll
                self.counters["trajectories_finished"] += len(trajs)
                self.counters["tokens_finished"] += ntok
                totals["group_wait_W"] += W
                totals["rollouts"] += n_roll
                if not trajs:
                    continue
                v = tr.policy_version
                lags = [v - min(turn.policy_version for turn in t.turns) for t in trajs]
                m = self._learn(trajs)
                now = time.perf_counter()
                dt = now - t0
                m.update({
                    "group/wait_W": W, "group/wait_W_per_rollout": W / max(n_roll, 1),
                    "group/size": float(G), "group/ready_seconds": t_ready - t0,
                    "faults/incomplete_groups": float(totals["incomplete_groups"]),
                    "faults/lost_episodes": float(self.counters["lost_episodes"]),
                    "faults/replaced_workers": float(self.pool.replaced),
                    "lag/mean": float(np.mean(lags)), "lag/max": float(max(lags)),
                    "throughput/trajectories_per_s": len(trajs) / dt, "throughput/tokens_per_s": ntok / dt,
                    "throughput/trajectories_per_s_total": self.counters["trajectories_finished"] / max(now - t_run, 1e-9),
                    "time/learner_idle": t_ready - t0, "time/learner_idle_frac": (t_ready - t0) / dt, "time/step": dt,
                })
                self._end_step(m, bar, ("reward/mean", "group/wait_W", "loss"))
            bar.close()
            self._t_loop = time.perf_counter() - self._t_start
            self._final_save()
        finally:
            self._stop()
        summary: Dict[str, Any] = {
            "steps": tr.step, "recipe": tr.objective.name, "mode": "grouped", "group_size": G,
            "episodes_finished": self.counters["episodes_finished"], "group_wait_W_total": totals["group_wait_W"],
            "group_wait_W_per_rollout": totals["group_wait_W"] / max(totals["rollouts"], 1),
            "incomplete_groups": totals["incomplete_groups"], "lost_episodes": self.counters["lost_episodes"],
            "seconds": self._t_loop,
            "trajectories_per_s": self.counters["trajectories_finished"] / max(self._t_loop, 1e-9),
        }
        return self._finish(summary)
