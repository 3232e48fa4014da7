"""SAO's learner: single rollouts admitted the moment they finish, bounded policy lag (§20, §16).

The loop of :meth:`AsyncTrainer.run`: keep ``queue_size`` episodes in flight on the
:class:`~trajgrad.train.workers.RolloutPool`; take the first finished one
(``ray.wait(num_returns=1)``); apply the partial-rollout policy
(:mod:`trajgrad.train.partial`) and admit it to the :class:`~trajgrad.train.lag.LagGate`;
whenever the gate hands out ``batch_trajectories`` fresh trajectories, one update with
:meth:`Trainer.learn`, then publish the new weights.

Checkpoints (:meth:`AsyncTrainer.save`) first admit every episode that has finished on the
workers, then write the gate's pending episodes (the buffer), the episodes still in flight
and the trained-episode ledger with the weights (:mod:`trajgrad.train.async_state`). A
resumed run admits the buffer again, drops (and counts, ``lag/dropped_on_resume``) the
episodes whose lag against the restored policy version exceeds ``max_lag``, and submits the
in-flight episodes again from their tasks (``faults/rerun_on_resume``).
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import numpy as np

from ..rollout import Trajectory
from .config import Config
from .lag import Admitted, LagGate, lag_histogram
from .partial import apply_partial_policy, oldest_version
from .ray_learner import RayLearner
from .workers import Job

__all__ = ["AsyncTrainer"]


class AsyncTrainer(RayLearner):
    """SAO: single rollouts on Ray actors, admitted when ready, bounded lag (§20, §16).

    Args:
      cfg: the run's :class:`Config`; ``cfg.asynchronous`` sets workers, ``max_lag``,
        ``batch_trajectories``, ``queue_size`` (episodes in flight), ``partial``,
        ``ray_address`` and ``env_latency``. The recipe must use one rollout per prompt
        (``sao``, ``ppo``, ``reinforce``, ``opd``).
      run_dir: the run directory (same layout as :class:`Trainer`'s; every checkpoint also
        holds ``async_state.json``).
      resume: continue from the latest checkpoint of ``run_dir``, its buffer and its episodes
        in flight included.
      console: where to print.

    :meth:`run` trains ``train.steps`` updates (or until ``max_seconds``) and returns the
    summary dict. ``self.trainer`` is the :class:`Trainer` that performs each update.
    """

    def __init__(self, cfg: Config, run_dir, *, resume: bool = False, console=print):
        super().__init__(cfg, run_dir, resume=resume, console=console)
        self.gate = LagGate(self.acfg.batch_trajectories, self.acfg.max_lag)
        self.counters.update({"discarded_mixed": 0, "dropped_subtraces": 0, "folded_turns": 0,
                              "dropped_lag_on_resume": 0})
        self._failures = 0
        self._window = self._new_window()
        st = self._load_async_state()
        if st is not None:
            self._restore_buffer(st)

    def _restore_buffer(self, st) -> None:
        """Admit the checkpoint's buffer again; drop (counted, logged with ``at_resume``) the
        episodes whose lag against the restored version exceeds ``max_lag``."""
        g, v = self.gate, self.trainer.policy_version
        g.load_counters({**st.gate, "admitted": int(st.gate.get("admitted", 0)) - len(st.buffer)})
        for key, raw in st.buffer:
            self._admit(key, raw, raw[0].metadata.get("worker"), restored=True)
        dropped = 0
        for item in g.drop_stale(v):
            raw, _part = item.payload
            dropped += item.size
            self._log_raw(raw, status="dropped_lag", lag=v - item.oldest_version, at_resume=True)
        self.counters["dropped_lag_on_resume"] += dropped
        self._window["dropped_lag"] += dropped
        if dropped:
            self.console(f"resume: {dropped} buffered trajectories dropped: lag above max_lag={self.acfg.max_lag} "
                         f"against the restored version {v}")

    def _check_recipe(self, cfg: Config) -> None:
        obj = cfg.objective()
        if obj.kind == "pairwise":
            raise ValueError("recipe: dpo trains on offline pairs; asynchronous rollouts do not apply")
        if obj.group_size != 1:
            raise ValueError(
                f"recipe: {obj.name!r} uses groups of {obj.group_size}; single-rollout asynchronous training needs "
                "group_size 1 (use the sao recipe, or GroupedRayTrainer for a grouped baseline)")

    def _async_state(self):
        st = super()._async_state()
        st.gate = self.gate.state()
        st.buffer = [(item.key, item.payload[0]) for item in self.gate.pending]
        return st

    def save(self):
        """Admit every episode that has finished on the workers, then checkpoint (buffer included)."""
        while self.pool is not None and self.pool.jobs:
            got = self.pool.wait_one(timeout=0)
            if got is None:
                break
            self._handle(got)
        return super().save()

    @staticmethod
    def _new_window() -> Dict[str, float]:
        return {"t0": time.perf_counter(), "idle": 0.0, "episodes": 0, "trajectories": 0, "tokens": 0,
                "dropped_lag": 0, "discarded_mixed": 0}

    # ------------------------------------------------------------------ admission
    def _on_result(self, job: Job, res: Dict[str, Any]) -> None:
        raw: List[Trajectory] = list(res["trajectories"])
        w = self._window
        ntok = sum(t.num_action_tokens for t in raw)
        w["episodes"] += 1
        w["trajectories"] += len(raw)
        w["tokens"] += ntok
        self.counters["episodes_finished"] += 1
        self.counters["trajectories_finished"] += len(raw)
        self.counters["tokens_finished"] += ntok
        self._admit(job.key, raw, res.get("worker"))

    def _admit(self, key: str, raw: List[Trajectory], worker, restored: bool = False) -> None:
        """Apply the partial-rollout policy and queue the episode in the gate (a finished
        episode, or one ``restored`` from a checkpoint's buffer, whose sub-trace counts the
        restored counters hold already)."""
        part = apply_partial_policy(raw, self.acfg.partial)
        for t in raw:
            t.metadata["async"] = {"key": key, "versions": part.versions, "worker": worker}
        if part.dropped is not None or not part.kept:
            self.counters["discarded_mixed"] += 1
            self._window["discarded_mixed"] += 1
            self._log_raw(raw, status="discarded_mixed")
            return
        if not restored:
            self.counters["dropped_subtraces"] += part.dropped_subtraces
            self.counters["folded_turns"] += part.folded_turns
        for t in part.kept:
            t.metadata["async_key"] = f"{key}/{t.segment}"
        self.gate.admit(key, oldest_version(part.kept), size=len(part.kept), payload=(raw, part))

    def _drain_dropped(self) -> None:
        for item in self.gate.last_dropped:
            raw, _part = item.payload
            self._window["dropped_lag"] += item.size
            self._log_raw(raw, status="dropped_lag", lag=self.trainer.policy_version - item.oldest_version)
        self.gate.last_dropped = []

    # ------------------------------------------------------------------ one update
    def _update(self, batch: List[Admitted], progress) -> Dict[str, float]:
        tr = self.trainer
        v = tr.policy_version
        trajs: List[Trajectory] = []
        lags: List[int] = []
        mixed = 0
        ep_rewards = []
        for item in batch:
            raw, part = item.payload
            lag = self.gate.lag(item, v)
            trajs.extend(part.kept)
            lags.extend([lag] * len(part.kept))
            mixed += len(part.kept) if part.mixed else 0
            ep_rewards.append(float(raw[0].metadata.get("episode_reward", sum(t.total_reward for t in raw))))
            self._log_raw(raw, status="trained", lag=lag, learner_version=v)
        self._mark_trained([item.key for item in batch])
        m = self._learn(trajs)
        w, now = self._window, time.perf_counter()
        dt = max(now - w["t0"], 1e-9)
        total_t = max(now - self._t_start, 1e-9)
        g = self.gate
        m.update(lag_histogram(lags, self.acfg.max_lag))
        m.update({
            "lag/mean": float(np.mean(lags)), "lag/max": float(max(lags)),
            "lag/dropped": float(w["dropped_lag"]),
            "lag/dropped_frac": w["dropped_lag"] / max(w["dropped_lag"] + len(trajs), 1),
            "lag/dropped_total": float(g.dropped_lag_trajectories),
            "lag/dropped_frac_total": g.dropped_lag_trajectories / max(g.dropped_lag_trajectories + g.trained_trajectories, 1),
            "lag/dropped_on_resume": float(self.counters["dropped_lag_on_resume"]),
            "partial/mixed_frac": mixed / len(trajs),
            "partial/discarded_mixed": float(w["discarded_mixed"]),
            "partial/discarded_mixed_total": float(self.counters["discarded_mixed"]),
            "partial/folded_turns_total": float(self.counters["folded_turns"]),
            "partial/dropped_subtraces_total": float(self.counters["dropped_subtraces"]),
            "reward/episode_mean": float(np.mean(ep_rewards)),
            "batch/trajectories": float(len(trajs)), "batch/episodes": float(len(batch)),
            "throughput/trajectories_per_s": w["trajectories"] / dt,
            "throughput/episodes_per_s": w["episodes"] / dt,
            "throughput/tokens_per_s": w["tokens"] / dt,
            "throughput/trajectories_per_s_total": self.counters["trajectories_finished"] / total_t,
            "time/learner_idle": w["idle"], "time/learner_idle_frac": w["idle"] / dt, "time/step": dt,
            "queue/in_flight": float(len(self.pool.jobs)), "queue/pending": float(g.pending_trajectories),
            "queue/bound": float(self.acfg.queue_size),
            "faults/lost_episodes": float(self.counters["lost_episodes"]),
            "faults/failed_episodes": float(self.counters["failed_episodes"]),
            "faults/replaced_workers": float(self.pool.replaced),
            "faults/rerun_on_resume": float(self.counters["rerun_on_resume"]),
            "faults/lost_on_resume": float(self.counters["lost_on_resume"]),
        })
        if "trust/rejected_low" in m and "trust/rejected_high" in m:
            m["trust/rejected"] = m["trust/rejected_low"] + m["trust/rejected_high"]
        self._window = self._new_window()
        self._end_step(m, progress, ("reward/mean", "lag/mean", "trust/rejected", "loss"))
        return m

    # ------------------------------------------------------------------ the run
    def _handle(self, got) -> None:
        """One finished job: count a lost or failed episode, admit a finished one."""
        job, res, kind = got
        if kind == "lost":
            self.counters["lost_episodes"] += 1
            self.lost_keys.append(job.key)
        elif kind == "failed":
            self.counters["failed_episodes"] += 1
            self._failures += 1
            self._check_failures(self._failures, res.get("error"))
        else:
            self._failures = 0
            self._on_result(job, res)

    def _fill(self) -> None:
        while self._rerun:  # in flight at the checkpoint resumed from: first, from their tasks
            f, task = self._rerun.pop(0)
            self.pool.submit(f.key, task, f.seed)
        while len(self.pool.jobs) < self.acfg.queue_size:
            key, task, seed = self._episode_key()
            self.pool.submit(key, task, seed)

    def run(self, *, max_seconds: Optional[float] = None, stall_timeout: float = 900.0) -> Dict[str, Any]:
        """Train until ``train.steps`` updates (or ``max_seconds`` of training); the summary dict."""
        tr, cfg = self.trainer, self.cfg
        self._start()
        left = 0
        try:
            bar = self._begin(stall_timeout, "async")
            t_run = self._t_start
            self._window["t0"] = t_run  # the first window starts with training (a resume's drops stay in it)
            waited = 0.0
            while tr.step < cfg.train.steps:
                if max_seconds is not None and time.perf_counter() - t_run >= max_seconds:
                    break
                self._fill()
                t0 = time.perf_counter()
                got = self.pool.wait_one(timeout=1.0)
                dt = time.perf_counter() - t0
                self._window["idle"] += dt
                if got is None:
                    waited += dt
                    if waited > stall_timeout:
                        raise RuntimeError(f"rollout workers: no episode finished in {stall_timeout:.0f} s")
                    continue
                waited = 0.0
                self._handle(got)
                while tr.step < cfg.train.steps:
                    batch = self.gate.next_batch(tr.policy_version)
                    self._drain_dropped()
                    if batch is None:
                        break
                    self._update(batch, bar)
            bar.close()
            self._t_loop = time.perf_counter() - self._t_start
            self._final_save()
        finally:
            left = len(self.pool.jobs) if self.pool is not None else 0
            pending = len(self.gate.pending)
            self._stop()
        summary: Dict[str, Any] = {
            "steps": tr.step, "recipe": tr.objective.name, "mode": "async",
            "policy_version": tr.policy_version, "episodes_finished": self.counters["episodes_finished"],
            "trajectories_trained": self.gate.trained_trajectories, "dropped_lag": self.gate.dropped_lag_trajectories,
            "discarded_mixed": self.counters["discarded_mixed"], "lost_episodes": self.counters["lost_episodes"],
            "failed_episodes": self.counters["failed_episodes"], "replaced_workers": self.pool.replaced if self.pool else 0,
            "rerun_on_resume": self.counters["rerun_on_resume"], "lost_on_resume": self.counters["lost_on_resume"],
            "dropped_lag_on_resume": self.counters["dropped_lag_on_resume"],
            "unused_in_flight_at_end": left, "unused_pending_at_end": pending,
            "seconds": self._t_loop,
            "trajectories_per_s": self.counters["trajectories_finished"] / max(self._t_loop, 1e-9),
        }
        return self._finish(summary)
