r"""Single-Rollout Asynchronous Optimization on Ray (§20), with partial rollouts (§16).

Why (§20.1). A grouped method draws :math:`G` rollouts per prompt and cannot form its
group-relative advantage before the slowest one ends, :math:`T_{ready}=\max_i T_i`. The
total within-group wait

.. math::

   W=\sum_{i=1}^{G}\big(T_{\mathrm{ready}}-T_i\big)

is idle work, and if the learner keeps updating meanwhile the early members grow stale.
SAO samples *one* rollout per prompt and admits it the moment it finishes; a critic with
token-level skip-observation GAE replaces the group baseline (§20.3, §20.4), and the
policy term is direct double-sided importance sampling against the probabilities the
rollout engine recorded (§20.2).

The pipeline (:class:`AsyncTrainer`):

* **Rollout workers** are Ray actors (:class:`RolloutWorker`). Each holds its own copy
  of the policy, built from the same config (the tiny model, or SmolLM2 + LoRA), and
  runs one episode at a time with :class:`~trajgrad.rollout.HFSampler`, which records
  every token's behaviour log-prob and the policy version of every turn.
* **Weights** are published by the learner after every update: only the trainable
  tensors (the LoRA adapters, or all parameters of a model trained in full) go to the
  object store with ``ray.put``; a small :class:`WeightStore` actor keeps the newest
  ``(version, reference)``. Between two turns of a running episode (the sampler's
  ``before_turn`` hook) a worker asks for newer weights and loads them in place, so an
  episode interrupted by an update continues under the new policy; the turns keep their
  own versions and behaviour log-probs (§16), and ``asynchronous.partial`` decides how
  such episodes are trained (:mod:`trajgrad.train.partial`).
* **The learner** (the driver process) keeps at most ``asynchronous.queue_size``
  episodes in flight, waits with ``ray.wait(num_returns=1)`` and admits each episode as
  soon as it finishes. Whenever ``batch_trajectories`` admitted trajectories are ready it
  performs one update with :meth:`Trainer.learn` (collation, rewards, the critic's
  ``K`` updates, skip-observation GAE, the SAO loss: nothing is re-implemented here).
* **Lag.** The policy lag of an episode is the learner's version at the update minus
  the *oldest* version that sampled any token it would train. Episodes whose lag exceeds
  ``max_lag`` are dropped and counted, never trained; an episode is trained at most once
  (:class:`LagGate`, a pure class). With ``partial="newest_segment"`` the folded turns
  are context, not samples, so they do not count.
* **Faults.** If a worker dies mid-episode (``ray.kill``, a crash: ``RayActorError``),
  the run goes on: a replacement actor is started, every episode that actor held is
  counted in ``faults/lost_episodes`` and none of its tokens is trained (an episode only
  reaches the learner as a whole, after it finished).
* **Compaction** (§19): an environment emitting ``info["compact"]`` yields several
  sub-traces per episode; all of them are admitted together and trained with the
  token-level loss and per-token (per-sub-trace) critic values.
* **Checkpoints** reuse :meth:`Trainer.save` and ``resume``; the asynchronous counters
  go to ``async_state.json``. Episodes in flight when a run is killed are lost and
  counted (``faults/lost_on_resume``) when it resumes.

:class:`GroupedRayTrainer` is the synchronous grouped baseline on the same actors: each
step dispatches ``prompts_per_step x G`` rollouts, waits for all of them (the group
barrier), logs :math:`W` (:func:`group_wait`) and performs one update.

Ray: a local cluster by default (``ray.init(num_cpus=..., include_dashboard=False)``);
``asynchronous.ray_address`` (``trajgrad train --ray-address``) joins an existing one,
whose nodes must have ``trajgrad`` installed. A session that already called
``ray.init`` is reused and left running.
"""
from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..rollout import HFSampler, Trajectory
from .config import PRESETS, Config, build_config
from .partial import PARTIAL_POLICIES, apply_partial_policy, oldest_version
from .trainer import Trainer, _fmt_eval, _step_seed

__all__ = [
    "AsyncTrainer",
    "GroupedRayTrainer",
    "LagGate",
    "Admitted",
    "RolloutWorker",
    "RolloutPool",
    "WeightStore",
    "group_wait",
    "trainable_state",
    "load_trainable_state",
    "lag_histogram",
    "SAO_PRESETS",
]

