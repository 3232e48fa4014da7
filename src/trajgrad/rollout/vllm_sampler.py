r"""Rollouts from a vLLM server that trajgrad runs (``rollout.backend: vllm``; §7, §16).

:class:`VLLMSampler` is :class:`~trajgrad.rollout.openai_backend.OpenAISampler` with
``server="vllm"`` plus the server's life cycle (:class:`~trajgrad.rollout.vllm_server.VLLMServer`):

* the policy is written where vLLM reads it: the model (for a LoRA policy: its base model,
  adapters removed) and tokenizer with ``save_pretrained`` (safetensors) into
  ``work_dir/model``; the server is started on it with the flags exact ratios need;
* with ``base_url`` it attaches to a running vLLM server instead (nothing started or stopped);
* token in / token out: every request is ``/v1/completions`` with the episode's token ids
  as ``prompt``; the action is the returned ids (``token_id:<id>``) with their processed
  log-probs; observations are appended by the episode loop;
* weights after every update (:func:`~trajgrad.rollout.weight_sync.sync_server_weights`): a
  LoRA adapter loaded at run time under a versioned name, or the full model reloaded in place
  (``/collective_rpc`` ``reload_weights``); the prefix cache is reset; the seconds are
  reported as ``sync/seconds`` in the next step's metrics;
* a server that dies during a rollout: the episodes of that call are counted
  (``rollout/lost_episodes``) and never returned, the server is restarted from the last
  synced weights (at most ``restarts`` times) and the call runs again; one death more ends
  the run with a RuntimeError quoting the server's last log lines.

Seeds (measured on the CPU build, vLLM 0.32): a per-request ``seed`` crashes the CPU engine
(``RuntimeError: CPU Generator does not use offset``) whenever a seeded request's prefill is
split over several engine steps (chunked prefill); the owned server therefore runs with
``--no-enable-chunked-prefill`` (and ``--max-num-batched-tokens`` of at least the context
length), under which every request carries a seed: the same seed, weights and prompt give the
same tokens.
"""
from __future__ import annotations

import copy
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from ..weights import is_peft, unwrap
from .generation import SamplingSettings
from .openai_backend import OpenAISampler
from .vllm_server import VLLMServer
from .weight_sync import load_vllm_adapter

__all__ = ["VLLMSampler", "save_for_vllm", "ServerDied"]


class ServerDied(RuntimeError):
    """The vLLM server stopped while a rollout was in flight."""


