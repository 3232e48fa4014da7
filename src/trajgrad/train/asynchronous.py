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
* **Checkpoints** reuse :meth:`Trainer.save` and ``resume``. Each checkpoint directory
  also holds ``async_state.json`` (:mod:`trajgrad.train.async_state`), written atomically
  with the weights: the finished but untrained episodes (the buffer; episodes already
  finished on the workers are admitted first), the episodes in flight (data position, key,
  seed, task id), the ledger of trained episodes and the counters. On resume the buffer is
  trained (episodes whose lag against the restored version exceeds ``max_lag`` are dropped,
  ``lag/dropped_on_resume``), the in-flight episodes run again from their tasks
  (``faults/rerun_on_resume``), and an episode the ledger holds is never trained again.
  ``faults/lost_on_resume`` counts the in-flight episodes that cannot run again (their data
  position holds another task after a config change).

:class:`GroupedRayTrainer` is the synchronous grouped baseline on the same actors: each
step dispatches ``prompts_per_step x G`` rollouts, waits for all of them (the group
barrier), logs :math:`W` (:func:`group_wait`) and performs one update.

Modules: :mod:`trajgrad.train.lag` (admission and lag, no Ray),
:mod:`trajgrad.train.weight_store` (what a weight sync sends, the store actor),
:mod:`trajgrad.train.workers` (rollout actors and their pool), :mod:`trajgrad.train.ray_learner`
(the learners' shared frame), :mod:`trajgrad.train.async_trainer` (:class:`AsyncTrainer`),
:mod:`trajgrad.train.grouped` (:class:`GroupedRayTrainer`), :mod:`trajgrad.train.async_state`
(what a checkpoint keeps besides the weights); this module gathers their names.

Ray: a local cluster by default (``ray.init(num_cpus=..., include_dashboard=False)``);
``asynchronous.ray_address`` (``trajgrad train --ray-address``) joins an existing one,
whose nodes must have ``trajgrad`` installed. A session that already called
``ray.init`` is reused and left running.
"""
from __future__ import annotations

from typing import Any, Dict

from .config import PRESETS
from .grouped import GroupedRayTrainer
from .lag import Admitted, LagGate, group_wait, lag_histogram
from .async_state import ASYNC_STATE_FILE
from .ray_learner import RayLearner
from .async_trainer import AsyncTrainer
from .weight_store import WeightStore, load_trainable_state, trainable_state
from .workers import Job, RolloutPool, RolloutWorker

__all__ = [
    "AsyncTrainer",
    "GroupedRayTrainer",
    "LagGate",
    "Admitted",
    "RolloutWorker",
    "RolloutPool",
    "WeightStore",
    "Job",
    "RayLearner",
    "ASYNC_STATE_FILE",
    "group_wait",
    "trainable_state",
    "load_trainable_state",
    "lag_histogram",
    "SAO_PRESETS",
]

# The asynchronous presets ("sao-tiny", "sao", "sao-coding") live in trajgrad.train.config.PRESETS.
SAO_PRESETS: Dict[str, Dict[str, Any]] = {k: PRESETS[k] for k in ("sao-tiny", "sao", "sao-coding")}