ASYNC_STATE_FILE = "async_state.json"


# ====================================================================== pure pieces
def group_wait(finish_times: Sequence[float]) -> float:
    r"""Within-group waiting work :math:`W=\sum_i (T_{ready}-T_i)`, :math:`T_{ready}=\max_i T_i` (§20.1).

    Args:
      finish_times: the finish times :math:`T_1..T_G` of one group's rollouts (seconds,
        any common origin), at least one, all finite.
    """
    try:
        ts = [float(t) for t in finish_times]
    except (TypeError, ValueError):
        raise ValueError(f"finish_times: expected a sequence of numbers, got {finish_times!r}") from None
    if not ts:
        raise ValueError("finish_times: empty group")
    if not all(math.isfinite(t) for t in ts):
        raise ValueError(f"finish_times: must be finite, got {ts}")
    ready = max(ts)
    return float(sum(ready - t for t in ts))


def lag_histogram(lags: Sequence[int], max_lag: int) -> Dict[str, int]:
    """Counts ``lag/hist_0 .. lag/hist_{max_lag}`` (lags above ``max_lag`` in ``lag/hist_over``)."""
    out = {f"lag/hist_{k}": 0 for k in range(max_lag + 1)}
    out["lag/hist_over"] = 0
    for lag in lags:
        if lag < 0:
            raise ValueError(f"lags: negative lag {lag}")
        out[f"lag/hist_{lag}" if lag <= max_lag else "lag/hist_over"] += 1
    return out


@dataclass
class Admitted:
    """One finished episode waiting for an update.

    Attributes:
      key: unique id of the episode.
      oldest_version: oldest policy version that sampled a token to be trained.
      size: number of trajectories (sub-traces) it contributes.
      payload: anything (the trainer stores the trajectories).
    """

    key: str
    oldest_version: int
    size: int = 1
    payload: Any = None


