"""Demonstrations as token-exact trajectories (SFT warm start, DPO's chosen responses).

A demonstration is assembled exactly like a sampled episode (``rollout.chat``): the
environment's initial conversation rendered with the chat template, each assistant turn
as its tokens plus ``<|im_end|>``, and each following user turn (a tool result) as
observation tokens with ``action_mask = 0``. Demonstration tokens were not sampled by any
policy: their recorded behaviour log-prob is 0.0 and ``metadata["demonstration"]`` is True,
so they must never feed an importance ratio.
"""
from __future__ import annotations

from typing import List

from ..rollout.chat import encode, end_of_turn_id, observation_ids, prompt_ids
from ..rollout.trajectory import Trajectory, Turn


def demonstration_trajectory(tokenizer, source, task) -> Trajectory:
    env = source.make_env()
    messages = list(env.reset(task))
    demo = list(source.demonstration(task))
    if not demo or demo[0].get("role") != "assistant":
        raise ValueError(f"task: the demonstration of {task.id!r} must start with an assistant turn")
    eos = end_of_turn_id(tokenizer)
    turns: List[Turn] = []
    i = 0
    while i < len(demo):
        msg = demo[i]
        if msg.get("role") != "assistant":
            raise ValueError(f"task: demonstration of {task.id!r} has two non-assistant turns in a row at {i}")
        action = encode(tokenizer, msg["content"]) + [eos]
        j = i + 1
        follow = []
        while j < len(demo) and demo[j].get("role") != "assistant":
            follow.append(demo[j])
            j += 1
        obs = observation_ids(tokenizer, follow, add_generation_prompt=j < len(demo)) if j < len(demo) else []
        turns.append(Turn(action_ids=action, observation_ids=obs, behaviour_logp=[0.0] * len(action),
                          policy_version=0, reward=0.0, action_text=msg["content"]))
        i = j
    turns[-1].reward = 1.0
    return Trajectory(task_id=task.id, episode_id=f"demo-{task.id}", prompt_ids=prompt_ids(tokenizer, messages),
                      turns=turns, split=task.split, terminated=True, success=True,
                      metadata={"demonstration": True})
