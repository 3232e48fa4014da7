r"""Ray rollout workers that sample from the run's one vLLM server (``rollout.backend: vllm``; §16, §20).

**One server for all workers.** Every worker of a Ray run (SAO's
:class:`~trajgrad.train.sao.AsyncTrainer`, the grouped baseline
:class:`~trajgrad.train.grouped.GroupedRayTrainer`) sends its requests to the learner's vLLM
server: the one its :class:`~trajgrad.rollout.vllm_sampler.VLLMSampler` started, or the one at
``rollout.base_url``. One engine batches the concurrent requests of all workers (vLLM's
continuous batching); a server per worker would hold the model and a KV cache once per worker,
pay the start-up once per worker, and split those batches. The workers hold no model: only the
tokenizer and an HTTP client (:func:`worker_sampler`).

**Weights.** After every update the learner's sampler syncs the server
(:meth:`VLLMSampler.sync_weights`: a LoRA adapter loaded under the versioned name
``<lora_name>-v<version>``, or the full weights reloaded in place), then the learner publishes,
instead of tensors, the name its requests now use (:func:`served_state`). Before every turn a
worker takes the newest published name from the weight store and names it in its requests
(:func:`apply_served_state`); the turn records that version (§16). A request names the adapter
that samples it, so an update during an episode never changes the weights under a running turn.
The learner keeps the :data:`KEEP_ADAPTERS` previous adapters (and their files) loaded, so a turn
begun under an older name still finds it.

SAO with full fine-tuning on vLLM is refused at load time (``model.lora``): a full-weight
reload changes the weights in place under the requests of episodes in flight, whose turns
would record a version that did not sample them all. The grouped baseline syncs behind its
group barrier, with no request in flight, so it runs either way.
"""
from __future__ import annotations

import copy
from typing import Any, Dict

from ..rollout.openai_backend import OpenAISampler
from .config import Config
from .setup import build_sampler

__all__ = ["KEEP_ADAPTERS", "share_server", "served_state", "worker_sampler", "apply_served_state"]

KEEP_ADAPTERS = 2


def share_server(sampler: OpenAISampler, cfg_data: Dict[str, Any]) -> Dict[str, Any]:
    """The workers' config: ``cfg_data`` attached to ``sampler``'s server (``rollout.base_url``,
    ``rollout.model_name``). ``sampler`` keeps :data:`KEEP_ADAPTERS` older adapters loaded from now on."""
    sampler.backend.keep_adapters = max(sampler.backend.keep_adapters, KEEP_ADAPTERS)
    out = copy.deepcopy(cfg_data)
    out["rollout"]["base_url"] = sampler.base_url
    out["rollout"]["model_name"] = sampler.backend.model_name
    return out


def served_state(sampler: OpenAISampler) -> Dict[str, str]:
    """What the learner publishes to the workers after a sync: the model name requests use."""
    return {"served_model": sampler.request_model}


def worker_sampler(cfg: Config, tokenizer) -> OpenAISampler:
    """A worker's sampler: the episode loop on the shared server (``cfg`` from :func:`share_server`)."""
    if not cfg.rollout.base_url:
        raise ValueError("rollout.base_url: a Ray worker on rollout.backend 'vllm' needs the learner's server "
                         "(trajgrad.train.ray_vllm.share_server sets it)")
    return build_sampler(cfg, None, tokenizer, console=lambda *_: None)


def apply_served_state(sampler: OpenAISampler, state: Dict[str, str]) -> None:
    """Name the published model (:func:`served_state`) in the worker's later requests."""
    name = state.get("served_model") if isinstance(state, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"state: expected {{'served_model': name}} from the learner, got {state!r:.200}")
    sampler.backend.request_model = name