class LagGate:
    r"""Admission and lag bookkeeping of the asynchronous learner (no Ray, no model).

    Finished episodes are :meth:`admit`-ted in completion order. :meth:`next_batch`,
    called with the learner's current version :math:`v`, first drops every pending
    episode whose lag :math:`v-v_{oldest}` exceeds ``max_lag`` (counted, never
    returned), then, once at least ``batch_trajectories`` trajectories are pending,
    returns whole episodes in admission order until that many are reached. An episode
    key is accepted once: a second :meth:`admit` of the same key is refused and counted,
    so no trajectory is trained twice.

    Invariant (tested): every episode returned by ``next_batch(v)`` has
    ``0 <= v - oldest_version <= max_lag``, and
    ``admitted == trained + dropped_lag + pending``.
    """

    def __init__(self, batch_trajectories: int, max_lag: int):
        if isinstance(batch_trajectories, bool) or not isinstance(batch_trajectories, int) or batch_trajectories < 1:
            raise ValueError(f"batch_trajectories: expected a positive integer, got {batch_trajectories!r}")
        if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
            raise ValueError(f"max_lag: expected a non-negative integer, got {max_lag!r}")
        self.batch_trajectories = batch_trajectories
        self.max_lag = max_lag
        self.pending: Deque[Admitted] = deque()
        self._seen: set = set()
        self.admitted = 0
        self.trained = 0
        self.trained_trajectories = 0
        self.dropped_lag = 0
        self.dropped_lag_trajectories = 0
        self.duplicates = 0
        self.last_dropped: List[Admitted] = []

    @property
    def pending_trajectories(self) -> int:
        return sum(a.size for a in self.pending)

    def admit(self, key: str, oldest_version: int, size: int = 1, payload: Any = None) -> bool:
        """Queue a finished episode; False (and counted) if ``key`` was admitted before."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key: expected a non-empty string, got {key!r}")
        if isinstance(oldest_version, bool) or not isinstance(oldest_version, (int, np.integer)) or oldest_version < 0:
            raise ValueError(f"oldest_version: expected a non-negative integer, got {oldest_version!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size: expected a positive integer, got {size!r}")
        if key in self._seen:
            self.duplicates += 1
            return False
        self._seen.add(key)
        self.pending.append(Admitted(key, int(oldest_version), size, payload))
        self.admitted += 1
        return True

    def lag(self, item: Admitted, learner_version: int) -> int:
        lag = int(learner_version) - item.oldest_version
        if lag < 0:
            raise ValueError(
                f"learner_version: {learner_version} is older than version {item.oldest_version} that sampled {item.key!r}"
            )
        return lag

    def drop_stale(self, learner_version: int) -> List[Admitted]:
        """Remove (and count) the pending episodes whose lag exceeds ``max_lag``."""
        keep: Deque[Admitted] = deque()
        dropped: List[Admitted] = []
        for item in self.pending:
            (dropped if self.lag(item, learner_version) > self.max_lag else keep).append(item)
        self.pending = keep
        self.dropped_lag += len(dropped)
        self.dropped_lag_trajectories += sum(a.size for a in dropped)
        return dropped

    def next_batch(self, learner_version: int) -> Optional[List[Admitted]]:
        """The next update's episodes (FIFO), or None while fewer than ``batch_trajectories``
        fresh trajectories are pending. Stale episodes are dropped first
        (:attr:`last_dropped`)."""
        if isinstance(learner_version, bool) or not isinstance(learner_version, (int, np.integer)) or learner_version < 0:
            raise ValueError(f"learner_version: expected a non-negative integer, got {learner_version!r}")
        self.last_dropped = self.drop_stale(int(learner_version))
        if self.pending_trajectories < self.batch_trajectories:
            return None
        batch: List[Admitted] = []
        n = 0
        while n < self.batch_trajectories:
            item = self.pending.popleft()
            batch.append(item)
            n += item.size
        self.trained += len(batch)
        self.trained_trajectories += n
        return batch

    def state(self) -> Dict[str, int]:
        return {"admitted": self.admitted, "trained": self.trained, "trained_trajectories": self.trained_trajectories,
                "dropped_lag": self.dropped_lag, "dropped_lag_trajectories": self.dropped_lag_trajectories,
                "duplicates": self.duplicates}

    def load_counters(self, state: Mapping[str, int]) -> None:
        for k in ("trained", "trained_trajectories", "dropped_lag", "dropped_lag_trajectories", "duplicates"):
            if k in state:
                setattr(self, k, int(state[k]))


# ====================================================================== weights
def trainable_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The tensors a weight sync sends: every parameter with ``requires_grad`` (the LoRA
    adapters of a PEFT model, all parameters of a model trained in full), detached, on CPU."""
    out = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}
    if not out:
        raise ValueError("model: has no trainable parameters to publish")
    return out


@torch.no_grad()
def load_trainable_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> int:
    """Copy ``state`` (from :func:`trainable_state`) into ``model``'s parameters in place.

    Every name must be a parameter of ``model`` with the same shape; returns the number
    of tensors copied.
    """
    params = dict(model.named_parameters())
    for name, value in state.items():
        p = params.get(name)
        if p is None:
            raise ValueError(f"state: {name!r} is not a parameter of the model")
        if tuple(p.shape) != tuple(value.shape):
            raise ValueError(f"state: {name!r} has shape {tuple(value.shape)}, the model's is {tuple(p.shape)}")
        p.copy_(torch.as_tensor(value).to(device=p.device, dtype=p.dtype))
    return len(state)


class WeightStore:
    """Newest published weights (a Ray actor in :class:`AsyncTrainer`).

    Holds ``(version, [ObjectRef])``: the reference sits inside a list so that Ray
    passes it on instead of resolving it. Workers also report their progress (episode
    key and turn index) when they ask, for monitoring and fault-injection tests.
    """

    def __init__(self):
        self.version = -1
        self.box = None
        self.progress: Dict[int, Tuple[str, int, float]] = {}

    def publish(self, version: int, box: list) -> int:
        if version < self.version:
            raise ValueError(f"version: {version} is older than the published {self.version}")
        self.version = int(version)
        self.box = box
        return self.version

    def newer(self, version: int, worker: Optional[int] = None, key: Optional[str] = None, turn: Optional[int] = None):
        if worker is not None:
            self.progress[int(worker)] = (key, turn, time.time())
        if self.box is not None and self.version > version:
            return self.version, self.box
        return None

    def latest_version(self) -> int:
        return self.version

    def finished(self, worker: int, key: str) -> None:
        """A worker's episode ended: its progress turn becomes -1."""
        self.progress[int(worker)] = (key, -1, time.time())

    def get_progress(self) -> Dict[int, Tuple[str, int, float]]:
        return dict(self.progress)


