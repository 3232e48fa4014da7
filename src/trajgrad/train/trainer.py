r"""The group-synchronous trainer: one loop for every recipe of ``trajgrad.objective.RECIPES``.

One optimizer step (:meth:`Trainer.train_step`, then :meth:`Trainer.learn`):

1. reseed from ``(seed, step)`` (a resumed run samples exactly what the killed run would
   have), take the next prompts from the data cursor;
2. sample ``group_size`` multi-turn episodes per prompt with the in-process sampler, which
   records each action token's log-prob under the exact sampling distribution (§7) and the
   policy version (§16); dynamic sampling (DAPO) resamples zero-variance groups and logs
   every discarded group with its token cost (§11);
3. append the trajectories to ``trajectories.jsonl`` (fsync'd);
4. rewards (:mod:`trajgrad.train.rewards`): per-turn rewards, optional potential shaping
   (§21), optional Lagrangian cost penalty (§22), optional per-token KL in the reward
   (:meth:`Objective.kl_in_reward`, §9);
5. advantages: group estimators through :meth:`Objective.sequence_advantages`; critic
   recipes place each turn's reward on its last action token (:mod:`trajgrad.advantages.credit`),
   update the critic and take skip-observation GAE advantages
   (:func:`~trajgrad.train.updates.critic_update`, §20.4);
6. the policy update (:func:`~trajgrad.train.updates.policy_update`): the recipe's loss on
   micro-batches with one global denominator (§13), so the gradient of the step equals the
   gradient of the whole batch's loss.

With several environments (``tasks:``), steps 1, 2 and 5 run per environment: each one's
share of the prompts, its own group size, its advantages on its own groups
(:mod:`trajgrad.train.mixture`); step 6 is one update over the whole batch.

Setup is in :mod:`trajgrad.train.setup`, the update steps in :mod:`trajgrad.train.updates`,
the run's frame (preamble, cadence) in :mod:`trajgrad.train.loop`. No estimator is
implemented here: every formula lives in the core and is called.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import distributed as dist_lib
from ..envs.mcp import mcp_metrics
from ..objective import Objective
from ..rollout import RolloutBatch, Trajectory, TrajectoryLog, collate
from . import fsdp, loop, offline, tokenlog, updates
from .collect import collect_groups, next_in_order, task_in_order
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import Config
from .demos import build_dpo_pairs, demo_batch, pairs_for_step
from .evaluation import EvalResult, evaluate, format_eval
from .metrics import MetricsLogger
from .mixture import Mixture
from ..weights import ReferenceWeights
from .rewards import batch_facts, invalid_action_facts, token_rewards, turn_rewards
from .rundir import record_determinism
from ..runtime.allocator import keep_freed_memory
from .seeding import determinism_settings, format_determinism, seed_everything, step_seed
from .setup import build_lagrange, build_learner, build_sampler, build_tasks, build_teacher
from .learning_signal import NoSignalWatch, signal_facts

__all__ = ["Trainer", "EvalResult", "seed_everything"]


class Trainer:
    """Builds the model, sampler, data and objective from a :class:`Config` and trains."""

    def __init__(self, cfg: Config, run_dir: Path, *, resume: bool = False, console=print):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._owns_process_group = not dist_lib.is_distributed()  # created below under torchrun
        self.dist = dist_lib.init_from_env()
        self.rank, self.world = self.dist.rank, self.dist.world_size
        self.is_main = self.dist.is_main
        self.console = console if self.is_main else (lambda *_a, **_k: None)
        self.objective: Objective = cfg.objective()
        self.resume = resume
        seed_everything(cfg.train.seed)
        self.determinism = determinism_settings()
        self.console(format_determinism(self.determinism))
        self.console(keep_freed_memory(cfg.train.keep_freed_mb))
        if self.is_main:
            record_determinism(self.run_dir, self.determinism)

        self.mixture = Mixture.build(cfg, self.objective)  # several environments (tasks:), or None
        self.source, self.train_tasks, self.heldout_tasks = build_tasks(cfg, self.console) if self.mixture is None \
            else self.mixture.tasks()
        self.learner, self.tokenizer = build_learner(cfg, self.objective)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        # pi_ref is the policy when RL starts (after the SFT warm start): snapshotted by
        # snapshot_reference at that moment; a resumed run loads it from the checkpoint
        # (a reference.path model is already there: build_learner loaded it)
        if resume and self.objective.uses_reference and self.learner.reference is None:
            self.learner.reference = ReferenceWeights(self.model)
        if self.objective.kind == "distill":
            self.learner.teacher = build_teacher(cfg, self.tokenizer, self.sft, self.console)
        self.lagrange = build_lagrange(cfg)
        # consecutive steps without a learning signal: warned, logged, or the run ends (train.learning_signal)
        self.signal_watch = NoSignalWatch(self.objective, cfg.train.no_signal_steps, cfg.train.stop_on_no_signal)
        self.stop_reason: Optional[str] = None
        self.sampler = build_sampler(cfg, self.model, self.tokenizer, run_dir=self.run_dir if self.is_main else None,
                                     work_dir=self.run_dir / "vllm", console=self.console)
        name = "trajectories.jsonl" if self.world == 1 else f"trajectories.rank{self.rank}.jsonl"
        self.traj_log = TrajectoryLog(self.run_dir / name)
        self.step = 0
        self.cursor = 0
        self.policy_version = 0
        self.resumed_from: Optional[Path] = None  # the checkpoint directory a resumed run loaded
        self.dpo_pairs: Optional[List[Tuple[Trajectory, Trajectory]]] = None
        self.eval_before: Optional[EvalResult] = None
        # the SFT warm start in progress: its optimizer and {"step", "steps", "rng"} while it runs
        # (saved with every SFT checkpoint); a run resumed inside it continues from sft_resume
        self._sft_opt: Optional[torch.optim.Optimizer] = None
        self._sft_state: Optional[Dict[str, Any]] = None
        self.sft_resume: Optional[Dict[str, Any]] = None
        if resume and fsdp.is_fsdp_model(self.model):
            raise ValueError("resume: a run under dist.fsdp cannot be resumed yet (its checkpoints hold full "
                             "tensors that load in one process, not into a sharded model)")
        metrics_offset = self._restore() if resume else None
        self.metrics = MetricsLogger.for_config(self.run_dir, cfg, resume_offset=metrics_offset) \
            if self.is_main else _NullLogger()
        if self.is_main:
            (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2, default=str))

    # the learner state's networks, by their usual names
    model = property(lambda self: self.learner.model)
    optimizer = property(lambda self: self.learner.optimizer)
    value_head = property(lambda self: self.learner.value_head)
    critic_optimizer = property(lambda self: self.learner.critic_optimizer)
    reference = property(lambda self: self.learner.reference)
    teacher = property(lambda self: self.learner.teacher)

    # ------------------------------------------------------------------ checkpoints
    def _modules(self) -> Dict[str, torch.nn.Module]:
        mods = {"policy": self.model}
        if self.value_head is not None:
            mods["value_head"] = self.value_head
        if self.reference is not None:
            mods["reference"] = self.reference
        return mods

    def _optimizers(self) -> Dict[str, torch.optim.Optimizer]:
        opts = {"policy": self.optimizer}
        if self.critic_optimizer is not None:
            opts["critic"] = self.critic_optimizer
        if self._sft_opt is not None:
            opts["sft"] = self._sft_opt
        return opts

    def save(self, files: Optional[Dict[str, bytes]] = None) -> Optional[Path]:
        """Checkpoint (rank 0 writes; every rank's trajectory-log offset is recorded).
        ``files``: more files that belong to this checkpoint (name -> bytes), written
        atomically with it (the asynchronous learners' buffer, :mod:`trajgrad.train.async_state`)."""
        offsets = dist_lib.gather_objects(self.traj_log.offset)
        extra = {
            "step": self.step, "cursor": self.cursor, "policy_version": self.policy_version,
            "trajectory_offset": offsets[0], "trajectory_offsets": offsets, "world_size": self.world,
            "metrics_offset": self.metrics.offset,
            "lagrange": self.lagrange.state_dict() if self.lagrange else None,
            "no_signal_run": self.signal_watch.run,
            "eval_before": self.eval_before.to_dict() if self.eval_before else None,
            "sft": self._sft_state,
            "mixture": self.mixture.state_dict() if self.mixture is not None else None,
        }
        path = None
        # under FSDP the full tensors are gathered on every rank (collectives), then rank 0 writes
        modules = {k: fsdp.full_state_module(m) for k, m in self._modules().items()}
        optimizers = {k: fsdp.full_optimizer_state(o) for k, o in self._optimizers().items()}
        if self.is_main:
            path = save_checkpoint(self.run_dir, self.step, modules=modules, optimizers=optimizers,
                                   extra=extra, keep=self.cfg.checkpoint.keep, files=files)
        dist_lib.barrier()
        return path

    def _restore(self) -> Optional[int]:
        if latest_checkpoint(self.run_dir) is None:
            raise ValueError(f"run_dir: {self.run_dir} has no checkpoint to resume from")
        sft = json.loads((latest_checkpoint(self.run_dir) / "extra.json").read_text()).get("sft")
        if sft is not None:  # killed during the SFT warm start: pi_ref is not taken yet
            if isinstance(self.learner.reference, ReferenceWeights):  # (a reference.path model stays)
                self.learner.reference = None
            self._sft_opt = self._sft_optimizer(self.model, self.cfg.sft.lr)
        state = load_checkpoint(self.run_dir, modules=self._modules(), optimizers=self._optimizers())
        ex = state.extra
        self.step = int(ex["step"])
        self.cursor = int(ex["cursor"])
        self.policy_version = int(ex["policy_version"])
        self.signal_watch.run = int(ex.get("no_signal_run", 0))  # the streak of steps without a signal goes on
        self.sampler.set_policy_version(self.policy_version)
        saved_world = int(ex.get("world_size", 1))
        if saved_world != self.world:
            raise ValueError(f"resume: the run used {saved_world} process(es); resume it with the same number, not {self.world}")
        offsets = ex.get("trajectory_offsets") or [ex["trajectory_offset"]]
        self.traj_log.truncate_to(int(offsets[self.rank]))
        if self.lagrange and ex.get("lagrange"):
            self.lagrange.load_state_dict(ex["lagrange"])
        if ex.get("eval_before"):
            self.eval_before = EvalResult(**ex["eval_before"])
        self.sft_resume = ex.get("sft")
        self.resumed_from = state.path
        if self.mixture is not None:
            self.mixture.load_state_dict(ex.get("mixture"))
        where = f"SFT step {self.sft_resume['step']}" if self.sft_resume else f"step {self.step}"
        self.console(f"resumed from {state.path} at {where}")
        return int(ex["metrics_offset"])

    # ------------------------------------------------------------------ data, evaluation, reference
    def next_tasks(self, n: int) -> list:
        """The next ``n`` training tasks: one fixed permutation per epoch, advancing the cursor."""
        out, self.cursor = next_in_order(self.train_tasks, self.cursor, n, self.cfg.task.seed)
        return out

    def task_at(self, index: int):
        """The training task at data position ``index`` (what :meth:`next_tasks` returns there)."""
        return task_in_order(self.train_tasks, index, self.cfg.task.seed)

    def evaluate(self, tag: str) -> EvalResult:
        """Held-out success (rank 0 evaluates; the other ranks wait and receive the result)."""
        with fsdp.gathered(self.model):  # rank 0 samples alone: no sharded forward may all-gather
            return evaluate(self, tag)

    def snapshot_reference(self) -> None:
        """Freeze pi_ref as the current policy (called when RL starts; a no-op once taken)."""
        updates.snapshot_reference(self.learner)

    # ------------------------------------------------------------------ rollouts
    def _collect(self) -> Tuple[List[Trajectory], Dict[str, float]]:
        """``prompts_per_step`` groups of ``G`` episodes (:func:`~trajgrad.train.collect.collect_groups`);
        with several environments, each environment's share of them (:mod:`trajgrad.train.mixture`)."""
        if self.mixture is not None:
            return self.mixture.collect(self)
        obj = self.objective
        return collect_groups(self, self.source, self.next_tasks, obj.group_size, self.cfg.train.prompts_per_step,
                              obj.dynamic_sampling)

    def _publish(self) -> None:
        """A new policy version: an external server receives the weights (documented sync step)."""
        if self.cfg.rollout.backend in ("openai", "vllm"):
            if self.is_main:
                self.sampler.sync_weights(self.model, self.policy_version, self.run_dir / "weights-sync")
            dist_lib.barrier()
        self.sampler.set_policy_version(self.policy_version)

    def _new_version(self) -> None:
        self.policy_version += 1
        self._publish()

    # ------------------------------------------------------------------ one step
    def train_step(self) -> Dict[str, float]:
        """Sample (or, for DPO, take the next pairs) and perform one update; the metrics."""
        seed_everything(step_seed(self.cfg.train.seed, self.step))
        if self.objective.kind == "pairwise":
            return dist_lib.mean_metrics_over_ranks(self._dpo_step())
        t_step = time.perf_counter()
        trajs, metrics = self._collect()
        self.traj_log.extend(trajs)
        if dist_lib.min_over_ranks(len(trajs)) == 0:  # every rank must take part in the update, or none
            metrics["skipped"] = 1.0
            metrics.update(signal_facts(self.objective, trajs))  # nothing to train on: no signal
            return dist_lib.mean_metrics_over_ranks(metrics)
        metrics.update(self.learn(trajs))
        dt = time.perf_counter() - t_step
        metrics["time/step"] = dt
        metrics["throughput/gen_tokens_per_s"] = metrics.pop("gen_tokens") / max(metrics["time/generate"], 1e-9)
        metrics["throughput/samples_per_s"] = len(trajs) / dt * self.world
        return dist_lib.mean_metrics_over_ranks(metrics)

    def learn(self, trajs: Sequence[Trajectory]) -> Dict[str, float]:
        """One update from finished trajectories (used by the synchronous and asynchronous loops).

        Each numbered step is one call, its body in this module or in :mod:`trajgrad.train.updates`.
        """
        if self.objective.kind == "distill":  # on-policy distillation: the student's samples, the teacher's distribution
            return self._learn_distill(trajs)
        # 1. the batch, its rewards per turn (shaping §21, cost penalty §22) and its facts
        batch, turn_r, metrics = self._batch(trajs)
        # 2. log-probs under the current (= old) weights, the sampler's, the reference's (§7, §9)
        logps = updates.old_logprobs(self.learner, batch, self.cfg.train.old_logp, metrics)
        # 3. advantages: the group estimator, or GAE from the critic after its update (§20.4)
        advantages = self._advantages(batch, trajs, turn_r, logps, metrics)
        # 4. the step's micro-batches (rows without gradient last) and global denominator (§13); a term that
        #    takes cost advantages (§22's Lagrangian) gets the estimator on the costs and the multiplier's λ
        step = self._prepare_policy_step(batch, advantages, logps, self._cost_advantages(batch))
        # 5. the policy update: each micro-batch's loss and backward pass, one optimizer step (§13)
        self._update_policy(step, metrics)
        # 6. the cost constraint's multiplier, from this batch's mean cost (§22)
        self._update_multiplier(metrics)
        return metrics

    def _batch(self, trajs: Sequence[Trajectory]) -> Tuple[RolloutBatch, torch.Tensor, Dict[str, float]]:
        """The padded batch, its ``[B, T]`` rewards per turn and the metrics that describe it."""
        batch = collate(list(trajs), self.pad_id)
        metrics = {**batch_facts(batch), **invalid_action_facts(trajs), **signal_facts(self.objective, trajs)}
        metrics.update(mcp_metrics(trajs))  # tools/mcp_calls, tools/mcp_error_frac/<reason> (MCP tools only)
        if self.mixture is not None:
            metrics.update(self.mixture.metrics(trajs))
        turn_r, info = turn_rewards(batch, gamma=self.objective.gamma, shaping=self.cfg.task.shaping,
                                    lagrange=self.lagrange, penalize="cost_advantages" not in self.objective.term.inputs)
        metrics.update(info)
        return batch, turn_r, metrics

    def _advantages(self, batch: RolloutBatch, trajs: Sequence[Trajectory], turn_r: torch.Tensor,
                    logps: updates.StepLogprobs, metrics: Dict[str, float]) -> torch.Tensor:
        """Critic recipes place each turn's reward on its last action token (:mod:`trajgrad.advantages.credit`),
        update the critic and take its skip-observation GAE advantages
        (:func:`~trajgrad.train.updates.critic_update`); group recipes take
        :meth:`Objective.sequence_advantages` of the sequence rewards (per environment with
        ``tasks:``). With ``kl_placement: reward`` the per-token KL leaves the reward first (§9)."""
        obj, mask = self.objective, batch.action_mask
        kl_reward = logps.reference is not None and obj.kl_placement == "reward"
        if obj.critic:
            tok_r = token_rewards(batch, turn_r)
            if kl_reward:
                tok_r = tok_r - obj.kl_in_reward(logps.recomputed, logps.reference, mask).double()
            advantages, crit = updates.critic_update(self.learner, batch, logps.hidden, tok_r)
            metrics.update(crit)
            return advantages
        seq_r = turn_r.sum(1)
        if kl_reward:
            seq_r = seq_r - obj.kl_in_reward(logps.recomputed, logps.reference, mask).sum(1)
        ga = obj.sequence_advantages(seq_r, group_ids=batch.group_ids) if self.mixture is None \
            else self.mixture.sequence_advantages(seq_r, batch.group_ids, trajs, metrics)
        zv = ga.zero_variance
        metrics["groups/zero_variance_frac"] = float(zv.float().mean()) if zv.numel() else 0.0
        return ga.advantages.double()

    def _cost_advantages(self, batch: RolloutBatch) -> Optional[torch.Tensor]:
        """The recipe's advantage estimator on the per-response costs (``info["cost"]`` summed over
        the turns, §22), for a policy term that reads cost advantages; None otherwise."""
        if "cost_advantages" not in self.objective.term.inputs:
            return None
        costs = torch.where(batch.turn_mask, batch.turn_costs.double(), 0.0).sum(1)
        return self.objective.sequence_advantages(costs, group_ids=batch.group_ids).advantages.double()

    def _prepare_policy_step(self, batch: RolloutBatch, advantages: torch.Tensor, logps: updates.StepLogprobs,
                             cost_advantages: Optional[torch.Tensor] = None) -> Optional[updates.PolicyStep]:
        """The policy step laid out (:func:`~trajgrad.train.updates.prepare_policy_step`), its
        per-token record opened (``tokens.jsonl`` for ``trajgrad view``); None while the critic
        warms up (``critic.warmup_steps``: no policy update)."""
        if self.objective.critic and self.step < self.cfg.critic.warmup_steps:
            return None
        return updates.prepare_policy_step(self.learner, batch, advantages, logps.old, logps.reference,
                                           behaviour=logps.behaviour, behaviour_logp=logps.behaviour_logp,
                                           record=tokenlog.start(self, batch), cost_advantages=cost_advantages,
                                           lagrange=self.lagrange if cost_advantages is not None else None)

    def _update_policy(self, step: Optional[updates.PolicyStep], metrics: Dict[str, float]) -> None:
        """The policy update (:func:`~trajgrad.train.updates.policy_step`), its token-log lines
        written, the new policy version published; ``time/update`` and ``policy_version``."""
        t0 = time.perf_counter() if step is None else step.started
        if step is not None:
            metrics.update(updates.policy_step(self.learner, step))
            tokenlog.finish(self, step.record)
            self._new_version()
        metrics["time/update"] = time.perf_counter() - t0
        metrics["policy_version"] = float(self.policy_version)

    def _update_multiplier(self, metrics: Dict[str, float]) -> None:
        """The Lagrange multiplier of the cost constraint (``constraint:``), if any (§22)."""
        if self.lagrange is not None:
            self.lagrange.update(metrics["constraint/mean_cost"])

    def _learn_distill(self, trajs: Sequence[Trajectory]) -> Dict[str, float]:
        """One step of on-policy distillation (:func:`~trajgrad.train.updates.distill_update`, §14)."""
        batch, _, metrics = self._batch(trajs)
        t0 = time.perf_counter()
        metrics.update(updates.distill_update(self.learner, batch))
        metrics["time/update"] = time.perf_counter() - t0
        self._new_version()
        metrics["policy_version"] = float(self.policy_version)
        return metrics

    # ------------------------------------------------------------------ SFT and DPO
    @staticmethod
    def _sft_optimizer(model, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def sft(self, steps: int, batch_size: int, lr: float, progress=None, *, model=None, seed_salt: int = 17,
            save=None, every: int = 0, resume: Optional[Dict[str, Any]] = None) -> List[float]:
        """Masked negative log-likelihood on demonstrations (action tokens only).

        With ``save`` and ``every``: after every ``every``-th step (not the last) the SFT
        optimizer, the step and the task sampler's state go into a checkpoint through
        ``save`` (``progress`` has logged the step's metrics first, so the checkpoint's
        metrics offset includes it). ``resume``: the ``sft`` record of such a checkpoint,
        whose optimizer :meth:`_restore` has loaded; the warm start continues from its
        step and draws the tasks the killed run would have drawn. Returns this call's losses.
        """
        if steps <= 0:
            return []
        model = self.model if model is None else model
        rng = random.Random(self.cfg.train.seed + seed_salt)
        start = 0
        if resume is not None:
            opt = self._sft_opt
            version, state, gauss = resume["rng"]
            rng.setstate((version, tuple(state), gauss))
            start = int(resume["step"])
        else:
            opt = self._sft_optimizer(model, lr)
        losses = []
        for s in range(start, steps):
            tasks = [self.train_tasks[rng.randrange(len(self.train_tasks))] for _ in range(batch_size)]
            mine = dist_lib.shard(tasks, self.rank, self.world)
            batch = demo_batch(self.tokenizer, self.source, mine, self.pad_id,
                               proxy=self.cfg.rollout.backend == "proxy") if mine else None
            total = offline.sft_update(self.learner, model, opt, batch)
            losses.append(total)
            if progress is not None:
                progress(s, total)
            if save is not None and every > 0 and (s + 1) % every == 0 and s + 1 < steps:
                self._sft_opt, self._sft_state = opt, {"step": s + 1, "steps": steps, "rng": rng.getstate()}
                save()
        self._sft_opt = self._sft_state = None
        return losses

    def _dpo_step(self) -> Dict[str, float]:
        """One DPO step on the next pairs, sharded over ranks with the global pair count as the
        denominator; a rank without pairs contributes a zero gradient (§13)."""
        if self.dpo_pairs is None:
            cfg = self.cfg
            tasks = self.train_tasks[: cfg.dpo.pairs]
            seed_everything(step_seed(cfg.train.seed, 0, salt=7))
            with fsdp.gathered(self.model):
                samples = self.sampler.rollout(self.source, tasks, group_size=2, seed=step_seed(cfg.train.seed, 0, 7))
            self.dpo_pairs = build_dpo_pairs(self.tokenizer, self.source, tasks, samples,
                                             proxy=cfg.rollout.backend == "proxy")
        pairs = pairs_for_step(self.dpo_pairs, self.cursor, self.cfg.train.prompts_per_step)
        mine = dist_lib.shard(pairs, self.rank, self.world)
        self.cursor += 1
        chosen = collate([p[0] for p in mine], self.pad_id) if mine else None
        rejected = collate([p[1] for p in mine], self.pad_id) if mine else None
        out = offline.dpo_update(self.learner, chosen, rejected, len(pairs))
        self.policy_version += 1
        return out

    # ------------------------------------------------------------------ the run
    def run(self) -> Dict[str, Any]:
        """Preamble (evaluation, SFT warm start, pi_ref), ``train.steps`` steps, :meth:`finish`."""
        loop.preamble(self, self.save)
        bar = loop.progress_bar(self, self.cfg.train.steps, f"{self.objective.name}", initial=self.step)
        while self.step < self.cfg.train.steps and self.stop_reason is None:
            loop.end_of_step(self, self.train_step(), self.save, bar)
        bar.close()
        summary = {"steps": self.step, "recipe": self.objective.name}
        return self.finish({**summary, "stopped": self.stop_reason} if self.stop_reason else summary)

    def finish(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        """Held-out evaluation after training, before/after comparison, ``summary.json``.

        Under torchrun the process group this trainer created is destroyed here, once every
        rank has arrived: its backends shut down in order now rather than in the
        interpreter's teardown at exit. A group the caller created before the trainer is
        left to the caller. A group that other modules still hold keeps its threads; a
        script that trains under torchrun ends its processes with
        :func:`trajgrad.train.run.end_distributed_worker`, as ``trajgrad train`` does.
        """
        if self.cfg.eval.after:
            after = self.evaluate("after")
            summary["eval_after"] = after.to_dict()
            self.console(format_eval("after", after))
            loop.eval_summary(self, summary, after)
        if self.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        getattr(self.sampler, "close", lambda: None)()  # a proxy's loopback server
        self.traj_log.close()
        self.metrics.close()  # the tracking sinks (wandb, mlflow, trackio) finish their runs
        dist_lib.barrier()
        if self._owns_process_group:
            dist_lib.cleanup()
        return summary


class _NullLogger:
    """Metrics sink of ranks other than 0."""

    offset = 0

    def log(self, *args, **kwargs):
        return {}

    def close(self):
        pass