def save_for_vllm(model: torch.nn.Module, tokenizer, out: Union[str, os.PathLike]) -> Path:
    """Write ``model`` (a LoRA model: its base, adapters removed) and ``tokenizer`` with
    ``save_pretrained`` (safetensors) to ``out``; returns ``out``."""
    out = Path(os.fspath(out)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = unwrap(model)
    if is_peft(model):
        base = copy.deepcopy(model).unload()  # the base weights, LoRA layers dropped (not merged)
        base.save_pretrained(str(out), safe_serialization=True)
        del base
    else:
        model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def _dtype_name(model: torch.nn.Module) -> str:
    dt = next(unwrap(model).parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dt, "float32")


def _lora_rank(model: torch.nn.Module) -> Optional[int]:
    model = unwrap(model)
    if not is_peft(model):
        return None
    cfg = next(iter(model.peft_config.values()))
    return int(cfg.r)


class VLLMSampler(OpenAISampler):
    """Multi-turn sampler on a vLLM server that it starts and stops (or attaches to).

    Args:
      model: the policy (its weights and dtype are served; a LoRA policy serves its base with
        ``--enable-lora --max-lora-rank r``).
      tokenizer: the policy's Hugging Face tokenizer.
      work_dir: where the served checkpoint, synced weights and the server log go.
      base_url: attach to this running vLLM server instead of starting one.
      model_name: the served model name (``--served-model-name``).
      python, startup_timeout_s, max_model_len, extra_args: :class:`VLLMServer`.
      kv_cache_gb: ``VLLM_CPU_KVCACHE_SPACE`` of the CPU build.
      restarts: how many deaths of an owned server are survived (restart from the last sync).
      console: progress lines.
      **options: :class:`OpenAISampler`'s sampling options (temperature, top_k, ...).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, *, work_dir: Union[str, os.PathLike],
                 base_url: Optional[str] = None, model_name: str = "policy", python: Optional[str] = None,
                 startup_timeout_s: float = 600.0, max_model_len: Optional[int] = None,
                 kv_cache_gb: float = 1.0, extra_args: Sequence[str] = (), restarts: int = 1,
                 console: Callable[..., None] = print, **options: Any):
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ValueError(f"rollout.vllm.restarts: expected a non-negative integer, got {restarts!r}")
        self.work_dir = Path(os.fspath(work_dir)).resolve()
        self.console = console
        self.restarts_left = restarts
        self.lost_episodes = 0
        self.server_restarts = 0
        self.last_sync_seconds: Optional[float] = None
        self.last_synced: Optional[Path] = None
        self._synced_dirs: List[Path] = []
        self._kept_reported = 0
        self.owned: Optional[VLLMServer] = None
        self._policy = model  # synced when a version arrives without its weights (set_policy_version)
        if base_url is None:
            served = save_for_vllm(model, tokenizer, self.work_dir / "model")
            args = list(extra_args)
            if "--enable-chunked-prefill" not in args and "--no-enable-chunked-prefill" not in args:
                args.append("--no-enable-chunked-prefill")
                if "--max-num-batched-tokens" not in args:
                    args += ["--max-num-batched-tokens", str(max(8192, int(max_model_len or 0)))]
            self.owned = VLLMServer(served, python=python, served_name=model_name, dtype=_dtype_name(model),
                                    lora_rank=_lora_rank(model), max_model_len=max_model_len, extra_args=args,
                                    env={"VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gb:g}"},
                                    startup_timeout_s=startup_timeout_s, log_path=self.work_dir / "vllm-server.log",
                                    console=console)
            self.owned.start()
            base_url = self.owned.url
        # adapter names unique to this sampler: a shared or reused server may hold another run's versions
        options.setdefault("lora_name", f"{model_name}-{uuid.uuid4().hex[:8]}")
        self._served_version = options.get("policy_version", 0)  # the version the server's weights are
        super().__init__(base_url, tokenizer, model_name=model_name, server="vllm", **options)

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        """Stop an owned server and release the HTTP client."""
        try:
            super().close()
        finally:
            if self.owned is not None:
                self.owned.stop()

    def _server_dead(self) -> bool:
        """True when the server is gone (an owned process that exited, or no answer on /health)."""
        import httpx

        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:  # an engine that failed takes a moment to exit
            if self.owned is not None and not self.owned.alive():
                return True
            try:
                if httpx.get(self.base_url + "/health", timeout=5.0).status_code != 200:
                    return True
            except httpx.HTTPError:
                return True
            time.sleep(1.0)
        return False

    def _restart(self) -> None:
        """Start the owned server again and load the last synced weights."""
        last = self.last_synced
        full = last is not None and not (last / "adapter_config.json").exists()
        self.owned.restart(last if full else None)
        self.backend.base_url = self.owned.url
        self.backend.request_model = self.backend.model_name
        self.backend.loaded_adapter = None
        self.backend.loaded_adapters = []
        if last is not None and not full:
            load_vllm_adapter(self.backend, last, self.policy_version)

    # ------------------------------------------------------------------ sampling
    def _survive(self, exc: BaseException, lost: int, what: str) -> None:
        """After a server death during ``what``: restart it, or raise :class:`ServerDied`."""
        self.lost_episodes += lost
        where = self.owned.log_path if self.owned is not None else self.base_url
        tail = f"; last lines of its log:\n{self.owned.tail()}" if self.owned is not None else ""
        if self.owned is None or self.restarts_left <= 0:
            raise ServerDied(f"vllm: the server ({where}) died during {what}; {lost} episodes in flight were dropped "
                             f"and nothing of them is trained ({exc}){tail}") from exc
        self.restarts_left -= 1
        self.server_restarts += 1
        self.console(f"vllm: the server died during {what} ({lost} episodes dropped, never trained); restarting it "
                     f"from the last synced weights{tail}")
        self._restart()

    def rollout(self, source, tasks, *args, **kwargs):
        """:meth:`EpisodeRunner.rollout`; a server death is survived ``restarts`` times (module doc)."""
        while True:
            try:
                return super().rollout(source, tasks, *args, **kwargs)
            except (ConnectionError, ValueError) as exc:
                if not self._server_dead():
                    raise
                group = kwargs.get("group_size", args[0] if args else 1) or 1
                self._survive(exc, len(tasks) * int(group), "a rollout")

    def evaluate_on(self, source, tasks, *, temperature: float, seed: int):
        """Held-out episodes (one per task) sampled by the server with the current weights at
        ``temperature`` (no top-k / top-p); the training sampling settings are restored after."""
        kept = self.backend.settings
        self.backend.settings = SamplingSettings.create(temperature, None, None, kept.max_new_tokens)
        try:
            return self.rollout(source, tasks, group_size=1, seed=seed)
        finally:
            self.backend.settings = kept

    def step_stats(self) -> Dict[str, float]:
        """Counts since the last call: ``rollout/lost_episodes``, ``rollout/server_restarts``,
        ``sync/prefix_cache_kept`` (LoRA syncs whose prefix-cache reset the server refused) and the
        last sync's ``sync/seconds``."""
        out = {"rollout/lost_episodes": float(self.lost_episodes),
               "rollout/server_restarts": float(self.server_restarts)}
        if self.last_sync_seconds is not None:
            out["sync/seconds"] = self.last_sync_seconds
        out["sync/prefix_cache_kept"] = float(self.backend.prefix_cache_kept - self._kept_reported)
        self._kept_reported = self.backend.prefix_cache_kept
        self.lost_episodes = self.server_restarts = 0
        self.last_sync_seconds = None
        return out

    # ------------------------------------------------------------------ weights
    def set_policy_version(self, version: int) -> None:
        """Record ``version`` on the turns sampled from now on. A version the server was not synced to
        (a resumed run's, whose weights were loaded from a checkpoint) syncs the policy given at
        construction first, so that the server samples the weights the version names."""
        if self._policy is not None and version != self._served_version:
            self.sync_weights(self._policy, version, self.work_dir / "weights-sync")
            return
        super().set_policy_version(version)

    def sync_weights(self, model, version: int, save_dir: Union[str, os.PathLike]) -> Path:
        """Load ``model``'s weights into the server in place (LoRA adapter or full reload), reset its
        prefix cache, record ``version``; the previous synced directory is removed."""
        previous, self._served_version = self._served_version, version
        try:
            return self._sync_weights(model, version, save_dir)
        except BaseException:
            self._served_version = previous
            raise

    def _sync_weights(self, model, version: int, save_dir: Union[str, os.PathLike]) -> Path:
        t0 = time.perf_counter()
        try:
            out = super().sync_weights(model, version, save_dir)
        except (ConnectionError, ValueError) as exc:
            if not self._server_dead():
                raise
            self._survive(exc, 0, "a weight sync")
            out = super().sync_weights(model, version, save_dir)
        self.last_sync_seconds = time.perf_counter() - t0
        self.last_synced = out
        # the directories of the adapters still loaded stay (vLLM reads an adapter's files again
        # when it evicted it from its cache); older ones are removed
        self._synced_dirs = [d for d in self._synced_dirs if d != out] + [out]
        keep = 1 + (self.backend.keep_adapters if (out / "adapter_config.json").exists() else 0)
        for old in self._synced_dirs[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        self._synced_dirs = self._synced_dirs[-keep:]
        return out