# ====================================================================== rollout worker
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
        from ..envs import get_task_source
        from ..envs.latency import with_latency
        from .models import build_policy_model

        cfg = build_config(dict(cfg_data))
        self.cfg = cfg
        self.index = int(index)
        self.generation = int(generation)
        self.model, self.tokenizer = build_policy_model(cfg.model)
        self.model.eval()
        source = get_task_source(cfg.task.name, **cfg.task.options)
        lat_seed = _step_seed(cfg.train.seed, self.index, salt=1000 + self.generation)
        self.source = with_latency(source, cfg.asynchronous.env_latency, seed=lat_seed)
        s = cfg.sampling
        self.sampler = HFSampler(self.model, self.tokenizer, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                 max_new_tokens=s.max_new_tokens, policy_version=0)
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
            load_trainable_state(self.model, ray.get(box[0]))
            self.version = int(version)
            self.sampler.set_policy_version(self.version)
            self.syncs += 1
        self.sync_seconds += time.perf_counter() - t0

    def episode(self, key: str, task, seed: int) -> Dict[str, Any]:
        """Run one episode; returns its sub-traces and timings.

        Newer weights are loaded before every turn (``HFSampler.rollout(before_turn=...)``).
        """
        t0 = time.perf_counter()
        syncs0, sync_s0 = self.syncs, self.sync_seconds
        trajs = self.sampler.rollout(self.source, [task], group_size=1, seed=int(seed),
                                     before_turn=lambda turn: self._sync(key, turn))
        if self.store is not None:
            self.store.finished.remote(self.index, key)  # ordered before this worker's next call
        for t in trajs:
            t.metadata["worker"] = self.index
        return {"key": key, "trajectories": trajs, "worker": self.index, "seconds": time.perf_counter() - t0,
                "syncs": self.syncs - syncs0, "sync_seconds": self.sync_seconds - sync_s0}


# ====================================================================== pool of actors
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


