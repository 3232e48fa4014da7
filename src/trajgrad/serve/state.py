"""The served model, its lock and policy version, the request batcher and prompt scoring."""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ..model.build import model_device
from ..model.learner import learner_logprobs
from ..rollout.chat import end_of_turn_id
from ..rollout.generation import sample_actions

__all__ = ["ServerState"]


@dataclass
class _Job:
    rows: List[List[int]]
    key: Tuple
    seed: Optional[int]
    future: Future = field(default_factory=Future)


class ServerState:
    """The served model, its lock and policy version, and the request batcher.

    ``lock`` serializes sampling, scoring and weight loading: a reload waits for the batch
    in flight and every later token is sampled with the new weights and reports the new
    ``policy_version``.
    """

    def __init__(self, model, tokenizer, *, model_name: str, policy_version: int, lock, seed: Optional[int],
                 batch_window_s: float, max_batch_rows: int, max_tokens_limit: int):
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.policy_version = int(policy_version)
        self.lock = lock
        self.reload_lock = threading.Lock()
        self.device = model_device(model)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(seed))
        eos = tokenizer.eos_token_id
        if eos is None:
            eos = end_of_turn_id(tokenizer)
        self.eos_id = int(eos)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.vocab_size = int(len(tokenizer))
        cfg_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if cfg_vocab is not None:
            self.vocab_size = min(self.vocab_size, int(cfg_vocab))
        self.max_model_len = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.batch_window_s = float(batch_window_s)
        self.max_batch_rows = int(max_batch_rows)
        self.max_tokens_limit = int(max_tokens_limit)
        self.created = int(time.time())
        self._queue: "deque[_Job]" = deque()
        self._cv = threading.Condition()
        self._worker: Optional[threading.Thread] = None
        self._stop = False
        self.engine = None  # a VLLMEngine (trajgrad.serve.vllm_engine): samples are drawn there instead

    # ------------------------------------------------------------------ batcher
    def submit(self, rows: List[List[int]], key: Tuple, seed: Optional[int]) -> Future:
        if self.engine is not None:  # drawn by the vLLM server, under the version it holds now
            with self.lock:
                version = self.policy_version
            return self.engine.submit(rows, key, seed, version, self.generator)
        job = _Job(rows=rows, key=key, seed=seed)
        with self._cv:
            if self._worker is None or not self._worker.is_alive():
                self._stop = False
                self._worker = threading.Thread(target=self._loop, name="trajgrad-serve-sampler", daemon=True)
                self._worker.start()
            self._queue.append(job)
            self._cv.notify()
        return job.future

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=10)

    def _take(self) -> Optional[List[_Job]]:
        with self._cv:
            while not self._queue and not self._stop:
                self._cv.wait()
            if self._stop:
                return None
            first = self._queue.popleft()
            batch = [first]
            if first.seed is not None:
                return batch
            rows = len(first.rows)
            deadline = time.monotonic() + self.batch_window_s
            while True:
                kept = deque()
                while self._queue:
                    job = self._queue.popleft()
                    if job.seed is None and job.key == first.key and rows + len(job.rows) <= self.max_batch_rows:
                        batch.append(job)
                        rows += len(job.rows)
                    else:
                        kept.append(job)
                self._queue.extendleft(reversed(kept))
                left = deadline - time.monotonic()
                if left <= 0 or rows >= self.max_batch_rows:
                    return batch
                self._cv.wait(timeout=left)

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            temperature, top_k, top_p, max_tokens, eos_ids = batch[0].key
            rows = [r for job in batch for r in job.rows]
            try:
                with self.lock:
                    if batch[0].seed is not None:
                        gen = torch.Generator(device=self.device)
                        gen.manual_seed(batch[0].seed)
                    else:
                        gen = self.generator
                    version = self.policy_version
                    self.model.eval()
                    out = sample_actions(
                        self.model, rows, eos_ids=list(eos_ids), pad_id=self.pad_id, temperature=temperature,
                        top_k=top_k, top_p=top_p, max_new_tokens=max_tokens, generator=gen, head_in_float32=True,
                    )
            except BaseException as exc:  # hand the failure to every waiting request
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            start = 0
            for job in batch:
                job.future.set_result((out[start:start + len(job.rows)], version))
                start += len(job.rows)

    # ------------------------------------------------------------------ scoring
    def score(self, rows: List[List[int]], *, temperature: float, top_k: Optional[int],
              top_p: Optional[float]) -> Tuple[List[List[Optional[float]]], int]:
        """Log-prob of every token of every row given its prefix (first token: None)."""
        L = max(len(r) for r in rows)
        ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        am = torch.zeros((len(rows), L), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            am[b, : len(r)] = 1
        ids, am = ids.to(self.device), am.to(self.device)
        if temperature <= 0:  # greedy: score under the raw distribution
            temperature, top_k, top_p = 1.0, None, None
        with self.lock:
            version = self.policy_version
            self.model.eval()
            with torch.no_grad():
                out = learner_logprobs(self.model, ids, am, am[:, 1:], temperature=temperature, top_k=top_k,
                                       top_p=top_p)
        logp = out.logp.float().cpu().tolist()
        res = []
        for b, r in enumerate(rows):
            vals: List[Optional[float]] = [None]
            for x in logp[b][: len(r) - 1]:
                vals.append(x if math.isfinite(x) else None)
            res.append(vals)
        return res, version
