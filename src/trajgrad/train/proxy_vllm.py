"""``rollout.backend: proxy`` with ``rollout.proxy.engine: vllm``: the agent's calls sampled by vLLM.

:func:`build_vllm_engine` starts (or, with ``rollout.base_url``, attaches to) the vLLM server the
way ``rollout.backend: vllm`` does (:func:`~trajgrad.train.setup.build_sampler`, the
``rollout.vllm`` settings) and wraps it in a :class:`~trajgrad.serve.vllm_engine.VLLMEngine`,
which the recording proxy draws its samples from (:mod:`trajgrad.serve.vllm_engine`).
"""
from __future__ import annotations

from pathlib import Path

from ..serve.vllm_engine import VLLMEngine
from .setup import build_sampler

__all__ = ["build_vllm_engine"]


def build_vllm_engine(cfg, model, tokenizer, run_dir=None, console=print) -> VLLMEngine:
    """The vLLM engine of a proxy run; the server's files go to ``run_dir/vllm``."""
    vcfg = cfg.model_copy(deep=True)
    vcfg.rollout.backend = "vllm"
    work = Path(run_dir if run_dir is not None else ".") / "vllm"
    sampler = build_sampler(vcfg, model, tokenizer, work_dir=work, console=console)
    return VLLMEngine(sampler, max_concurrency=cfg.rollout.proxy.concurrency)