# ====================================================================== the learners
class _RayLearner:
    """Shared machinery: Ray session, weight store, pool, publishing, the run's frame."""

    def __init__(self, cfg: Config, run_dir, *, resume: bool = False, console=print):
        self.cfg = cfg
        self.acfg = cfg.asynchronous
        if self.acfg.partial not in PARTIAL_POLICIES:  # pragma: no cover - pydantic checks it
            raise ValueError(f"asynchronous.partial: expected one of {PARTIAL_POLICIES}")
        self._check_recipe(cfg)
        self.console = console
        self.trainer = Trainer(cfg, run_dir, resume=resume, console=console)
        self.run_dir = self.trainer.run_dir
        self.resume = resume
        self.pool: Optional[RolloutPool] = None
        self.store = None
        self._owns_ray = False
        self._published = -1
        self._weights_ref = None
        self.nonce = uuid.uuid4().hex[:8]
        self.counters: Dict[str, float] = {
            "episodes_finished": 0, "trajectories_finished": 0, "tokens_finished": 0,
            "lost_episodes": 0, "failed_episodes": 0, "lost_on_resume": 0,
        }
        self.lost_keys: List[str] = []
        self._t_start = time.perf_counter()
        self._t_loop = 0.0
        self._saved_step = -1

    def _check_recipe(self, cfg: Config) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ Ray
    def _start(self) -> None:
        import ray

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
        self.pool = RolloutPool(self.cfg.model_dump(), self.acfg.workers, self.store, cpus_per_worker=cpus,
                                torch_threads=1)

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
        ref = ray.put(trainable_state(self.trainer.model))
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
    def _preamble(self) -> None:
        from tqdm.auto import tqdm

        tr, cfg = self.trainer, self.cfg
        if self.resume:
            return
        if cfg.eval.before:
            self.console(f"evaluating on {len(tr.heldout_tasks)} held-out tasks (before training)...")
            tr.eval_before = tr.evaluate("before")
            self.console(_fmt_eval("before", tr.eval_before))
        if cfg.sft.steps > 0:
            bar = tqdm(total=cfg.sft.steps, desc="sft warm start", disable=not cfg.log.progress, dynamic_ncols=True)

            def prog(s, loss):
                bar.update(1)
                bar.set_postfix(nll=f"{loss:.3f}")
                tr.metrics.log(s, {"sft/nll": loss}, kind="sft")

            tr.sft(cfg.sft.steps, cfg.sft.batch_size, cfg.sft.lr, progress=prog)
            bar.close()
            if cfg.eval.before:
                self.console(_fmt_eval("after SFT", tr.evaluate("after_sft")))
        tr._snapshot_reference()  # pi_ref = the policy when RL starts
        if cfg.checkpoint.every:
            self.save()

    def _finish(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        """The trainer's own finishing step (held-out evaluation, summary.json)."""
        return self.trainer.finish(summary)

    def _async_state(self) -> Dict[str, Any]:
        return {"step": self.trainer.step, "counters": dict(self.counters)}

    def _final_save(self) -> None:
        """Checkpoint a run stopped early (``max_seconds``) unless its last step was saved."""
        if self.cfg.checkpoint.every and self._saved_step != self.trainer.step:
            self.save()

    def save(self) -> Path:
        self._saved_step = self.trainer.step
        path = self.trainer.save()
        tmp = self.run_dir / (ASYNC_STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self._async_state(), default=float))
        os.replace(tmp, self.run_dir / ASYNC_STATE_FILE)
        return path

    def _load_async_state(self) -> Optional[Dict[str, Any]]:
        p = self.run_dir / ASYNC_STATE_FILE
        if not self.resume or not p.exists():
            return None
        st = json.loads(p.read_text())
        if int(st.get("step", -1)) != self.trainer.step:
            return None
        for k, v in st.get("counters", {}).items():
            self.counters[k] = v
        return st

    def _episode_key(self) -> Tuple[str, Any, int]:
        idx = self.trainer.cursor
        task = self.trainer._next_tasks(1)[0]
        seed = _step_seed(self.cfg.train.seed, idx, salt=31)
        return f"{self.nonce}-{idx}", task, seed

    def _log_raw(self, raw: Sequence[Trajectory], **info) -> None:
        for t in raw:
            t.metadata.setdefault("async", {}).update(info)
        self.trainer.traj_log.extend(list(raw))

    def _check_failures(self, consecutive: int, last: Any) -> None:
        if consecutive > 4 * self.acfg.workers + 8:
            raise RuntimeError(f"rollout workers: {consecutive} episodes failed in a row; last error: {last}")


