"""Demonstration data of the trainer: SFT batches and DPO's offline preference pairs.

A demonstration is a token-exact trajectory built by
:func:`trajgrad.rollout.chat.demonstration_trajectory` (the environment's initial
conversation, each assistant message as action tokens, each following tool result as
observation tokens). Its tokens were not sampled by any policy (policy version -1, behaviour
log-prob placeholders), so it feeds likelihood terms only (SFT, DPO), never a ratio.
With ``proxy`` (``rollout.backend: proxy``: the agent is the environment) it is
:func:`trajgrad.serve.demonstrations.proxy_demonstration` instead: the agent's first request
(``source.first_request(task)``) and the exchange, rendered as the recording proxy renders them.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ..rollout import RolloutBatch, Trajectory, collate
from ..rollout.chat import demonstration_trajectory
from ..serve.demonstrations import proxy_demonstration

Pair = Tuple[Trajectory, Trajectory]


def demonstration(tokenizer, source, task, *, proxy: bool = False) -> Trajectory:
    """The demonstration of ``task``: from its environment, or (``proxy``) from its agent's first request."""
    return proxy_demonstration(tokenizer, source, task) if proxy else demonstration_trajectory(tokenizer, source, task)


def demo_batch(tokenizer, source, tasks: Sequence, pad_id: int, *, proxy: bool = False) -> RolloutBatch:
    """The collated demonstrations of ``tasks``."""
    return collate([demonstration(tokenizer, source, t, proxy=proxy) for t in tasks], pad_id)


def build_dpo_pairs(tokenizer, source, tasks: Sequence, samples: Sequence[Trajectory], *,
                    proxy: bool = False) -> List[Pair]:
    """Offline pairs: a task's demonstration (chosen) against its first failed sample (rejected).

    Tasks without a failed sample give no pair; raises if no task does.
    """
    by_task: Dict[str, List[Trajectory]] = {}
    for t in samples:
        by_task.setdefault(t.task_id, []).append(t)
    pairs = []
    for task in tasks:
        failed = [t for t in by_task.get(task.id, []) if not t.success]
        if failed:
            pairs.append((demonstration(tokenizer, source, task, proxy=proxy), failed[0]))
    if not pairs:
        raise ValueError("dpo.pairs: the initial policy solved every task; no rejected responses to pair with")
    return pairs


def pairs_for_step(pairs: Sequence[Pair], cursor: int, per_step: int) -> List[Pair]:
    """The step's pairs: ``min(per_step, len(pairs))`` consecutive pairs from ``cursor * n``
    (cyclically), the same on every rank before sharding."""
    n = min(per_step, len(pairs))
    start = (cursor * n) % len(pairs)
    return [pairs[(start + i) % len(pairs)] for i in range(n)]
