"""Rollout workers on Ray: one actor per policy copy, and the pool that feeds and replaces them.

* :class:`RolloutWorker`: builds its own policy from the run's config and runs one episode
  at a time with :class:`~trajgrad.rollout.HFSampler`; before every turn it asks the
  :class:`~trajgrad.train.weight_store.WeightStore` for newer weights and loads them in place
  (an interrupted episode continues under the new policy, each turn keeping its version, §16).
  With ``rollout.backend: vllm`` it keeps no model: its requests go to the learner's vLLM
  server and name the newest adapter the store holds (:mod:`trajgrad.train.ray_vllm`).
* :class:`RolloutPool`: ``workers`` actors, their outstanding episodes (:class:`Job`), and
  the replacement of a dead actor (its episodes come back as ``"lost"``).

Each worker runs torch with ``torch_threads`` intra-op threads (1 in the Ray learners:
``workers`` processes share the machine's cores, and a tiny model gains nothing from more).
Every episode records where its worker's time went in the first sub-trace's
``metadata["worker_timing"]`` (:func:`episode_timing`): wall-clock, the worker's CPU time
(its episode thread and the whole process), the time that thread was runnable but waited
for a CPU (Linux), and the weight checks. A turn's ``gen_seconds`` is wall-clock; on an
oversubscribed machine most of it is that wait, not generation.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..envs import get_task_source
from ..envs.latency import with_latency
from ..model.build import build_policy_model
from ..rollout import HFSampler
from ..runtime.allocator import keep_freed_memory
from .config import build_config
from .ray_vllm import apply_served_state, worker_sampler
from .seeding import step_seed as _step_seed
from .weight_store import load_trainable_state

__all__ = ["RolloutWorker", "RolloutPool", "Job", "ClockReading", "thread_schedstat", "episode_timing"]


def thread_schedstat() -> Optional[Tuple[float, float]]:
    """``(cpu_seconds, runqueue_seconds)`` of the calling thread so far: the time it ran on a
    CPU and the time it was runnable but waited for one (``/proc/thread-self/schedstat``,
    nanoseconds); ``None`` where the kernel does not provide it."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return None


class ClockReading:
    """Wall-clock, process CPU, thread CPU and run-queue wait at one instant."""

    def __init__(self):
        self.wall = time.perf_counter()
        self.process = time.process_time()
        self.thread = time.thread_time()
        self.sched = thread_schedstat()


def episode_timing(start: "ClockReading", end: "ClockReading", sync_seconds: float, syncs: int) -> Dict[str, Any]:
    """Where a worker's time went between two :class:`ClockReading` readings on its episode thread.

    ``seconds`` wall-clock; ``thread_cpu_seconds`` the CPU time of that thread (generation,
    tokenization, the environment's own work); ``process_cpu_seconds`` the whole worker
    process's (Ray's threads included); ``runqueue_seconds`` how long the thread was
    runnable but waiting for a CPU (``None`` where unknown); ``sync_seconds`` / ``syncs`` the
    weight checks before the turns (wall-clock, loading included).
    """
    wait = None
    if start.sched is not None and end.sched is not None:
        wait = end.sched[1] - start.sched[1]
    return {"seconds": end.wall - start.wall, "thread_cpu_seconds": end.thread - start.thread,
            "process_cpu_seconds": end.process - start.process, "runqueue_seconds": wait,
            "sync_seconds": float(sync_seconds), "syncs": int(syncs)}


class RolloutWorker:
    """One rollout actor: its own policy copy, one episode at a time.

    Args:
      cfg_data: the run's config as a dict (``Config.model_dump()``).
      index: worker slot; with ``generation`` it seeds the environment latency stream.
      store: a :class:`WeightStore` actor handle (``None``: never sync, keep the
        initial weights; for in-process use).
      torch_threads: intra-op threads of this process.
      generation: how many times this slot was replaced before.
    """

    def __init__(self, cfg_data: Dict[str, Any], index: int, store=None, torch_threads: int = 1, generation: int = 0):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        if torch_threads:
            torch.set_num_threads(int(torch_threads))

        cfg = build_config(dict(cfg_data))
        self.cfg = cfg
        keep_freed_memory(cfg.train.keep_freed_mb)
        self.index = int(index)
        self.generation = int(generation)
        self.model, self.tokenizer = build_policy_model(cfg.model)
        self.model.eval()
        source = get_task_source(cfg.task.name, **cfg.task.options)
        lat_seed = _step_seed(cfg.train.seed, self.index, salt=1000 + self.generation)
        self.source = with_latency(source, cfg.asynchronous.env_latency, seed=lat_seed)
        s = cfg.sampling
        if cfg.rollout.backend == "vllm":  # the learner's vLLM server samples (trajgrad.train.ray_vllm)
            self.model = None
            self.sampler = worker_sampler(cfg, self.tokenizer)
        else:
            self.sampler = HFSampler(self.model, self.tokenizer, temperature=s.sampler_temperature, top_k=s.top_k,
                                     top_p=s.top_p, max_new_tokens=s.max_new_tokens, policy_version=0)
        self.sampler.template_mismatch = cfg.rollout.template_mismatch
        self.store = store
        self.version = -1  # nothing loaded from the store yet
        self.syncs = 0
        self.sync_seconds = 0.0

    def ready(self) -> int:
        return self.index

    def _sync(self, key: str, turn: int) -> None:
        if self.store is None:
            return
        import ray

        t0 = time.perf_counter()
        reply = ray.get(self.store.newer.remote(self.version, self.index, key, turn))
        if reply is not None:
            version, box = reply
            if self.model is None:
                apply_served_state(self.sampler, ray.get(box[0]))
            else:
                load_trainable_state(self.model, ray.get(box[0]))
            self.version = int(version)
            self.sampler.set_policy_version(self.version)
            self.syncs += 1
        self.sync_seconds += time.perf_counter() - t0

    def episode(self, key: str, task, seed: int) -> Dict[str, Any]:
        """Run one episode; returns its sub-traces and timings.

        Newer weights are loaded before every turn (``HFSampler.rollout(before_turn=...)``).
        The first sub-trace carries ``metadata["worker_timing"]`` (:func:`episode_timing`).
        """
        start = ClockReading()
        syncs0, sync_s0 = self.syncs, self.sync_seconds
        trajs = self.sampler.rollout(self.source, [task], group_size=1, seed=int(seed),
                                     before_turn=lambda turn: self._sync(key, turn))
        if self.store is not None:
            self.store.finished.remote(self.index, key)  # ordered before this worker's next call
        timing = episode_timing(start, ClockReading(), self.sync_seconds - sync_s0, self.syncs - syncs0)
        for t in trajs:
            t.metadata["worker"] = self.index
        if trajs:
            trajs[0].metadata["worker_timing"] = timing
        return {"key": key, "trajectories": trajs, "worker": self.index, "seconds": timing["seconds"],
                "syncs": timing["syncs"], "sync_seconds": timing["sync_seconds"]}