class AsyncTrainer(_RayLearner):
    """SAO: single rollouts on Ray actors, admitted when ready, bounded lag (§20, §16).

    Args:
      cfg: the run's :class:`Config`; ``cfg.asynchronous`` sets workers, ``max_lag``,
        ``batch_trajectories``, ``queue_size`` (episodes in flight), ``partial``,
        ``ray_address`` and ``env_latency``. The recipe must use one rollout per prompt
        (``sao``, ``ppo``, ``reinforce``, ``opd``).
      run_dir: the run directory (same layout as :class:`Trainer`'s, plus
        ``async_state.json``).
      resume: continue from the latest checkpoint of ``run_dir``.
      console: where to print.

    :meth:`run` trains ``train.steps`` updates (or until ``max_seconds``) and returns the
    summary dict. ``self.trainer`` is the :class:`Trainer` that performs each update.
    """

    def __init__(self, cfg: Config, run_dir, *, resume: bool = False, console=print):
        super().__init__(cfg, run_dir, resume=resume, console=console)
        self.gate = LagGate(self.acfg.batch_trajectories, self.acfg.max_lag)
        self.counters.update({"discarded_mixed": 0, "dropped_subtraces": 0, "folded_turns": 0})
        st = self._load_async_state()
        if st is not None:
            self.gate.load_counters(st.get("gate", {}))
            self.counters["lost_on_resume"] += int(st.get("in_flight", 0))
        self._window = self._new_window()

    def _check_recipe(self, cfg: Config) -> None:
        obj = cfg.objective()
        if obj.loss == "dpo":
            raise ValueError("recipe: dpo trains on offline pairs; asynchronous rollouts do not apply")
        if obj.group_size != 1:
            raise ValueError(
                f"recipe: {obj.name!r} uses groups of {obj.group_size}; single-rollout asynchronous training needs "
                "group_size 1 (use the sao recipe, or GroupedRayTrainer for a grouped baseline)")

    def _async_state(self) -> Dict[str, Any]:
        st = super()._async_state()
        st["gate"] = self.gate.state()
        st["in_flight"] = (len(self.pool.jobs) if self.pool is not None else 0) + len(self.gate.pending)
        return st

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
        part = apply_partial_policy(raw, self.acfg.partial)
        for t in raw:
            t.metadata["async"] = {"key": job.key, "versions": part.versions, "worker": res.get("worker")}
        if part.dropped is not None or not part.kept:
            self.counters["discarded_mixed"] += 1
            w["discarded_mixed"] += 1
            self._log_raw(raw, status="discarded_mixed")
            return
        self.counters["dropped_subtraces"] += part.dropped_subtraces
        self.counters["folded_turns"] += part.folded_turns
        for t in part.kept:
            t.metadata["async_key"] = f"{job.key}/{t.segment}"
        self.gate.admit(job.key, oldest_version(part.kept), size=len(part.kept), payload=(raw, part))

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
        m = tr.learn(trajs)
        tr.step += 1
        if tr.policy_version != self._published:
            self.publish()
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
            "faults/lost_on_resume": float(self.counters["lost_on_resume"]),
        })
        if "trust/rejected_low" in m and "trust/rejected_high" in m:
            m["trust/rejected"] = m["trust/rejected_low"] + m["trust/rejected_high"]
        tr.metrics.log(tr.step, m, kind="train")
        self._window = self._new_window()
        if progress is not None:
            progress.update(1)
            progress.set_postfix({k: f"{m[k]:.3g}" for k in ("reward/mean", "lag/mean", "trust/rejected", "loss") if k in m})
        cfg = self.cfg
        if cfg.eval.every and tr.step % cfg.eval.every == 0 and tr.step < cfg.train.steps:
            tr.evaluate("during")
        if cfg.checkpoint.every and (tr.step % cfg.checkpoint.every == 0 or tr.step == cfg.train.steps):
            self.save()
        return m

    # ------------------------------------------------------------------ the run
    def _fill(self) -> None:
        while len(self.pool.jobs) < self.acfg.queue_size:
            key, task, seed = self._episode_key()
            self.pool.submit(key, task, seed)

    def run(self, *, max_seconds: Optional[float] = None, stall_timeout: float = 900.0) -> Dict[str, Any]:
        """Train until ``train.steps`` updates (or ``max_seconds`` of training); the summary dict."""
        from tqdm.auto import tqdm

        tr, cfg = self.trainer, self.cfg
        self._start()
        left = 0
        try:
            self._preamble()
            self.pool.wait_ready(timeout=stall_timeout)
            self.publish()
            bar = tqdm(total=cfg.train.steps, initial=tr.step, desc=f"{tr.objective.name} async",
                       disable=not cfg.log.progress, dynamic_ncols=True)
            t_run = time.perf_counter()
            self._t_start = t_run
            self._window = self._new_window()
            failures = 0
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
                job, res, kind = got
                if kind == "lost":
                    self.counters["lost_episodes"] += 1
                    self.lost_keys.append(job.key)
                    continue
                if kind == "failed":
                    self.counters["failed_episodes"] += 1
                    failures += 1
                    self._check_failures(failures, res.get("error"))
                    continue
                failures = 0
                self._on_result(job, res)
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
            "unused_in_flight_at_end": left, "unused_pending_at_end": pending,
            "seconds": self._t_loop,
            "trajectories_per_s": self.counters["trajectories_finished"] / max(self._t_loop, 1e-9),
        }
        return self._finish(summary)


