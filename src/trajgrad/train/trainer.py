r"""The group-synchronous trainer: one loop for every recipe of ``trajgrad.objective.RECIPES``.

One optimizer step:

1. reseed from ``(seed, step)`` (a resumed run samples exactly what the killed run would
   have), take the next prompts from the data cursor;
2. sample ``group_size`` multi-turn episodes per prompt with the in-process sampler, which
   records each action token's log-prob under the exact sampling distribution (§7) and the
   policy version (§16); dynamic sampling (DAPO) resamples zero-variance groups and logs
   every discarded group with its token cost (§11);
3. append the trajectories to ``trajectories.jsonl`` (fsync'd);
4. rewards: per-turn rewards, optional potential shaping through
   :func:`trajgrad.returns.shape_rewards` (§21), optional Lagrangian cost penalty
   (:class:`trajgrad.losses.LagrangeMultiplier`, §22), optional per-token KL in the reward
   (:meth:`Objective.kl_in_reward`, §9);
5. advantages: group estimators through :meth:`Objective.sequence_advantages`, critic
   recipes through :meth:`Objective.token_advantages` (skip-observation GAE, §20.4);
6. the policy loss through :meth:`Objective.policy_loss` on micro-batches with one global
   denominator from :class:`trajgrad.aggregate.Normalizer` (§13): the gradient of the step
   equals the gradient of the whole batch's loss.

No estimator is implemented here: every formula lives in the core and is called.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import distributed as dist_lib
from .. import returns as returns_lib
from ..aggregate import Normalizer, aggregate, masked_mean
from ..diagnostics import explained_variance
from ..losses import LagrangeMultiplier, kl_estimate, value_loss
from ..objective import Objective
from ..rollout import HFSampler, RolloutBatch, Trajectory, TrajectoryLog, collate
from .demos import demonstration_trajectory
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import Config
from .metrics import MetricsLogger
from .models import ReferenceWeights, build_policy_model
from .policy import ValueHead, causal_parts, head_inputs, learner_logprobs
from .stats import two_proportion_test, wilson_interval


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _step_seed(base: int, step: int, salt: int = 0) -> int:
    return (base * 1_000_003 + step * 7919 + salt * 104729) % (2**31 - 1)


@dataclass
class EvalResult:
    success: float
    low: float
    high: float
    n: int
    successes: int
    reward: float


class Trainer:
    """Builds the model, sampler, data and objective from a :class:`Config` and trains."""

    def __init__(self, cfg: Config, run_dir: Path, *, resume: bool = False, console=print):
        from ..envs import get_task_source

        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.dist = dist_lib.init_from_env()
        self.rank, self.world = self.dist.rank, self.dist.world_size
        self.is_main = self.dist.is_main
        self.console = console if self.is_main else (lambda *_a, **_k: None)
        self.objective: Objective = cfg.objective()
        self.resume = resume
        seed_everything(cfg.train.seed)

        self.source = get_task_source(cfg.task.name, **cfg.task.options)
        self.train_tasks = self.source.tasks("train", cfg.task.n_train, cfg.task.seed)
        self.heldout_tasks = self.source.tasks("heldout", cfg.eval.n or cfg.task.n_heldout, cfg.task.seed)

        self.model, self.tokenizer = build_policy_model(cfg.model)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                           weight_decay=cfg.optim.weight_decay)
        self.value_head: Optional[ValueHead] = None
        self.critic_optimizer = None
        if self.objective.critic:
            hidden = causal_parts(self.model)[1].weight.shape[1]
            self.value_head = ValueHead(hidden)
            self.critic_optimizer = torch.optim.AdamW(self.value_head.parameters(), lr=cfg.critic.lr)
        # pi_ref is the policy when RL starts (after the SFT warm start): snapshotted by
        # _snapshot_reference at that moment; a resumed run loads it from the checkpoint
        self.reference: Optional[ReferenceWeights] = None
        if resume and self.objective.uses_reference:
            self.reference = ReferenceWeights(self.model)
        self.teacher = self._build_teacher() if self.objective.loss == "opd" else None
        self.lagrange = LagrangeMultiplier(init=cfg.constraint.init, lr=cfg.constraint.lr, budget=cfg.constraint.budget) \
            if cfg.constraint.enabled else None
        if cfg.rollout.backend == "openai":
            from ..rollout.openai_backend import OpenAISampler

            if not cfg.rollout.base_url:
                raise ValueError("rollout.base_url: required for backend 'openai'")
            self.sampler = OpenAISampler(
                cfg.rollout.base_url, self.tokenizer, model_name=cfg.rollout.model_name or cfg.model.name,
                temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k, top_p=cfg.sampling.top_p,
                max_new_tokens=cfg.sampling.max_new_tokens, policy_version=0, server=cfg.rollout.server,
            )
        else:
            self.sampler = HFSampler(
                self.model, self.tokenizer, temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k,
                top_p=cfg.sampling.top_p, max_new_tokens=cfg.sampling.max_new_tokens, policy_version=0,
            )
        name = "trajectories.jsonl" if self.world == 1 else f"trajectories.rank{self.rank}.jsonl"
        self.traj_log = TrajectoryLog(self.run_dir / name)
        self.step = 0
        self.cursor = 0
        self.policy_version = 0
        self.dpo_pairs: Optional[List[Tuple[Trajectory, Trajectory]]] = None
        self.eval_before: Optional[EvalResult] = None
        metrics_offset = None
        if resume:
            metrics_offset = self._restore()
        self.metrics = MetricsLogger(self.run_dir, tensorboard=cfg.log.tensorboard, resume_offset=metrics_offset) \
            if self.is_main else _NullLogger()
        if self.is_main:
            (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2, default=str))

    # ------------------------------------------------------------------ state
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
        return opts

    def save(self) -> Optional[Path]:
        """Checkpoint (rank 0 writes; every rank's trajectory-log offset is recorded)."""
        offsets = self._gather(self.traj_log.offset)
        extra = {
            "step": self.step, "cursor": self.cursor, "policy_version": self.policy_version,
            "trajectory_offset": offsets[0], "trajectory_offsets": offsets, "world_size": self.world,
            "metrics_offset": self.metrics.offset,
            "lagrange": self.lagrange.state_dict() if self.lagrange else None,
            "eval_before": self.eval_before.__dict__ if self.eval_before else None,
        }
        path = None
        if self.is_main:
            path = save_checkpoint(self.run_dir, self.step, modules=self._modules(), optimizers=self._optimizers(),
                                   extra=extra, keep=self.cfg.checkpoint.keep)
        dist_lib.barrier()
        return path

    def _gather(self, value):
        if self.world == 1:
            return [value]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, value)
        return out

    def _sync_grads(self, params) -> None:
        """Sum gradients over ranks (denominators are global counts, so the sum is exact, §13)."""
        if self.world > 1:
            dist_lib.sync_gradients_sum(params)

    def _normalizer(self, masks, mode, constant=None) -> Normalizer:
        # gradients are summed over ranks by _sync_grads, so no division by the world size
        norm = Normalizer(mode, constant=constant, grad_average_over_ranks=False)
        for m in masks:
            norm.add(m)
        return norm

    def _restore(self) -> Optional[int]:
        if latest_checkpoint(self.run_dir) is None:
            raise ValueError(f"run_dir: {self.run_dir} has no checkpoint to resume from")
        state = load_checkpoint(self.run_dir, modules=self._modules(), optimizers=self._optimizers())
        ex = state.extra
        self.step = int(ex["step"])
        self.cursor = int(ex["cursor"])
        self.policy_version = int(ex["policy_version"])
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
        self.console(f"resumed from {state.path} at step {self.step}")
        return int(ex["metrics_offset"])

    # ------------------------------------------------------------------ data
    def _next_tasks(self, n: int) -> list:
        order_seed = self.cfg.task.seed
        out = []
        N = len(self.train_tasks)
        for _ in range(n):
            epoch, pos = divmod(self.cursor, N)
            perm = torch.randperm(N, generator=torch.Generator().manual_seed(order_seed * 31 + epoch)).tolist()
            out.append(self.train_tasks[perm[pos]])
            self.cursor += 1
        return out

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, tag: str) -> EvalResult:
        """Held-out success (rank 0 evaluates; the other ranks wait and receive the result)."""
        res = self._evaluate(tag) if self.is_main else None
        if self.world > 1:
            res = self._gather(res)[0]
        return res

    def _evaluate(self, tag: str) -> EvalResult:
        cfg = self.cfg
        self.model.eval()
        saved = seed_everything, torch.get_rng_state(), random.getstate(), np.random.get_state()
        seed_everything(_step_seed(cfg.train.seed, 0, salt=99))
        sampler = HFSampler(self.model, self.tokenizer, temperature=cfg.eval.temperature, top_k=None, top_p=None,
                            max_new_tokens=cfg.sampling.max_new_tokens, policy_version=self.policy_version)
        tasks = self.heldout_tasks[:cfg.eval.during_n] if tag == "during" and cfg.eval.during_n else self.heldout_tasks
        trajs = sampler.rollout(self.source, tasks, group_size=1, seed=_step_seed(cfg.train.seed, 0, 99))
        torch.set_rng_state(saved[1]); random.setstate(saved[2]); np.random.set_state(saved[3])
        self.model.train()
        succ = sum(1 for t in trajs if t.success)
        n = len(trajs)
        lo, hi = wilson_interval(succ, n)
        reward = float(np.mean([t.total_reward for t in trajs])) if trajs else 0.0
        res = EvalResult(success=succ / max(n, 1), low=lo, high=hi, n=n, successes=succ, reward=reward)
        self.metrics.log(self.step, {"eval/success": res.success, "eval/success_low": lo, "eval/success_high": hi,
                                     "eval/reward": reward, "eval/n": n}, kind=f"eval_{tag}")
        return res

    # ------------------------------------------------------------------ model passes
    def _micro_batches(self, B: int) -> List[List[int]]:
        m = self.cfg.train.micro_batch_size
        return [list(range(i, min(i + m, B))) for i in range(0, B, m)]

    def _logprobs(self, batch: RolloutBatch, *, model=None, want_hidden=False, want_entropy=False):
        s = self.cfg.sampling
        return learner_logprobs(model or self.model, batch.input_ids, batch.attention_mask, batch.action_mask,
                                temperature=s.temperature if s.temperature > 0 else 1.0, top_k=s.top_k, top_p=s.top_p,
                                want_hidden=want_hidden, want_entropy=want_entropy)

    def _snapshot_reference(self) -> None:
        """Freeze pi_ref as the current policy (called when RL starts; a no-op once taken)."""
        if self.objective.uses_reference and self.reference is None:
            self.reference = ReferenceWeights(self.model)

    @torch.no_grad()
    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        self._snapshot_reference()
        outs = []
        with self.reference.applied(self.model):
            for idx in self._micro_batches(len(batch)):
                outs.append(self._logprobs(batch.select(idx)).logp)
        return torch.cat(outs, 0)

    # ------------------------------------------------------------------ rollouts
    def _collect(self) -> Tuple[List[Trajectory], Dict[str, float]]:
        cfg, obj = self.cfg, self.objective
        G = obj.group_size
        P = cfg.train.prompts_per_step
        kept: List[Trajectory] = []
        stats = {"dynamic/discarded_groups": 0.0, "dynamic/discarded_tokens": 0.0, "dynamic/tries": 0.0,
                 "time/generate": 0.0, "gen_tokens": 0.0}
        tries = cfg.train.dynamic_sampling_max_tries if obj.dynamic_sampling else 1
        need = P
        for attempt in range(tries):
            tasks = dist_lib.shard(self._next_tasks(need), self.rank, self.world)
            t0 = time.perf_counter()
            trajs = self.sampler.rollout(self.source, tasks, group_size=G,
                                         seed=_step_seed(cfg.train.seed, self.step, attempt * 1000 + self.rank)) if tasks else []
            stats["time/generate"] += time.perf_counter() - t0
            stats["gen_tokens"] += sum(t.num_action_tokens for t in trajs)
            stats["dynamic/tries"] += 1
            groups: Dict[str, List[Trajectory]] = {}
            for t in trajs:
                groups.setdefault(t.task_id, []).append(t)
            for gid, members in groups.items():
                rewards = [m.total_reward for m in members]
                if obj.dynamic_sampling and G > 1 and max(rewards) == min(rewards):
                    stats["dynamic/discarded_groups"] += 1
                    stats["dynamic/discarded_tokens"] += sum(m.num_action_tokens for m in members)
                    for m in members:
                        m.metadata["discarded"] = "zero_variance_group"
                    self.traj_log.extend(members)
                    continue
                kept.extend(members)
            need = P - self._sum_int(len(kept) // G)
            if need <= 0:
                break
        return kept, stats

    # ------------------------------------------------------------------ rewards and advantages
    def _sequence_rewards(self, batch: RolloutBatch) -> Tuple[torch.Tensor, Dict[str, float]]:
        """Per-turn rewards -> (shaped, cost-penalized) per-turn rewards [B, K]."""
        r = batch.turn_rewards.double()
        m = batch.turn_mask
        info: Dict[str, float] = {}
        if self.cfg.task.shaping:
            pots = torch.cat([batch.initial_potential.double()[:, None], batch.turn_potentials.double()], 1)
            # pad one more column so the last valid turn of a full row has its successor
            r = returns_lib.shape_rewards(r, pots, gamma=self.objective.gamma, mask=m,
                                          terminated=batch.terminated[:, None] & (torch.arange(r.shape[1])[None] == m.sum(1, keepdim=True) - 1),
                                          zero_terminal_potential=True)
            info["shaping/bonus"] = float((r - batch.turn_rewards.double())[m].sum() / len(batch))
        if self.lagrange is not None:
            costs = batch.turn_costs.double()
            mean_cost = float(costs.sum(1).mean())
            info["constraint/mean_cost"] = mean_cost
            info["constraint/lambda"] = self.lagrange.value
            r = r - self.lagrange.value * costs
        return torch.where(m, r, torch.zeros_like(r)), info

    @staticmethod
    def _turn_end_positions(batch: RolloutBatch) -> torch.Tensor:
        """[B, K] index (targets-aligned) of the last action token of each turn, -1 if none."""
        B, L = batch.action_mask.shape
        K = batch.turn_mask.shape[1]
        pos = torch.full((B, K), -1, dtype=torch.long)
        ar = torch.arange(L)[None].expand(B, L)
        for k in range(K):
            sel = batch.action_mask & (batch.turn_ids == k)
            last = torch.where(sel, ar, torch.full_like(ar, -1)).max(1).values
            pos[:, k] = last
        return pos

    def _token_rewards(self, batch: RolloutBatch, turn_rewards: torch.Tensor) -> torch.Tensor:
        B, L = batch.action_mask.shape
        tok = torch.zeros(B, L, dtype=torch.float64)
        ends = self._turn_end_positions(batch)
        valid = ends >= 0
        rows = torch.arange(B)[:, None].expand_as(ends)
        tok.index_put_((rows[valid], ends[valid]), turn_rewards[valid], accumulate=True)
        return tok

    # ------------------------------------------------------------------ one step
    def train_step(self) -> Dict[str, float]:
        cfg, obj = self.cfg, self.objective
        seed_everything(_step_seed(cfg.train.seed, self.step))
        t_step = time.perf_counter()
        if obj.loss == "dpo":
            return self._dpo_step()
        trajs, metrics = self._collect()
        self.traj_log.extend(trajs)
        if self._min_int(len(trajs)) == 0:  # every rank must take part in the update, or none
            metrics["skipped"] = 1.0
            return self._reduce_metrics(metrics)
        metrics.update(self.learn(trajs))
        dt = time.perf_counter() - t_step
        metrics["time/step"] = dt
        metrics["throughput/gen_tokens_per_s"] = metrics.pop("gen_tokens") / max(metrics["time/generate"], 1e-9)
        metrics["throughput/samples_per_s"] = len(trajs) / dt * self.world
        return self._reduce_metrics(metrics)

    def _publish(self) -> None:
        """A new policy version: an external server receives the weights (documented sync step)."""
        if self.cfg.rollout.backend == "openai":
            if self.is_main:
                self.sampler.sync_weights(self.model, self.policy_version, self.run_dir / "weights-sync")
            dist_lib.barrier()
        self.sampler.set_policy_version(self.policy_version)

    def _sum_int(self, v: int) -> int:
        if self.world == 1:
            return int(v)
        t = torch.tensor([int(v)], dtype=torch.long)
        torch.distributed.all_reduce(t)
        return int(t)

    def _min_int(self, v: int) -> int:
        if self.world == 1:
            return int(v)
        t = torch.tensor([int(v)], dtype=torch.long)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return int(t)

    def _reduce_metrics(self, metrics: Dict[str, float]) -> Dict[str, float]:
        """Mean over ranks of each metric (rank 0 logs); the union of keys."""
        if self.world == 1:
            return metrics
        all_m = self._gather(metrics)
        keys = sorted(set().union(*[m.keys() for m in all_m]))
        out = {}
        for k in keys:
            vals = [m[k] for m in all_m if k in m and isinstance(m[k], (int, float)) and math.isfinite(m[k])]
            if vals:
                out[k] = float(sum(vals) / len(vals))
        return out

    def learn(self, trajs: Sequence[Trajectory]) -> Dict[str, float]:
        """One update from finished trajectories (used by the synchronous and asynchronous loops)."""
        cfg, obj = self.cfg, self.objective
        metrics: Dict[str, float] = {}
        batch = collate(list(trajs), self.pad_id)
        B = len(batch)
        mask = batch.action_mask
        metrics["reward/mean"] = float(batch.rewards.mean())
        metrics["success/rate"] = float(batch.success.float().mean())
        metrics["len/action_tokens"] = float(mask.sum(1).float().mean())
        metrics["len/turns"] = float(batch.turn_mask.sum(1).float().mean())
        metrics["len/cut_episodes"] = float(batch.truncated.float().mean())

        turn_rewards, rinfo = self._sequence_rewards(batch)
        metrics.update(rinfo)
        if obj.loss == "opd":
            # on-policy distillation: the student's own samples, the teacher's full distribution
            t0 = time.perf_counter()
            metrics.update(self._distill_update(batch))
            metrics["time/update"] = time.perf_counter() - t0
            self.policy_version += 1
            self._publish()
            metrics["policy_version"] = float(self.policy_version)
            return metrics

        # old log-probs, values (critic), reference
        t0 = time.perf_counter()
        behaviour = batch.old_logp.double()
        # "auto": a single on-policy epoch needs no separate pass: the update's own forward pass,
        # detached, IS the recomputed log-prob under the current (= old) weights (ratio 1 exactly)
        fused_old = (cfg.train.old_logp == "auto" and cfg.train.epochs_per_batch == 1 and not obj.critic
                     and obj.loss != "sao" and obj.kl_placement != "reward")
        recomputed = hidden = None
        if not fused_old:
            with torch.no_grad():
                outs = [self._logprobs(batch.select(i), want_hidden=obj.critic, want_entropy=True)
                        for i in self._micro_batches(B)]
                recomputed = torch.cat([o.logp for o in outs], 0).double()
                hidden = torch.cat([o.hidden for o in outs], 0) if obj.critic else None
                entropy = torch.cat([o.entropy for o in outs], 0)
            metrics.update(self._sampler_learner_metrics(recomputed, behaviour, entropy, mask))
        use_behaviour = obj.loss == "sao" or cfg.train.old_logp == "behaviour"
        if use_behaviour:
            old_logp = torch.where(mask, behaviour, 0.0)
        else:
            old_logp = None if fused_old else recomputed
        ref_logp = self._reference_logprobs(batch).double() if obj.kl_placement != "none" else None
        if ref_logp is not None and recomputed is not None:
            metrics["kl/k3_to_reference"] = float(masked_mean(kl_estimate(recomputed, ref_logp, mask, kind="k3"), mask))
        metrics["time/logprob_recompute"] = time.perf_counter() - t0

        # advantages
        if obj.critic:
            tok_r = self._token_rewards(batch, turn_rewards)
            if ref_logp is not None and obj.kl_placement == "reward":
                tok_r = tok_r - obj.kl_in_reward(recomputed, ref_logp, mask).double()
            adv, crit = self._critic_phase(batch, hidden, tok_r)
            metrics.update(crit)
            advantages = adv
        else:
            seq_r = turn_rewards.sum(1)
            if ref_logp is not None and obj.kl_placement == "reward":
                seq_r = seq_r - obj.kl_in_reward(recomputed, ref_logp, mask).sum(1)
            ga = obj.sequence_advantages(seq_r, group_ids=batch.group_ids) if obj.advantage != "return" \
                else obj.sequence_advantages(seq_r)
            advantages = ga.advantages.double()
            zv = ga.zero_variance
            metrics["groups/zero_variance_frac"] = float(zv.float().mean()) if zv.numel() else 0.0

        # policy update
        t0 = time.perf_counter()
        warm = obj.critic and self.step < cfg.critic.warmup_steps
        if not warm:
            metrics.update(self._policy_update(batch, advantages, old_logp, ref_logp, behaviour=behaviour))
            self.policy_version += 1
            self._publish()
        metrics["time/update"] = time.perf_counter() - t0
        if self.lagrange is not None:
            self.lagrange.update(metrics["constraint/mean_cost"])
        metrics["policy_version"] = float(self.policy_version)
        return metrics

    def _critic_phase(self, batch: RolloutBatch, hidden: torch.Tensor, tok_r: torch.Tensor):
        """K critic updates on TD(λ) targets, then advantages from the updated critic (§20.3)."""
        obj, cfg = self.objective, self.cfg
        mask = batch.action_mask
        term = batch.terminated
        B, L = mask.shape
        last = torch.where(mask, torch.arange(L)[None].expand(B, L), torch.full((B, L), -1)).max(1).values
        terminated = torch.zeros(B, L, dtype=torch.bool)
        rows = torch.arange(B)[last >= 0]
        terminated[rows, last[last >= 0]] = term[last >= 0]
        with torch.no_grad():
            values = self.value_head(hidden).double()
        next_rows = batch.next_segment_rows()
        boot = bootstrap_values(values, mask, term, next_rows)
        out = obj.token_advantages(values, tok_r, mask, terminated=terminated, bootstrap_value=boot)
        targets = out.returns
        K = cfg.critic.updates or obj.critic_updates
        vl = None
        vden = self._normalizer([mask], "token_mean").denominator()
        for _ in range(K):
            self.critic_optimizer.zero_grad(set_to_none=True)
            pred = self.value_head(hidden).double()
            vl = value_loss(pred, targets, mask, old_values=values, clip_range=obj.value_clip, denominator=vden)
            vl.loss.backward()
            self._sync_grads(list(self.value_head.parameters()))
            self.critic_optimizer.step()
        with torch.no_grad():
            new_values = self.value_head(hidden).double()
        # the advantages use the updated critic throughout, its bootstrap included
        boot2 = bootstrap_values(new_values, mask, term, next_rows)
        out2 = obj.token_advantages(new_values, tok_r, mask, terminated=terminated, bootstrap_value=boot2)
        ev = explained_variance(targets, values, mask)
        m = {"critic/value_loss": float(vl.loss.detach()), "critic/explained_variance": float(ev),
             "critic/value_mean": float(masked_mean(values, mask))}
        return out2.advantages, m

    @staticmethod
    def _sampler_learner_metrics(learner, behaviour, entropy, mask) -> Dict[str, float]:
        """Entropy, and how far the learner's log-probs are from the sampler's records (§7)."""
        m = {"entropy": float(masked_mean(entropy.double(), mask))}
        m["mismatch/k3_learner_vs_sampler"] = float(masked_mean(kl_estimate(learner, behaviour, mask, kind="k3"), mask))
        diff = torch.where(mask, (learner - torch.nan_to_num(behaviour)).abs(), torch.zeros_like(learner))
        m["mismatch/max_abs_log_ratio"] = float(diff.max()) if diff.numel() else 0.0
        return m

    def _policy_update(self, batch, advantages, old_logp, ref_logp, *, behaviour=None) -> Dict[str, float]:
        """``old_logp=None``: one on-policy epoch; each micro-batch's own detached log-probs are
        the old log-probs (the same numbers a separate no-grad pass would give)."""
        cfg, obj = self.cfg, self.objective
        mask = batch.action_mask
        if old_logp is None and cfg.train.epochs_per_batch != 1:
            raise ValueError("old_logp: required when epochs_per_batch > 1")
        seen_logp, seen_ent = [], []
        mbs = self._micro_batches(len(batch))
        norm = self._normalizer([mask[i] for i in mbs], obj.aggregation, constant=obj.constant)
        den = norm.denominator()
        acc: Dict[str, float] = {}
        loss_total = 0.0
        for _epoch in range(cfg.train.epochs_per_batch):
            self.optimizer.zero_grad(set_to_none=True)
            loss_total = 0.0
            for idx in mbs:
                mb = batch.select(idx)
                first = old_logp is None
                out = self._logprobs(mb, want_entropy=first)
                lp = out.logp.double()
                if first:
                    seen_logp.append(lp.detach())
                    seen_ent.append(out.entropy)
                adv = advantages[idx]
                old_mb = lp.detach() if old_logp is None else old_logp[idx]
                res = obj.policy_loss(lp, adv, mb.action_mask, old_logp=old_mb,
                                      ref_logp=None if ref_logp is None else ref_logp[idx], denominator=den)
                res.loss.backward()
                loss_total += float(res.loss.detach())
                w = float(mb.action_mask.sum()) / max(float(mask.sum()), 1.0)
                for k, v in res.metrics.items():
                    if torch.is_tensor(v) and v.numel() == 1 and torch.isfinite(v):
                        acc[k] = acc.get(k, 0.0) + w * float(v)
            params = [p for p in self.model.parameters() if p.requires_grad]
            self._sync_grads(params)
            if cfg.optim.grad_clip:
                gn = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
                acc["grad_norm"] = float(gn)
            self.optimizer.step()
        acc["loss"] = loss_total
        if seen_logp and behaviour is not None:
            acc.update(self._sampler_learner_metrics(torch.cat(seen_logp, 0), behaviour, torch.cat(seen_ent, 0), mask))
        return acc

    # ------------------------------------------------------------------ teacher (OPD)
    def _build_teacher(self) -> torch.nn.Module:
        """The frozen teacher of on-policy distillation (§14).

        ``teacher.name``: ``"smollm2"`` (the embedded model, frozen; the policy must share
        its tokenizer), ``"tiny"`` (a random tiny model: a smoke test only) or ``"sft"``
        (a tiny model of ``teacher.tiny``'s size trained on demonstrations for
        ``max(50, 2 * sft.steps)`` steps before the run; the student then distils it).
        """
        from ..rollout.models import build_tiny_model, load_smollm2

        tc = self.cfg.teacher
        if tc.name == "smollm2":
            if self.cfg.model.name != "smollm2":
                raise ValueError("teacher.name: 'smollm2' needs model.name 'smollm2' (same tokenizer)")
            teacher, _ = load_smollm2(dtype={"bfloat16": torch.bfloat16, "float32": torch.float32}.get(self.cfg.model.dtype, "auto"))
        else:
            if self.cfg.model.name != "tiny":
                raise ValueError(f"teacher.name: {tc.name!r} builds a tiny teacher; it needs model.name 'tiny'")
            t = tc.tiny
            teacher = build_tiny_model(self.tokenizer, hidden_size=t.hidden_size, layers=t.layers, heads=t.heads, seed=t.seed)
            if tc.name == "sft":
                self.console("training the distillation teacher on demonstrations...")
                self.sft(max(50, 2 * self.cfg.sft.steps), self.cfg.sft.batch_size, self.cfg.sft.lr, model=teacher, seed_salt=23)
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        return teacher

    def _distill_update(self, batch: RolloutBatch) -> Dict[str, float]:
        obj = self.objective
        mbs = self._micro_batches(len(batch))
        norm = self._normalizer([batch.action_mask[i] for i in mbs], obj.aggregation, constant=obj.constant)
        den = norm.denominator()
        self.optimizer.zero_grad(set_to_none=True)
        acc: Dict[str, float] = {}
        total = 0.0
        t = self.cfg.sampling.temperature if self.cfg.sampling.temperature > 0 else 1.0
        for idx in mbs:
            mb = batch.select(idx)
            h, w, b = head_inputs(self.model, mb.input_ids, mb.attention_mask)
            with torch.no_grad():
                th, tw, tb = head_inputs(self.teacher, mb.input_ids, mb.attention_mask)
            res = obj.distill_loss(student_hidden=h, student_weight=w, student_bias=b, teacher_hidden=th,
                                   teacher_weight=tw, teacher_bias=tb, mask=mb.action_mask, denominator=den,
                                   temperature=t)
            res.loss.backward()
            total += float(res.loss.detach())
            wgt = float(mb.action_mask.sum()) / max(float(batch.action_mask.sum()), 1.0)
            for k, v in res.metrics.items():
                if torch.is_tensor(v) and v.numel() == 1 and torch.isfinite(v):
                    acc[k] = acc.get(k, 0.0) + wgt * float(v)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self._sync_grads(params)
        if self.cfg.optim.grad_clip:
            acc["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip))
        self.optimizer.step()
        acc["loss"] = total
        return acc

    # ------------------------------------------------------------------ SFT and DPO
    def _demo_batch(self, tasks) -> RolloutBatch:
        trajs = [demonstration_trajectory(self.tokenizer, self.source, t) for t in tasks]
        return collate(trajs, self.pad_id)

    def sft(self, steps: int, batch_size: int, lr: float, progress=None, *, model=None, seed_salt: int = 17) -> List[float]:
        """Masked negative log-likelihood on demonstrations (action tokens only)."""
        if steps <= 0:
            return []
        model = self.model if model is None else model
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        losses = []
        rng = random.Random(self.cfg.train.seed + seed_salt)
        for s in range(steps):
            tasks = [self.train_tasks[rng.randrange(len(self.train_tasks))] for _ in range(batch_size)]
            tasks = dist_lib.shard(tasks, self.rank, self.world) or tasks[:1]
            batch = self._demo_batch(tasks)
            opt.zero_grad(set_to_none=True)
            mbs = self._micro_batches(len(batch))
            den = self._normalizer([batch.action_mask[i] for i in mbs], "token_mean").denominator()
            total = 0.0
            for idx in mbs:
                mb = batch.select(idx)
                logp = self._logprobs(mb, model=model).logp
                loss = aggregate(-logp, mb.action_mask, "token_mean", denominator=den)
                loss.backward()
                total += float(loss.detach())
            self._sync_grads([p for p in model.parameters() if p.requires_grad])
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            opt.step()
            losses.append(total)
            if progress is not None:
                progress(s, total)
        return losses

    def _build_dpo_pairs(self) -> List[Tuple[Trajectory, Trajectory]]:
        """Offline pairs: a demonstration (chosen) against a failed sample of the initial policy."""
        cfg = self.cfg
        tasks = self.train_tasks[: cfg.dpo.pairs]
        seed_everything(_step_seed(cfg.train.seed, 0, salt=7))
        samples = self.sampler.rollout(self.source, tasks, group_size=2, seed=_step_seed(cfg.train.seed, 0, 7))
        by_task: Dict[str, List[Trajectory]] = {}
        for t in samples:
            by_task.setdefault(t.task_id, []).append(t)
        pairs = []
        for task in tasks:
            failed = [t for t in by_task.get(task.id, []) if not t.success]
            if failed:
                pairs.append((demonstration_trajectory(self.tokenizer, self.source, task), failed[0]))
        if not pairs:
            raise ValueError("dpo.pairs: the initial policy solved every task; no rejected responses to pair with")
        return pairs

    def _dpo_step(self) -> Dict[str, float]:
        from ..losses import sequence_logp

        if self.dpo_pairs is None:
            self.dpo_pairs = self._build_dpo_pairs()
        n = min(self.cfg.train.prompts_per_step, len(self.dpo_pairs))
        start = (self.cursor * n) % len(self.dpo_pairs)
        pairs = [self.dpo_pairs[(start + i) % len(self.dpo_pairs)] for i in range(n)]
        pairs = dist_lib.shard(pairs, self.rank, self.world) or pairs[:1]
        self.cursor += 1
        chosen = collate([p[0] for p in pairs], self.pad_id)
        rejected = collate([p[1] for p in pairs], self.pad_id)
        with torch.no_grad():
            ref_c = sequence_logp(self._reference_logprobs(chosen).double(), chosen.action_mask)
            ref_r = sequence_logp(self._reference_logprobs(rejected).double(), rejected.action_mask)
        self.optimizer.zero_grad(set_to_none=True)
        pc = sequence_logp(self._logprobs(chosen).logp.double(), chosen.action_mask)
        pr = sequence_logp(self._logprobs(rejected).logp.double(), rejected.action_mask)
        res = self.objective.dpo_loss(pc, pr, ref_c, ref_r)
        (res.loss / self.world).backward()
        self._sync_grads([p for p in self.model.parameters() if p.requires_grad])
        torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], self.cfg.optim.grad_clip or 1e9)
        self.optimizer.step()
        self.policy_version += 1
        out = {"loss": float(res.loss.detach())}
        out.update({k: float(v.detach()) for k, v in res.metrics.items() if torch.is_tensor(v) and v.numel() == 1})
        return out

    # ------------------------------------------------------------------ the run
    def run(self) -> Dict[str, Any]:
        from tqdm.auto import tqdm

        cfg = self.cfg
        show = cfg.log.progress and self.is_main
        if not self.resume:
            if cfg.eval.before:
                self.console(f"evaluating on {len(self.heldout_tasks)} held-out tasks (before training)...")
                self.eval_before = self.evaluate("before")
                self.console(_fmt_eval("before", self.eval_before))
            if cfg.sft.steps > 0:
                bar = tqdm(total=cfg.sft.steps, desc="sft warm start", disable=not show, dynamic_ncols=True)

                def prog(s, loss):
                    bar.update(1)
                    bar.set_postfix(nll=f"{loss:.3f}")
                    self.metrics.log(s, {"sft/nll": loss}, kind="sft")

                self.sft(cfg.sft.steps, cfg.sft.batch_size, cfg.sft.lr, progress=prog)
                bar.close()
                if cfg.eval.before:
                    ev = self.evaluate("after_sft")
                    self.console(_fmt_eval("after SFT", ev))
            self._snapshot_reference()
            if cfg.checkpoint.every:
                self.save()
        bar = tqdm(total=cfg.train.steps, initial=self.step, desc=f"{self.objective.name}", disable=not show,
                   dynamic_ncols=True)
        while self.step < cfg.train.steps:
            m = self.train_step()
            self.step += 1
            self.metrics.log(self.step, m, kind="train")
            bar.update(1)
            bar.set_postfix({short: f"{m[k]:.3g}" for k, short in _POSTFIX if k in m})
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.train.steps:
                ev = self.evaluate("during")
                if self.is_main:
                    (bar.write if show else self.console)(_fmt_eval(f"at step {self.step}", ev))
            if cfg.checkpoint.every and (self.step % cfg.checkpoint.every == 0 or self.step == cfg.train.steps):
                self.save()
        bar.close()
        return self.finish({"steps": self.step, "recipe": self.objective.name})

    def finish(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        """Held-out evaluation after training, before/after comparison, ``summary.json``."""
        if self.cfg.eval.after:
            after = self.evaluate("after")
            summary["eval_after"] = after.__dict__
            self.console(_fmt_eval("after", after))
            if self.eval_before is not None:
                b = self.eval_before
                p = two_proportion_test(b.successes, b.n, after.successes, after.n)
                summary["eval_before"] = b.__dict__
                summary["p_value"] = p
                self.console(f"held-out success {b.success:.1%} -> {after.success:.1%} "
                             f"(change {after.success - b.success:+.1%}, two-proportion p = {p:.3g})")
        if self.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        self.traj_log.close()
        dist_lib.barrier()
        return summary


def bootstrap_values(values: torch.Tensor, mask: torch.Tensor, terminated: torch.Tensor,
                     next_rows: torch.Tensor) -> torch.Tensor:
    r"""``[B]`` :math:`V(s_T)`, the value after each row's last action token (§6, §19, §20.4).

    * a terminated row: 0 (nothing follows);
    * a compacted sub-trace whose next sub-trace is in the batch (``next_rows[b] >= 0``):
      the critic's value at that sub-trace's first action token, i.e. of the compacted
      information state (summary + observation) the episode continues from (§19);
    * otherwise (truncated, or the next sub-trace not in the batch): the value at the row's
      own last action token, the latest state the critic has seen.

    ``values`` and ``mask`` are ``[B, L]`` (mask: action tokens); rows without action
    tokens get 0.
    """
    B, L = mask.shape
    pos = torch.arange(L)[None].expand(B, L)
    has = mask.any(1)
    last = torch.where(mask, pos, torch.full_like(pos, -1)).max(1).values.clamp_min(0)
    first = torch.where(mask, pos, torch.full_like(pos, L)).min(1).values.clamp_max(L - 1)
    rows = torch.arange(B)
    own = values[rows, last]
    nxt = next_rows.clamp_min(0)
    follow = (next_rows >= 0) & has[nxt]
    boot = torch.where(follow, values[nxt, first[nxt]], own)
    zero = torch.zeros(B, dtype=values.dtype)
    return torch.where(terminated | ~has, zero, boot)


# live metrics on the progress bar: (metric key, label)
_POSTFIX = (("reward/mean", "reward"), ("success/rate", "success"), ("kl/k3", "kl"), ("kl/k3_to_reference", "kl_ref"),
            ("clip_frac/pos_high", "clip+"), ("clip_frac/neg_low", "clip-"), ("entropy", "entropy"),
            ("throughput/gen_tokens_per_s", "tok/s"))


class _NullLogger:
    """Metrics sink of ranks other than 0."""

    offset = 0

    def log(self, *args, **kwargs):
        return {}

    def close(self):
        pass


def _fmt_eval(tag: str, r: EvalResult) -> str:
    return f"held-out success {tag}: {r.successes}/{r.n} = {r.success:.1%} (95% CI {r.low:.1%}–{r.high:.1%}), mean reward {r.reward:.3f}"