@dataclass
class _Slot:
    actor: Any
    generation: int


@dataclass
class Job:
    """An episode submitted to a worker."""

    key: str
    task: Any
    seed: int
    slot: int
    generation: int
    submitted: float
    group: Optional[str] = None


class RolloutPool:
    """``workers`` :class:`RolloutWorker` actors, their outstanding episodes, replacements.

    :meth:`submit` sends an episode to the least-loaded live actor; :meth:`wait_one`
    returns the first finished one as ``(job, result, kind)`` with ``kind`` ``"ok"``,
    ``"lost"`` (the actor died: it is replaced, once per death) or ``"failed"`` (the
    episode raised; the actor keeps serving).
    """

    def __init__(self, cfg_data: Dict[str, Any], workers: int, store, *, cpus_per_worker: float = 1.0,
                 torch_threads: int = 1):
        import ray

        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers: expected a positive integer, got {workers!r}")
        self._ray = ray
        self.cfg_data = cfg_data
        self.store = store
        self.cpus = float(cpus_per_worker)
        self.torch_threads = int(torch_threads)
        self._cls = ray.remote(RolloutWorker)
        self.slots: List[_Slot] = [self._spawn(i, 0) for i in range(workers)]
        self.jobs: Dict[Any, Job] = {}
        self.replaced = 0

    def _spawn(self, index: int, generation: int) -> _Slot:
        actor = self._cls.options(num_cpus=self.cpus, max_restarts=0, max_task_retries=0).remote(
            self.cfg_data, index, self.store, self.torch_threads, generation)
        return _Slot(actor, generation)

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        self._ray.get([s.actor.ready.remote() for s in self.slots], timeout=timeout)

    def outstanding(self, slot: int) -> int:
        gen = self.slots[slot].generation
        return sum(1 for j in self.jobs.values() if j.slot == slot and j.generation == gen)

    def submit(self, key: str, task, seed: int, group: Optional[str] = None) -> Job:
        slot = min(range(len(self.slots)), key=lambda i: (self.outstanding(i), i))
        s = self.slots[slot]
        ref = s.actor.episode.remote(key, task, int(seed))
        job = Job(key=key, task=task, seed=int(seed), slot=slot, generation=s.generation,
                  submitted=time.perf_counter(), group=group)
        self.jobs[ref] = job
        return job

    def wait_one(self, timeout: Optional[float] = None) -> Optional[Tuple[Job, Optional[Dict[str, Any]], str]]:
        if not self.jobs:
            return None
        ready, _ = self._ray.wait(list(self.jobs), num_returns=1, timeout=timeout)
        if not ready:
            return None
        ref = ready[0]
        job = self.jobs.pop(ref)
        exc = self._ray.exceptions
        try:
            return job, self._ray.get(ref), "ok"
        except (exc.RayActorError, exc.WorkerCrashedError):
            self._replace(job.slot, job.generation)
            return job, None, "lost"
        except exc.RayTaskError as err:
            return job, {"error": repr(err)}, "failed"

    def _replace(self, slot: int, generation: int) -> bool:
        cur = self.slots[slot]
        if cur.generation != generation:
            return False  # already replaced after this actor's death
        try:
            self._ray.kill(cur.actor, no_restart=True)
        except Exception:  # pragma: no cover - already gone
            pass
        self.slots[slot] = self._spawn(slot, generation + 1)
        self.replaced += 1
        return True

    def kill_worker(self, slot: int) -> None:
        """Kill one actor now (fault injection); its episodes come back as ``"lost"``."""
        self._ray.kill(self.slots[slot].actor, no_restart=True)

    def shutdown(self) -> int:
        """Kill every actor; returns the number of episodes still outstanding."""
        n = len(self.jobs)
        for s in self.slots:
            try:
                self._ray.kill(s.actor, no_restart=True)
            except Exception:  # pragma: no cover
                pass
        self.jobs.clear()
        return n
