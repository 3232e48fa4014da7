"""Build everything a run needs from its :class:`~trajgrad.train.config.Config`.

Each builder reads one part of the config: the tasks (:func:`build_tasks`), the learner
state, i.e. policy, optimizer, critic, teacher (:func:`build_learner`), the rollout
sampler (:func:`build_sampler`) and the Lagrangian multiplier (:func:`build_lagrange`).
The :class:`~trajgrad.train.trainer.Trainer` calls them in that order.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..losses import LagrangeMultiplier
from ..objective import Objective
from ..rollout import HFSampler
from .config import Config
from ..model.build import build_policy_model
from ..model.parts import causal_parts
from ..model.value_head import ValueHead
from .updates import LearnerState


def build_tasks(cfg: Config):
    """(task source, training tasks, held-out tasks)."""
    from ..envs import get_task_source

    source = get_task_source(cfg.task.name, **cfg.task.options)
    train = source.tasks("train", cfg.task.n_train, cfg.task.seed)
    heldout = source.tasks("heldout", cfg.eval.n or cfg.task.n_heldout, cfg.task.seed)
    return source, train, heldout


def build_learner(cfg: Config, objective: Objective):
    """(:class:`LearnerState`, tokenizer): the policy and its AdamW optimizer, and, for a
    critic recipe, the token-wise value head with its own optimizer. The teacher of
    distillation is attached afterwards (:func:`build_teacher` needs the SFT step)."""
    model, tokenizer = build_policy_model(cfg.model)
    if cfg.dist.fsdp:  # before the optimizer: it must hold the sharded parameters
        from .fsdp import shard_model

        model = shard_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    value_head = critic_optimizer = None
    if objective.critic:
        hidden = causal_parts(model)[1].weight.shape[1]
        value_head = ValueHead(hidden)
        critic_optimizer = torch.optim.AdamW(value_head.parameters(), lr=cfg.critic.lr)
    s = cfg.sampling
    st = LearnerState(objective=objective, model=model, optimizer=optimizer,
                      micro_batch_size=cfg.train.micro_batch_size,
                      temperature=s.temperature if s.temperature > 0 else 1.0, top_k=s.top_k, top_p=s.top_p,
                      grad_clip=cfg.optim.grad_clip, epochs_per_batch=cfg.train.epochs_per_batch,
                      critic_updates=cfg.critic.updates or objective.critic_updates,
                      value_head=value_head, critic_optimizer=critic_optimizer)
    return st, tokenizer


def build_teacher(cfg: Config, tokenizer, sft: Callable, console=print) -> torch.nn.Module:
    """The frozen teacher of on-policy distillation (§14).

    ``teacher.path``: any causal LM from a checkpoint directory or a cached hub id (loaded
    like ``model.path``, in the policy's dtype); its tokenizer must have the policy's
    vocabulary. Otherwise ``teacher.name``: ``"smollm2"`` (the embedded model, frozen; the
    policy must share its tokenizer), ``"tiny"`` (a random tiny model: a smoke test only) or
    ``"sft"`` (a tiny model of ``teacher.tiny``'s size trained on demonstrations for
    ``max(50, 2 * sft.steps)`` steps with ``sft(steps, batch_size, lr, model=...,
    seed_salt=...)``; the student then distils it).
    """
    from ..model.build import build_model
    from ..model.smollm2 import load_smollm2
    from ..model.tiny import build_tiny_model

    tc = cfg.teacher
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(cfg.model.dtype, "auto")
    if tc.path is not None:
        teacher, teacher_tok = build_model(path=tc.path, dtype=dtype, key="teacher.path")
        if teacher_tok.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"teacher.path: the tokenizer of {tc.path!r} has another vocabulary than the policy's "
                             f"({len(teacher_tok)} vs {len(tokenizer)} tokens); distillation compares per-token "
                             "distributions, so both need the same tokenizer")
    elif tc.name == "smollm2":
        if cfg.model.name != "smollm2" or cfg.model.path is not None:
            raise ValueError("teacher.name: 'smollm2' needs model.name 'smollm2' (same tokenizer)")
        teacher, _ = load_smollm2(dtype=dtype)
    else:
        if cfg.model.name != "tiny" or cfg.model.path is not None:
            raise ValueError(f"teacher.name: {tc.name!r} builds a tiny teacher; it needs model.name 'tiny'")
        t = tc.tiny
        teacher = build_tiny_model(tokenizer, hidden_size=t.hidden_size, layers=t.layers, heads=t.heads, seed=t.seed)
        if tc.name == "sft":
            console("training the distillation teacher on demonstrations...")
            sft(max(50, 2 * cfg.sft.steps), cfg.sft.batch_size, cfg.sft.lr, model=teacher, seed_salt=23)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def build_sampler(cfg: Config, model, tokenizer, policy_version: int = 0):
    """The rollout backend: the in-process :class:`HFSampler`, or an OpenAI-compatible server.

    Either renders conversations with the model's chat template; ``rollout.template_mismatch``
    says what a template that re-renders the history differently does.
    """
    s = cfg.sampling
    if cfg.rollout.backend == "proxy":  # the agent runs against the served live policy (trajgrad.train.proxy)
        from .proxy import build_proxy_sampler

        return build_proxy_sampler(cfg, model, tokenizer, policy_version)
    if cfg.rollout.backend == "openai":
        from ..rollout.openai_backend import OpenAISampler

        if not cfg.rollout.base_url:
            raise ValueError("rollout.base_url: required for backend 'openai'")
        served = cfg.rollout.model_name or (cfg.model.path if cfg.model.path is not None else cfg.model.name)
        sampler = OpenAISampler(cfg.rollout.base_url, tokenizer, model_name=served,
                                temperature=s.sampler_temperature, top_k=s.top_k, top_p=s.top_p,
                                max_new_tokens=s.max_new_tokens, policy_version=policy_version,
                                server=cfg.rollout.server)
    else:
        sampler = HFSampler(model, tokenizer, temperature=s.sampler_temperature, top_k=s.top_k, top_p=s.top_p,
                            max_new_tokens=s.max_new_tokens, policy_version=policy_version)
    sampler.template_mismatch = cfg.rollout.template_mismatch
    return sampler


def build_lagrange(cfg: Config) -> Optional[LagrangeMultiplier]:
    """The cost multiplier of a constrained run (§22), or None."""
    c = cfg.constraint
    return LagrangeMultiplier(init=c.init, lr=c.lr, budget=c.budget) if c.enabled else None
