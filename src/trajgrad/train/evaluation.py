"""Held-out evaluation: success rate with its Wilson interval (rank 0 samples, every rank gets it)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from .. import distributed as dist_lib
from ..rollout import HFSampler
from .seeding import seed_everything, step_seed
from .stats import wilson_interval


@dataclass
class EvalResult:
    success: float
    low: float
    high: float
    n: int
    successes: int
    reward: float


def format_eval(tag: str, r: EvalResult) -> str:
    return (f"held-out success {tag}: {r.successes}/{r.n} = {r.success:.1%} (95% CI {r.low:.1%}–{r.high:.1%}), "
            f"mean reward {r.reward:.3f}")


@torch.no_grad()
def evaluate(trainer, tag: str) -> EvalResult:
    """Held-out success of ``trainer``'s policy, logged as ``eval_<tag>``.

    Sampling at ``eval.temperature`` with a fixed seed (the same tasks and seeds at every
    evaluation of a run); the global RNG state is restored afterwards, so an evaluation
    does not change what training samples next. ``tag == "during"`` uses the first
    ``eval.during_n`` tasks when set.
    """
    res = _evaluate(trainer, tag) if trainer.is_main else None
    return dist_lib.gather_objects(res)[0]


def _evaluate(trainer, tag: str) -> EvalResult:
    cfg = trainer.cfg
    model = trainer.model
    model.eval()
    saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
    seed_everything(step_seed(cfg.train.seed, 0, salt=99))
    tasks = trainer.heldout_tasks
    if tag == "during" and cfg.eval.during_n:
        tasks = tasks[:cfg.eval.during_n]
    agent_eval = getattr(trainer.sampler, "evaluate", None)
    server_eval = getattr(trainer.sampler, "evaluate_on", None)
    if agent_eval is not None:  # rollout.backend proxy: the external agent on the held-out tasks
        trajs = agent_eval(tasks, temperature=cfg.eval.temperature, seed=step_seed(cfg.train.seed, 0, 99))
    elif server_eval is not None:  # rollout.backend vllm: the server samples with the synced weights
        trajs = server_eval(trainer.source, tasks, temperature=cfg.eval.temperature,
                            seed=step_seed(cfg.train.seed, 0, 99))
    else:
        sampler = HFSampler(model, trainer.tokenizer, temperature=cfg.eval.temperature, top_k=None, top_p=None,
                            max_new_tokens=cfg.sampling.max_new_tokens, policy_version=trainer.policy_version)
        sampler.template_mismatch = cfg.rollout.template_mismatch
        trajs = sampler.rollout(trainer.source, tasks, group_size=1, seed=step_seed(cfg.train.seed, 0, 99))
    torch.set_rng_state(saved[0]); random.setstate(saved[1]); np.random.set_state(saved[2])
    model.train()
    succ = sum(1 for t in trajs if t.success)
    n = len(trajs)
    lo, hi = wilson_interval(succ, n)
    reward = float(np.mean([t.total_reward for t in trajs])) if trajs else 0.0
    res = EvalResult(success=succ / max(n, 1), low=lo, high=hi, n=n, successes=succ, reward=reward)
    trainer.metrics.log(trainer.step, {"eval/success": res.success, "eval/success_low": lo, "eval/success_high": hi,
                                       "eval/reward": reward, "eval/n": n}, kind=f"eval_{tag}")
    return res
