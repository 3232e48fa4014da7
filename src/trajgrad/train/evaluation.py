"""Held-out evaluation: success rate with its Wilson interval (rank 0 samples, every rank gets it)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from .. import distributed as dist_lib
from ..rollout import HFSampler
from .seeding import seed_everything, step_seed
from ..stats import wilson_interval


@dataclass
class EvalResult:
    success: float
    low: float
    high: float
    n: int
    successes: int
    reward: float
    # several environments (tasks:): each one's own held-out result, by name; None with one task
    environments: Optional[Dict[str, Dict[str, float]]] = None
    # each held-out task's outcome (1 solved, 0 not), in the order of the held-out tasks: the
    # pairs of a paired before/after test (trajgrad.stats.paired_counts); not in to_dict
    outcomes: Optional[Tuple[int, ...]] = None
    # held-out episodes an external agent did not end with a reward (an agent error, a timeout, a
    # rewritten history; rollout.backend proxy): counted as failures in n, never left out
    unfinished: int = 0

    def to_dict(self) -> Dict:
        """The fields (``environments`` only for a run with several; not ``outcomes``), for
        summaries and checkpoints."""
        d = dict(self.__dict__)
        del d["outcomes"]
        if not d["unfinished"]:
            del d["unfinished"]
        if d["environments"] is None:
            del d["environments"]
        return d


def format_eval(tag: str, r: EvalResult) -> str:
    text = (f"held-out success {tag}: {r.successes}/{r.n} = {r.success:.1%} (95% CI {r.low:.1%}–{r.high:.1%}), "
            f"mean reward {r.reward:.3f}")
    if r.unfinished:
        text += f"; {r.unfinished} of the {r.n} episodes ended without a reward (counted as failures)"
    for name, e in (r.environments or {}).items():
        text += (f"\n  {name}: {e['successes']}/{e['n']} = {e['success']:.1%} (95% CI {e['low']:.1%}–{e['high']:.1%}), "
                 f"mean reward {e['reward']:.3f}")
    return text


def _result(trajs) -> EvalResult:
    """Success over ``trajs``, one per held-out task in order; ``None`` (an episode that did not
    finish) is a failure with reward 0, counted in ``unfinished``."""
    succ = sum(1 for t in trajs if t is not None and t.success)
    n = len(trajs)
    lo, hi = wilson_interval(succ, n)
    reward = float(np.mean([0.0 if t is None else t.total_reward for t in trajs])) if trajs else 0.0
    return EvalResult(success=succ / max(n, 1), low=lo, high=hi, n=n, successes=succ, reward=reward,
                      outcomes=tuple(int(t is not None and bool(t.success)) for t in trajs),
                      unfinished=sum(1 for t in trajs if t is None))


def _by_task(tasks, trajs):
    """The agent's trajectories in the order of ``tasks`` (one each), ``None`` where an episode did not
    finish; matched by task id (the proxy records ``str(task.id)``)."""
    left: Dict[str, list] = {}
    for t in trajs:
        left.setdefault(str(t.task_id), []).append(t)
    return [left[str(task.id)].pop(0) if left.get(str(task.id)) else None for task in tasks]


@torch.no_grad()
def evaluate(trainer, tag: str) -> EvalResult:
    """Held-out success of ``trainer``'s policy, logged as ``eval_<tag>``.

    Sampling at ``eval.temperature`` with a fixed seed (the same tasks and seeds at every
    evaluation of a run); the global RNG state is restored afterwards, so an evaluation
    does not change what training samples next. ``tag == "during"`` uses the first
    ``eval.during_n`` tasks when set. With several environments (``tasks:``) each one is
    evaluated on its own held-out tasks (the first ``eval.during_n`` of each), logged as
    ``eval/<name>/success`` etc. beside the overall ``eval/success``.
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
    mixture = getattr(trainer, "mixture", None)  # several environments (refused with the proxy's agent)
    server_eval = getattr(trainer.sampler, "evaluate_on", None)
    if agent_eval is not None:  # rollout.backend proxy: the external agent on the held-out tasks
        # an episode the agent did not end is a failure of its task (None), never left out
        trajs = _by_task(tasks, agent_eval(tasks, temperature=cfg.eval.temperature,
                                           seed=step_seed(cfg.train.seed, 0, 99)))
    elif server_eval is not None:  # rollout.backend vllm: the server samples with the synced weights
        trajs = server_eval(trainer.source, tasks, temperature=cfg.eval.temperature,
                            seed=step_seed(cfg.train.seed, 0, 99))
    else:
        sampler = HFSampler(model, trainer.tokenizer, temperature=cfg.eval.temperature, top_k=None, top_p=None,
                            max_new_tokens=cfg.sampling.max_new_tokens, policy_version=trainer.policy_version)
        sampler.template_mismatch = cfg.rollout.template_mismatch
        parts = [(None, trainer.source, tasks)] if mixture is None else \
            mixture.heldout_parts(cfg.eval.during_n if tag == "during" else None)
        by_env = {name: sampler.rollout(source, part, group_size=1, seed=step_seed(cfg.train.seed, 0, 99))
                  for name, source, part in parts}
        trajs = [t for part in by_env.values() for t in part]
    torch.set_rng_state(saved[0]); random.setstate(saved[1]); np.random.set_state(saved[2])
    model.train()
    res = _result(trajs)
    logged = {"eval/success": res.success, "eval/success_low": res.low, "eval/success_high": res.high,
              "eval/reward": res.reward, "eval/n": res.n}
    if agent_eval is not None:
        logged["eval/unfinished"] = res.unfinished
    if agent_eval is None and mixture is not None:
        res.environments = {name: {k: v for k, v in _result(part).__dict__.items() if k not in ("environments", "outcomes", "unfinished")}
                            for name, part in by_env.items()}
        for name, e in res.environments.items():
            logged.update({f"eval/{name}/{k}": e[k] for k in ("success", "reward", "n")})
            logged.update({f"eval/{name}/success_low": e["low"], f"eval/{name}/success_high": e["high"]})
    trainer.metrics.log(trainer.step, logged, kind=f"eval_{tag}")
    return res
