"""Build everything a run needs from its :class:`~trajgrad.train.config.Config`.

Each builder reads one part of the config: the tasks (:func:`build_tasks`), the learner
state, i.e. policy, optimizer, pi_ref from a path, critic, teacher (:func:`build_learner`), the rollout
sampler (:func:`build_sampler`) and the Lagrangian multiplier (:func:`build_lagrange`).
The :class:`~trajgrad.train.trainer.Trainer` calls them in that order.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from ..control import LagrangeMultiplier
from ..envs import get_task_source
from ..model.build import build_model, build_policy_model
from ..model.parts import causal_parts
from ..model.smollm2 import load_smollm2
from ..model.tiny import build_tiny_model
from ..model.value_head import CriticModel, ValueHead
from ..objective import Objective
from ..rollout import HFSampler
from ..rollout.openai_backend import OpenAISampler
from ..rollout.vllm_sampler import VLLMSampler
from ..weights import ReferenceModel
from .config import Config
from .fsdp import shard_model
from .heldout import heldout_key, select_heldout
from ..serve.proxy import build_proxy_sampler
from ..serve.vllm_engine import VLLMEngine
from .updates import LearnerState


def build_tasks(cfg: Config, console: Callable[[str], None] = lambda _m: None):
    """(task source, training tasks, held-out tasks): the held-out ones distinct
    (:func:`~trajgrad.train.heldout.select_heldout`); ``console`` gets the source's notes
    (e.g. an adapter's turn limit) and the held-out count."""
    source = get_task_source(cfg.task.name, **cfg.task.options)
    train = source.tasks("train", cfg.task.n_train, cfg.task.seed)
    heldout, line = select_heldout(cfg, source, source.tasks("heldout", heldout_key(cfg)[1], cfg.task.seed))
    for note in getattr(source, "notes", ()):
        console(note)
    console(line)
    return source, train, heldout


def _dtype(cfg: Config):
    """The policy's dtype setting, for the other models of a run (reference, critic, teacher)."""
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(cfg.model.dtype, "auto")


def _same_vocabulary(key: str, path: str, tok, policy_tok, why: str) -> None:
    """ValueError naming ``key`` unless the tokenizer loaded from ``path`` has the policy's vocabulary."""
    if tok.get_vocab() != policy_tok.get_vocab():
        raise ValueError(f"{key}: the tokenizer of {path!r} has another vocabulary than the policy's "
                         f"({len(tok)} vs {len(policy_tok)} tokens); {why}, so both need the same tokenizer")


def build_reference(cfg: Config, tokenizer) -> Optional[ReferenceModel]:
    """pi_ref from ``reference.path`` (frozen, in the policy's dtype; loaded like
    ``model.path``), or None: pi_ref is then the policy as RL starts (snapshotted later)."""
    if cfg.reference.path is None:
        return None

    ref, ref_tok = build_model(path=cfg.reference.path, dtype=_dtype(cfg), key="reference.path")
    _same_vocabulary("reference.path", cfg.reference.path, ref_tok, tokenizer,
                     "the KL term compares the log-probs of the same token ids")
    return ReferenceModel(ref)


def build_critic(cfg: Config, model, tokenizer) -> torch.nn.Module:
    """The critic: a :class:`ValueHead` on the policy's hidden states, or with ``critic.path``
    a :class:`CriticModel` (that checkpoint's backbone, in the policy's dtype, and a value head)."""
    if cfg.critic.path is None:
        return ValueHead(causal_parts(model)[1].weight.shape[1])

    backbone, critic_tok = build_model(path=cfg.critic.path, dtype=_dtype(cfg), key="critic.path", train=True)
    _same_vocabulary("critic.path", cfg.critic.path, critic_tok, tokenizer,
                     "the critic reads the policy's token ids")
    return CriticModel(backbone)


def build_learner(cfg: Config, objective: Objective):
    """(:class:`LearnerState`, tokenizer): the policy and its AdamW optimizer, pi_ref when
    ``reference.path`` gives one (:func:`build_reference`), and, for a critic recipe, the
    critic (:func:`build_critic`) with its own optimizer. The teacher of distillation is
    attached afterwards (:func:`build_teacher` needs the SFT step)."""
    model, tokenizer = build_policy_model(cfg.model)
    if cfg.dist.fsdp:  # before the optimizer: it must hold the sharded parameters
        model = shard_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    value_head = critic_optimizer = None
    if objective.critic:
        value_head = build_critic(cfg, model, tokenizer)
        critic_optimizer = torch.optim.AdamW(value_head.parameters(), lr=cfg.critic.lr)
    s = cfg.sampling
    st = LearnerState(objective=objective, model=model, optimizer=optimizer,
                      micro_batch_size=cfg.train.micro_batch_size,
                      temperature=s.temperature if s.temperature > 0 else 1.0, top_k=s.top_k, top_p=s.top_p,
                      grad_clip=cfg.optim.grad_clip, epochs_per_batch=cfg.train.epochs_per_batch,
                      skip_zero_gradient_rows=cfg.train.skip_zero_gradient_rows,
                      critic_updates=cfg.critic.updates or objective.critic_updates,
                      value_head=value_head, critic_optimizer=critic_optimizer,
                      reference=build_reference(cfg, tokenizer) if objective.uses_reference else None)
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
    tc = cfg.teacher
    dtype = _dtype(cfg)
    if tc.path is not None:
        teacher, teacher_tok = build_model(path=tc.path, dtype=dtype, key="teacher.path")
        _same_vocabulary("teacher.path", tc.path, teacher_tok, tokenizer,
                         "distillation compares per-token distributions")
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


def build_sampler(cfg: Config, model, tokenizer, policy_version: int = 0, run_dir=None, *, work_dir=None,
                  console=print):
    """The rollout backend: the in-process :class:`HFSampler`, an OpenAI-compatible server, or a
    vLLM server this run starts under ``work_dir`` (``rollout.backend: vllm``; with
    ``rollout.base_url``: the running vLLM server there).

    Either renders conversations with the model's chat template; ``rollout.template_mismatch``
    says what a template that re-renders the history differently does. A proxy agent's
    output is kept in ``run_dir`` (:func:`~trajgrad.serve.proxy.build_proxy_sampler`).
    """
    s = cfg.sampling
    if cfg.rollout.backend == "proxy":  # the agent runs against the served live policy (trajgrad.serve.proxy)
        engine = None
        if cfg.rollout.proxy.engine == "vllm":  # vLLM draws the agent's samples, started as rollout.backend vllm
            vcfg = cfg.model_copy(deep=True)
            vcfg.rollout.backend = "vllm"
            work = Path(run_dir if run_dir is not None else ".") / "vllm"
            engine = VLLMEngine(build_sampler(vcfg, model, tokenizer, work_dir=work, console=console),
                                max_concurrency=cfg.rollout.proxy.concurrency)
        return build_proxy_sampler(cfg, model, tokenizer, policy_version, run_dir=run_dir, engine=engine)
    if cfg.rollout.backend == "openai":
        if not cfg.rollout.base_url:
            raise ValueError("rollout.base_url: required for backend 'openai'")
        if cfg.rollout.server == "sglang":
            console("rollout.server 'sglang': untested (no SGLang build was run against it; docs/serving.md)")
        served = cfg.rollout.model_name or (cfg.model.path if cfg.model.path is not None else cfg.model.name)
        sampler = OpenAISampler(cfg.rollout.base_url, tokenizer, model_name=served,
                                temperature=s.sampler_temperature, top_k=s.top_k, top_p=s.top_p,
                                max_new_tokens=s.max_new_tokens, policy_version=policy_version,
                                server=cfg.rollout.server)
    elif cfg.rollout.backend == "vllm":
        v = cfg.rollout.vllm
        sampler = VLLMSampler(model, tokenizer, work_dir=Path(work_dir if work_dir is not None else "vllm"),
                              base_url=cfg.rollout.base_url, model_name=cfg.rollout.model_name or "policy",
                              python=v.python, startup_timeout_s=v.startup_timeout_s, max_model_len=v.max_model_len,
                              kv_cache_gb=v.kv_cache_gb, extra_args=v.extra_args, restarts=v.restarts,
                              console=console, temperature=s.sampler_temperature, top_k=s.top_k, top_p=s.top_p,
                              max_new_tokens=s.max_new_tokens, policy_version=policy_version)
    else:
        sampler = HFSampler(model, tokenizer, temperature=s.sampler_temperature, top_k=s.top_k, top_p=s.top_p,
                            max_new_tokens=s.max_new_tokens, policy_version=policy_version)
    sampler.template_mismatch = cfg.rollout.template_mismatch
    return sampler


def build_lagrange(cfg: Config) -> Optional[LagrangeMultiplier]:
    """The cost multiplier of a constrained run (§22), or None."""
    c = cfg.constraint
    return LagrangeMultiplier(init=c.init, lr=c.lr, budget=c.budget) if c.enabled else None
