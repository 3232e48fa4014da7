"""The learner side of the Ray runs: Ray session, weight store, worker pool, the run's frame.

:class:`RayLearner` is what :class:`~trajgrad.train.async_trainer.AsyncTrainer` and
:class:`~trajgrad.train.grouped.GroupedRayTrainer` share. It owns a
:class:`~trajgrad.train.trainer.Trainer` (``self.trainer``) that performs every update
(:meth:`Trainer.learn`) and goes through its public interface only: ``next_tasks``,
``task_at``, ``learn``, ``save``, ``resumed_from``, ``finish``, and the shared frame of :mod:`trajgrad.train.loop`
(preamble, step cadence). Every checkpoint also holds the learner's asynchronous state
(:mod:`trajgrad.train.async_state`: the finished, untrained episodes, the episodes in
flight, the trained-episode ledger, the counters), written atomically with the weights; a
resumed run re-runs the in-flight episodes from their tasks and refuses to train an episode
the ledger holds.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._optional import require
from ..rollout import Trajectory
from . import loop
from .async_state import ASYNC_STATE_FILE, AsyncState, IndexSet, InFlight, dump_async_state, episode_index, \
    episode_key, load_async_state, plan_rerun
from .config import Config
from .config_checks import ray_backend_error
from .partial import PARTIAL_POLICIES
from .ray_vllm import served_state, share_server
from .seeding import step_seed
from .trainer import Trainer
from .weight_store import WeightStore, trainable_state
from .workers import RolloutPool

__all__ = ["RayLearner", "ASYNC_STATE_FILE"]


class RayLearner:
    """Shared machinery: Ray session, weight store, pool, publishing, the run's frame."""

    def __init__(self, cfg: Config, run_dir, *, resume: bool = False, console=print):
        self.cfg = cfg
        self.acfg = cfg.asynchronous
        if self.acfg.partial not in PARTIAL_POLICIES:  # pragma: no cover - pydantic checks it
            raise ValueError(f"asynchronous.partial: expected one of {PARTIAL_POLICIES}")
        self._check_recipe(cfg)
        if ray_backend_error(cfg.rollout.backend):
            raise ValueError(f"rollout.backend: {ray_backend_error(cfg.rollout.backend)}")
        self.console = console
        self.trainer = Trainer(cfg, run_dir, resume=resume, console=console)
        self.run_dir = self.trainer.run_dir
        self.resume = resume
        self.pool: Optional[RolloutPool] = None
        self.store = None
        self._owns_ray = False
        self._published = -1
        self._weights_ref = None
        self.counters: Dict[str, float] = {
            "episodes_finished": 0, "trajectories_finished": 0, "tokens_finished": 0,
            "lost_episodes": 0, "failed_episodes": 0, "rerun_on_resume": 0, "lost_on_resume": 0,
        }
        self.lost_keys: List[str] = []
        self.trained = IndexSet()  # data positions of the episodes (groups) trained so far
        self._rerun: List[Tuple[InFlight, Any]] = []  # in flight at the checkpoint resumed from
        self._t_start = time.perf_counter()
        self._t_loop = 0.0
        self._saved_step = -1

    def _check_recipe(self, cfg: Config) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ Ray
    def _start(self) -> None:
        ray = require("ray", "the asynchronous trainers (SAO, grouped GRPO on Ray)")

        if not ray.is_initialized():
            kw: Dict[str, Any] = {"log_to_driver": False, "ignore_reinit_error": True}
            if self.acfg.ray_address:
                ray.init(address=self.acfg.ray_address, **kw)
            else:
                ray.init(num_cpus=max(self.acfg.workers + 1, os.cpu_count() or 1), include_dashboard=False, **kw)
            self._owns_ray = True
        total = float(ray.cluster_resources().get("CPU", 1.0))
        cpus = min(1.0, total / max(self.acfg.workers, 1))
        self.store = ray.remote(WeightStore).options(num_cpus=0).remote()
        cfg_data = self.cfg.model_dump()
        if self.cfg.rollout.backend == "vllm":  # the workers share the learner's server (trajgrad.train.ray_vllm)
            cfg_data = share_server(self.trainer.sampler, cfg_data)
        self.pool = RolloutPool(cfg_data, self.acfg.workers, self.store, cpus_per_worker=cpus, torch_threads=1)

    def _stop(self) -> int:
        import ray

        left = 0
        if self.pool is not None:
            left = self.pool.shutdown()
        if self.store is not None:
            try:
                ray.kill(self.store)
            except Exception:  # pragma: no cover
                pass
            self.store = None
        self._weights_ref = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
        return left

    def publish(self) -> int:
        """Send the learner's trainable tensors to the store under its policy version."""
        import ray

        v = int(self.trainer.policy_version)
        vllm = self.cfg.rollout.backend == "vllm"  # the trainer synced the server: publish the served name
        ref = ray.put(served_state(self.trainer.sampler) if vllm else trainable_state(self.trainer.model))
        ray.get(self.store.publish.remote(v, [ref]))
        self._weights_ref = ref
        self._published = v
        return v

    def worker_progress(self) -> Dict[int, Tuple[str, int, float]]:
        """Per worker slot: (episode key, turn index, time) of its last weight check; the
        turn index is -1 once that episode has ended."""
        import ray

        return ray.get(self.store.get_progress.remote())

    # ------------------------------------------------------------------ frame
    def _begin(self, stall_timeout: float, desc: str):
        """Preamble, workers ready, first weights published; the progress bar."""
        loop.preamble(self.trainer, self.save)
        self.pool.wait_ready(timeout=stall_timeout)
        self.publish()
        self._t_start = time.perf_counter()
        return loop.progress_bar(self.trainer, self.cfg.train.steps, f"{self.trainer.objective.name} {desc}",
                                 initial=self.trainer.step)

    def _learn(self, trajs: List[Trajectory]) -> Dict[str, float]:
        """One update by the trainer; newer weights go to the workers."""
        m = self.trainer.learn(trajs)
        if self.trainer.policy_version != self._published:
            self.publish()
        return m

    def _end_step(self, m: Dict[str, float], bar, postfix: Sequence[str]) -> None:
        loop.end_of_step(self.trainer, m, self.save, bar, postfix=tuple((k, k) for k in postfix), say_eval=False)

    def _finish(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        """The trainer's own finishing step (held-out evaluation, summary.json)."""
        return self.trainer.finish(summary)

    def _async_state(self) -> AsyncState:
        """What the checkpoint keeps besides the weights (subclasses add the buffer)."""
        return AsyncState(step=self.trainer.step, counters=dict(self.counters), trained=self.trained,
                          in_flight=self._in_flight())

    def _in_flight(self) -> List[InFlight]:
        """The episodes submitted and not finished (and those still to be re-run)."""
        out = [f for f, _ in self._rerun]
        for job in (self.pool.jobs.values() if self.pool is not None else ()):
            out.append(InFlight(job.key, episode_index(job.key), job.seed, str(job.task.id)))
        return out

    def _mark_trained(self, keys: Sequence[str]) -> None:
        """Record episodes (groups) as trained; an episode trained before is a broken invariant."""
        idx = [episode_index(k) for k in keys]
        again = [k for k, i in zip(keys, idx) if i in self.trained]
        if again or len(set(idx)) != len(idx):
            raise RuntimeError(f"episodes {again or list(keys)} would be trained twice")
        for i in idx:
            self.trained.add(i)

    def _final_save(self) -> None:
        """Checkpoint a run stopped early (``max_seconds``) unless its last step was saved."""
        if self.cfg.checkpoint.every and self._saved_step != self.trainer.step:
            self.save()

    def save(self) -> Path:
        """A checkpoint of the trainer with :data:`ASYNC_STATE_FILE` inside it (one atomic write)."""
        self._saved_step = self.trainer.step
        return self.trainer.save(files={ASYNC_STATE_FILE: dump_async_state(self._async_state())})

    def _load_async_state(self) -> Optional[AsyncState]:
        """The asynchronous state of the checkpoint a resumed run loaded (None for a new run);
        counters and ledger restored, the in-flight episodes queued to run again."""
        path = self.trainer.resumed_from
        if path is None:
            return None
        if not (path / ASYNC_STATE_FILE).exists():
            return self._load_legacy_state()
        st = load_async_state(path)
        if st.step != self.trainer.step:
            raise ValueError(f"checkpoint: {path / ASYNC_STATE_FILE} is of step {st.step}, the checkpoint of {self.trainer.step}")
        self.counters.update(st.counters)
        self.trained = st.trained
        self._rerun, lost = plan_rerun(st.in_flight, self.trainer.task_at)
        self.counters["rerun_on_resume"] += len(self._rerun)
        self.counters["lost_on_resume"] += len(lost)
        self.console(f"resume: {len(st.buffer)} finished episode(s) kept for training, {len(self._rerun)} episode(s) "
                     f"in flight run again from their tasks" + (f", {len(lost)} lost (their data positions now hold "
                                                                 "other tasks)" if lost else ""))
        return st

    def _load_legacy_state(self) -> Optional[AsyncState]:
        """A checkpoint written before checkpoints held the asynchronous state: the counters
        from ``run_dir/async_state.json`` when it is of the same step; its episodes in flight
        were not recorded and count as ``lost_on_resume``."""
        p = self.run_dir / ASYNC_STATE_FILE
        try:
            old = json.loads(p.read_text())
        except (OSError, ValueError):
            old = None
        if not isinstance(old, dict) or int(old.get("step", -1)) != self.trainer.step:
            self.console(f"resume: the checkpoint holds no {ASYNC_STATE_FILE}; the asynchronous counters start from 0")
            return None
        self.counters.update(old.get("counters", {}))
        self.counters["lost_on_resume"] += int(old.get("in_flight", 0))
        self.console(f"resume: the checkpoint holds no {ASYNC_STATE_FILE}; {int(old.get('in_flight', 0))} episode(s) "
                     "in flight then are lost (their tasks were not recorded)")
        return AsyncState(step=self.trainer.step, counters=dict(old.get("counters", {})), gate=dict(old.get("gate", {})))

    def _episode_key(self) -> Tuple[str, Any, int]:
        idx = self.trainer.cursor
        task = self.trainer.next_tasks(1)[0]
        return episode_key(idx), task, step_seed(self.cfg.train.seed, idx, salt=31)

    def _log_raw(self, raw: Sequence[Trajectory], **info) -> None:
        for t in raw:
            t.metadata.setdefault("async", {}).update(info)
        self.trainer.traj_log.extend(list(raw))

    def _check_failures(self, consecutive: int, last: Any) -> None:
        if consecutive > 4 * self.acfg.workers + 8:
            raise RuntimeError(f"rollout workers: {consecutive} episodes failed in a row; last error: {last}")


_RayLearner = RayLearner  # the previous name