class GroupedRayTrainer(_RayLearner):
    r"""The synchronous grouped baseline on the same Ray actors (for §20.1 comparisons).

    Each step dispatches ``train.prompts_per_step`` prompts :math:`\times G` rollouts
    (``G`` = the recipe's group size), waits for every one of them (the group barrier),
    and performs one update with :meth:`Trainer.learn`. Logged per step: the group wait
    ``group/wait_W`` :math:`=\sum_{groups}\sum_i(T_{ready}-T_i)` with :math:`T_i` the time
    rollout :math:`i` reached the learner (:func:`group_wait`), its mean per rollout, the
    throughput, and the learner's idle time. A group that lost a member to a dead worker
    is dropped whole (``faults/incomplete_groups``).
    """

    def _check_recipe(self, cfg: Config) -> None:
        obj = cfg.objective()
        if obj.group_size < 2:
            raise ValueError(f"recipe: {obj.name!r} has group_size {obj.group_size}; the grouped baseline needs >= 2")

    def run(self, *, max_seconds: Optional[float] = None, stall_timeout: float = 900.0) -> Dict[str, Any]:
        from tqdm.auto import tqdm

        tr, cfg = self.trainer, self.cfg
        G = tr.objective.group_size
        P = cfg.train.prompts_per_step
        self._start()
        totals = {"W": 0.0, "rollouts": 0, "incomplete_groups": 0}
        try:
            self._preamble()
            self.pool.wait_ready(timeout=stall_timeout)
            self.publish()
            bar = tqdm(total=cfg.train.steps, initial=tr.step, desc=f"{tr.objective.name} grouped",
                       disable=not cfg.log.progress, dynamic_ncols=True)
            t_run = time.perf_counter()
            self._t_start = t_run
            while tr.step < cfg.train.steps:
                if max_seconds is not None and time.perf_counter() - t_run >= max_seconds:
                    break
                t0 = time.perf_counter()
                groups: Dict[str, Dict[str, Any]] = {}
                for _ in range(P):
                    idx = tr.cursor
                    task = tr._next_tasks(1)[0]
                    gkey = f"{self.nonce}-{idx}"
                    groups[gkey] = {"times": [], "trajs": [], "lost": False}
                    for g in range(G):
                        self.pool.submit(f"{gkey}#{g}", task, _step_seed(cfg.train.seed, idx, salt=100 + g), group=gkey)
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
                ntok = sum(t.num_action_tokens for t in trajs)
                self.counters["episodes_finished"] += n_roll
                self.counters["trajectories_finished"] += len(trajs)
                self.counters["tokens_finished"] += ntok
                totals["W"] += W
                totals["rollouts"] += n_roll
                if not trajs:
                    continue
                v = tr.policy_version
                lags = [v - min(turn.policy_version for turn in t.turns) for t in trajs]
                m = tr.learn(trajs)
                tr.step += 1
                if tr.policy_version != self._published:
                    self.publish()
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
                tr.metrics.log(tr.step, m, kind="train")
                bar.update(1)
                bar.set_postfix({k: f"{m[k]:.3g}" for k in ("reward/mean", "group/wait_W", "loss") if k in m})
                if cfg.eval.every and tr.step % cfg.eval.every == 0 and tr.step < cfg.train.steps:
                    tr.evaluate("during")
                if cfg.checkpoint.every and (tr.step % cfg.checkpoint.every == 0 or tr.step == cfg.train.steps):
                    self.save()
            bar.close()
            self._t_loop = time.perf_counter() - self._t_start
            self._final_save()
        finally:
            self._stop()
        summary: Dict[str, Any] = {
            "steps": tr.step, "recipe": tr.objective.name, "mode": "grouped", "group_size": G,
            "episodes_finished": self.counters["episodes_finished"], "group_wait_W_total": totals["W"],
            "group_wait_W_per_rollout": totals["W"] / max(totals["rollouts"], 1),
            "incomplete_groups": totals["incomplete_groups"], "lost_episodes": self.counters["lost_episodes"],
            "seconds": self._t_loop,
            "trajectories_per_s": self.counters["trajectories_finished"] / max(self._t_loop, 1e-9),
        }
        return self._finish(summary)


# ====================================================================== presets
# The asynchronous presets ("sao-tiny", "sao", "sao-coding") live in trajgrad.train.config.PRESETS.
SAO_PRESETS: Dict[str, Dict[str, Any]] = {k: PRESETS[k] for k in ("sao-tiny", "sao", "sao-coding")}
