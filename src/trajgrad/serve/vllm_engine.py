r"""The recording proxy's samples drawn by a vLLM server (``rollout.proxy.engine: vllm``; §7, §16).

The proxy (:class:`~trajgrad.train.proxy.ProxySampler`) renders and records every chat call as
before (:mod:`trajgrad.serve.chat`, :mod:`trajgrad.serve.sessions`); only the draw of the reply
moves: :meth:`ServerState.submit <trajgrad.serve.state.ServerState.submit>` hands the rendered
token ids to :class:`VLLMEngine`, which sends each row to vLLM's ``/v1/completions`` as token ids
(:meth:`~trajgrad.rollout.openai_backend.OpenAIBackend.complete`) and returns the sampled ids with
vLLM's processed log-probs :math:`\log\mu(x_j\mid x_{<j})` (the server runs with
``--logprobs-mode processed_logprobs``). The session records those ids and log-probs, so the
trained sequence is token for token what vLLM sampled.

Every row carries a seed: the call's ``seed`` when it gives one (rows ``n`` seeds drawn from
it), else a draw from the proxy's generator (seeded per rollout). Weights: after every update the
trainer sets the proxy's new policy version; the proxy then syncs the live model into the server
(:meth:`VLLMEngine.sync`: a LoRA adapter under a versioned name, or the full weights in place)
before any later call is sampled, and every turn records that version. Syncs happen between
rollouts, when no call is in flight. Top log-probs (``top_logprobs > 0``) are scored by the
proxy's own model (the learner's live weights, the ones the server holds after the sync).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ..rollout.generation import SamplingSettings

__all__ = ["VLLMEngine"]


class VLLMEngine:
    """Draw a trajgrad server's samples on a vLLM server.

    Args:
      sampler: a :class:`~trajgrad.rollout.vllm_sampler.VLLMSampler` (it owns or attaches to the
        server, and syncs weights into it).
      sync_dir: where synced weights are written (default ``sampler.work_dir / "weights-sync"``).
      max_concurrency: calls in flight at once (each row of a call is one request).
    """

    def __init__(self, sampler, *, sync_dir: Optional[Path] = None, max_concurrency: int = 16):
        if getattr(sampler, "server", None) != "vllm":
            raise ValueError(f"sampler: expected a VLLMSampler, got {type(sampler).__name__}")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency: expected a positive integer, got {max_concurrency!r}")
        self.sampler = sampler
        self.sync_dir = Path(sync_dir) if sync_dir is not None else Path(sampler.work_dir) / "weights-sync"
        self._calls = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="trajgrad-vllm-call")
        self._rows = ThreadPoolExecutor(max_workers=4 * max_concurrency, thread_name_prefix="trajgrad-vllm-row")

    @property
    def url(self) -> str:
        return self.sampler.base_url

    def submit(self, rows: List[List[int]], key: Tuple, seed: Optional[int], version: int,
               generator: torch.Generator) -> Future:
        """Sample every row on vLLM; a future of ``([(action_ids, logp, cut), ...], version)``.

        ``key`` is the proxy batcher's ``(temperature, top_k, top_p, max_tokens, eos_ids)``."""
        temperature, top_k, top_p, max_tokens, eos_ids = key
        settings = SamplingSettings.create(temperature, top_k, top_p, max_tokens)
        if seed is not None:
            generator = torch.Generator().manual_seed(int(seed))
        seeds = [int(x) for x in torch.randint(0, 2**62, (len(rows),), generator=generator).tolist()]
        backend = self.sampler.backend

        def one(row_seed):
            row, s = row_seed
            a = backend.complete(row, s, settings=settings, stop_ids=list(eos_ids))
            return a.ids, a.logp, a.cut

        def call():
            return list(self._rows.map(one, zip(rows, seeds))), int(version)
        return self._calls.submit(call)

    def step_stats(self):
        """The sampler's counts since the last call (``sync/seconds``, ``sync/prefix_cache_kept``)."""
        return {k: v for k, v in self.sampler.step_stats().items() if k.startswith("sync/")}

    def sync(self, model, version: int) -> Path:
        """Load ``model``'s weights into the server (:meth:`VLLMSampler.sync_weights`)."""
        return self.sampler.sync_weights(model, version, self.sync_dir)

    def close(self) -> None:
        """Stop the threads, then the sampler (an owned server stops with it)."""
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._rows.shutdown(wait=False, cancel_futures=True)
        self.sampler.close()
