r"""Rollouts from an OpenAI-compatible server: ``trajgrad serve``, vLLM or SGLang (§7, §16).

:class:`OpenAIBackend` is an action backend of the episode loop
(:class:`~trajgrad.rollout.episodes.EpisodeRunner`): each action is sampled by a server.
:class:`OpenAISampler` is that loop composed with this backend; it runs the same
multi-turn episodes as :class:`~trajgrad.rollout.sampler.HFSampler`. The trained sequence
is assembled token for token:

* the prompt ids are rendered once from the chat template
  (:func:`~trajgrad.rollout.chat.prompt_ids`) and sent as token ids;
* every request carries the episode's full token sequence so far, as ids (the server
  never re-tokenizes text);
* the action is the list of token ids the server returns, verbatim, and its behaviour
  log-probs are the per-token log-probs the server returns with them;
* observation ids (:func:`~trajgrad.rollout.chat.observation_ids`) are appended verbatim.

The recorded behaviour log-prob must be that of the distribution that actually sampled
(§7): :math:`\log\mu(x_j\mid x_{<j})` under temperature / top-k / top-p. Whether a server
returns that number depends on the server and its flags:

* ``server="trajgrad"`` (``trajgrad serve``): always (it records the number while
  sampling). One request per turn carries all active episodes (``prompt`` as a list of
  token-id lists), so a group is one batch.
* ``server="vllm"``: only when vLLM runs with ``--logprobs-mode processed_logprobs``
  (its default, ``raw_logprobs``, reports the un-tempered, un-truncated distribution).
  Token ids come back through ``return_tokens_as_token_ids``; one request per episode,
  concurrently.
* ``server="sglang"``: the native ``/generate`` endpoint with ``input_ids`` and
  ``return_logprob``. SGLang reports log-probs after temperature but before top-k / top-p
  filtering, so this backend refuses ``top_k`` / ``top_p < 1`` for SGLang.

See ``docs/serving.md`` for the server flags. Every request pins all sampling settings
explicitly (penalties neutral, ``min_p`` 0), so server-side generation defaults cannot
change the distribution.

Policy versions (§16): every turn records the version of the weights that sampled it:
the ``policy_version`` the trajgrad server reports with each choice; for vLLM the version
encoded in the adapter name :meth:`OpenAISampler.sync_weights` loaded; otherwise
:attr:`policy_version` (set by :meth:`sync_weights` / :meth:`set_policy_version`).

Greedy decoding (``temperature == 0``) records 0.0, as :class:`HFSampler` does.
"""
from __future__ import annotations

import contextlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .._optional import require
from .chat import end_of_turn_id
from .episodes import EpisodeRunner
from .generation import Action, SamplingSettings
from .weight_sync import sync_server_weights

__all__ = ["OpenAIBackend", "OpenAISampler", "SERVERS"]

SERVERS = ("trajgrad", "vllm", "sglang")
_TOKEN_ID_PREFIX = "token_id:"
# a served log-prob may exceed 0 by rounding; larger positive values are an error
_POSITIVE_SLACK = 1e-5


class OpenAIBackend:
    r"""Action backend whose actions come from an OpenAI-compatible server.

    Args:
      base_url: the server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is
        accepted and removed).
      tokenizer: the served model's tokenizer (ChatML; renders prompts and observations).
      model_name: the served model id sent as ``model`` (vLLM: the base model name until
        :meth:`sync_weights` loads an adapter).
      temperature, top_k, top_p, max_new_tokens: the sampling distribution and action
        length, as in :class:`~trajgrad.rollout.sampler.HFSampler` (``top_k=None`` /
        ``top_p=None``: off).
      server: ``"trajgrad"``, ``"vllm"`` or ``"sglang"`` (the request/response dialect).
      timeout: seconds per HTTP request.
      max_concurrency: most requests in flight at once (vLLM / SGLang: one per episode).
      max_batch_size: ``trajgrad`` only: most episodes per request (``None``: all).
      max_context_tokens: the context length; ``None``: ``/v1/models``' ``max_model_len``
        for trajgrad and vLLM servers, else unlimited.
      lora_name: vLLM adapter names are ``f"{lora_name}-v{version}"``.
      client: an ``httpx.Client`` to use (e.g. with a custom transport); default: a new one.

    Raises ValueError naming the argument for bad settings, and naming ``server`` when a
    response lacks token ids or log-probs.
    """

    reuse_kv = False  # the server keeps (or recomputes) its own cache
    device = torch.device("cpu")  # where the generator that derives request seeds lives

    def __init__(self, base_url: str, tokenizer, *, model_name: str, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, max_new_tokens: int = 64,
                 server: str = "trajgrad", timeout: float = 120.0, max_concurrency: int = 64,
                 max_batch_size: Optional[int] = None, max_context_tokens: Optional[int] = None,
                 lora_name: str = "trajgrad-policy", client=None):
        if server not in SERVERS:
            raise ValueError(f"server: expected one of {SERVERS}, got {server!r}")
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: expected an http(s) URL, got {base_url!r}")
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name: expected a non-empty string, got {model_name!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency: expected a positive integer, got {max_concurrency!r}")
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError(f"lora_name: expected a non-empty string, got {lora_name!r}")
        self.settings = SamplingSettings.create(temperature, top_k, top_p, max_new_tokens)
        if max_batch_size is not None and (isinstance(max_batch_size, bool) or int(max_batch_size) < 1):
            raise ValueError(f"max_batch_size: must be a positive integer or None, got {max_batch_size!r}")
        self.max_batch_size = None if max_batch_size is None else int(max_batch_size)
        s = self.settings
        if server == "sglang" and (s.top_k is not None or (s.top_p is not None and s.top_p < 1.0)):
            which = "top_k" if s.top_k is not None else "top_p"
            raise ValueError(
                f"{which}: SGLang reports log-probs before top-k/top-p filtering, so they would not be the "
                f"behaviour log-probs of the truncated distribution (§7); use temperature only with server='sglang'"
            )
        self.eos_id = end_of_turn_id(tokenizer)
        url = base_url.rstrip("/")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        self.base_url = url
        self.server = server
        self.model_name = model_name
        self.request_model = model_name  # vLLM: the adapter name after a sync
        self.lora_name = lora_name
        self.timeout = float(timeout)
        self.max_concurrency = max_concurrency
        self._context_limit = None if max_context_tokens is None else int(max_context_tokens)
        self._context_known = max_context_tokens is not None
        self.loaded_adapter: Optional[str] = None  # vLLM: the adapter the last sync loaded
        self.loaded_adapters: List[str] = []  # vLLM: the adapters still loaded, oldest first
        self.keep_adapters = 0  # vLLM: older adapters kept loaded after a sync (weight_sync.load_vllm_adapter)
        self.prefix_cache_kept = 0  # vLLM: LoRA syncs whose prefix-cache reset the server refused
        if client is None:
            httpx = require("httpx", "rollout.backend: openai")

            client = httpx.Client(timeout=self.timeout)
            self._own_client = True
        else:
            self._own_client = False
        self.client = client
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="trajgrad-openai")

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Release the HTTP client (if this object created it) and the worker threads."""
        self._pool.shutdown(wait=True)
        if self._own_client:
            self.client.close()

    # ------------------------------------------------------------------ backend protocol
    def context_limit(self) -> Optional[int]:
        """The context length given, else the server's ``max_model_len`` (asked once)."""
        self._ensure_context_limit()
        return self._context_limit

    def describe(self) -> Dict[str, Any]:
        """What a trajectory records about the backend in ``Trajectory.sampling``."""
        return {"model": self.request_model, "backend": "openai", "server": self.server, "base_url": self.base_url,
                "logprobs": _LOGPROB_SOURCE[self.server]}

    def eval_mode(self):
        """Nothing to switch: the server holds the model."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ HTTP
    def _url(self, path: str) -> str:
        return self.base_url + path

    def send(self, method: str, path: str, body: Optional[Dict[str, Any]] = None):
        """One HTTP request to the server; the ``httpx`` response (ConnectionError when unreachable)."""
        import httpx

        try:
            if method == "GET":
                return self.client.get(self._url(path), timeout=self.timeout)
            return self.client.post(self._url(path), json=body, timeout=self.timeout)
        except httpx.HTTPError as exc:
            where = f"the {self.server} server at {self._url(path)}"
            raise ConnectionError(f"server: cannot reach {where} ({exc})") from exc

    def post(self, path: str, body: Dict[str, Any]) -> Any:
        return self.json_of(self.send("POST", path, body), path)

    def get(self, path: str) -> Any:
        return self.json_of(self.send("GET", path), path)

    def json_of(self, resp, path: str) -> Any:
        """The JSON body of ``resp``; ValueError quoting the server's message for a status >= 400."""
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code >= 400:
            msg = None
            if isinstance(body, dict):
                err = body.get("error")
                if isinstance(err, dict):
                    msg = err.get("message")
                elif isinstance(err, str):
                    msg = err
                msg = msg or body.get("message") or body.get("detail")
            msg = msg or resp.text[:500]
            if self.server == "vllm" and resp.status_code >= 500:  # measured on vLLM 0.32's CPU build
                msg += (" (vLLM's CPU build dies on seeded requests whose prefill is chunked, 'CPU Generator does "
                        "not use offset' in its log: start it with --no-enable-chunked-prefill, docs/serving.md)")
            raise ValueError(f"server: the {self.server} server answered {resp.status_code} to {path}: {msg}")
        if body is None:
            raise ValueError(f"server: the {self.server} server sent a non-JSON answer to {path}: {resp.text[:200]!r}")
        return body

    def _ensure_context_limit(self) -> None:
        if self._context_known:
            return
        self._context_known = True
        if self.server == "sglang":
            return
        try:
            data = self.get("/v1/models").get("data") or []
        except (ValueError, ConnectionError, AttributeError):
            return
        for card in data:
            if isinstance(card, dict) and card.get("max_model_len"):
                self._context_limit = int(card["max_model_len"])
                return

    # ------------------------------------------------------------------ sampling
    def _seeds(self, n: int, generator, seeded: bool) -> List[Optional[int]]:
        if not seeded:
            return [None] * n
        return [int(x) for x in torch.randint(0, 2**62, (n,), generator=generator).tolist()]

    def generate(self, seqs: List[List[int]], generator: torch.Generator, *, seeded: bool = True,
                 past=None, keep_kv: bool = False) -> Tuple[List[Action], List[None]]:
        """One :class:`~trajgrad.rollout.generation.Action` per row, sampled by the server.

        With ``seeded``, every request carries a seed drawn from ``generator`` (per episode
        for vLLM; per request for trajgrad, whose requests hold a whole batch): same seed,
        same server weights, same batch: same actions. SGLang requests carry no seed.
        Nothing is cached here (``past`` / ``keep_kv`` are ignored).
        """
        if self.server == "trajgrad":
            step = self.max_batch_size or len(seqs)
            chunks = [seqs[i:i + step] for i in range(0, len(seqs), step)]
            seeds = self._seeds(len(chunks), generator, seeded)
            parts = list(self._pool.map(self._request_trajgrad, chunks, seeds))
            rows = [row for part in parts for row in part]
        else:
            seeds = self._seeds(len(seqs), generator, seeded)
            fn = self._request_vllm if self.server == "vllm" else self._request_sglang
            rows = list(self._pool.map(fn, seqs, seeds))
        return rows, [None] * len(rows)

    def _finish(self, ids: List[int], logps: List[float], what: str, settings: Optional[SamplingSettings] = None,
                stop_ids: Optional[List[int]] = None) -> Tuple[List[int], List[float], bool]:
        """Validate one served action; greedy records 0.0 (a deterministic policy)."""
        s = settings or self.settings
        if not ids:
            raise ValueError(f"server: the {self.server} server returned an empty completion ({what})")
        if len(ids) != len(logps):
            raise ValueError(
                f"server: the {self.server} server returned {len(ids)} token ids but {len(logps)} log-probs ({what})"
            )
        out = []
        for x in logps:
            if x is None or not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
                raise ValueError(
                    f"server: the {self.server} server returned the log-prob {x!r} for a sampled token ({what})"
                )
            x = float(x)
            if x > _POSITIVE_SLACK:
                raise ValueError(f"server: the {self.server} server returned a positive log-prob {x} ({what})")
            out.append(min(x, 0.0))
        if s.greedy:
            out = [0.0] * len(ids)
        if len(ids) > s.max_new_tokens:
            raise ValueError(
                f"server: the {self.server} server returned {len(ids)} tokens, more than max_new_tokens="
                f"{s.max_new_tokens} ({what})"
            )
        cut = ids[-1] not in (stop_ids or [self.eos_id])
        return list(ids), out, cut

    def _common(self, settings: Optional[SamplingSettings] = None) -> Dict[str, Any]:
        s = settings or self.settings
        return {
            "temperature": s.temperature,
            "top_p": 1.0 if s.top_p is None else s.top_p,
            "top_k": -1 if s.top_k is None else s.top_k,
        }

    def _request_trajgrad(self, seqs: List[List[int]], seed: Optional[int]):
        body = {
            "model": self.request_model, "prompt": [list(s) for s in seqs], "max_tokens": self.settings.max_new_tokens,
            "n": 1, "logprobs": 0, "stop_token_ids": [self.eos_id], "return_tokens_as_token_ids": True,
            **self._common(),
        }
        if seed is not None:
            body["seed"] = seed
        data = self.post("/v1/completions", body)
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or len(choices) != len(seqs):
            raise ValueError(f"server: expected {len(seqs)} choices from the trajgrad server, got {data!r:.300}")
        choices = sorted(choices, key=lambda c: c.get("index", 0))
        out = []
        for c in choices:
            ids = c.get("token_ids")
            lp = (c.get("logprobs") or {}).get("token_logprobs")
            if ids is None or lp is None:
                raise ValueError("server: the trajgrad server's choice lacks token_ids or logprobs.token_logprobs")
            version = c.get("policy_version", data.get("policy_version"))
            action, logp, cut = self._finish(list(ids), list(lp), f"choice {c.get('index')}")
            out.append(Action(action, logp, cut, int(version) if version is not None else None))
        return out

    def complete(self, seq: List[int], seed: Optional[int] = None, *, settings: Optional[SamplingSettings] = None,
                 stop_ids: Optional[List[int]] = None) -> Action:
        """One vLLM completion of the token ids ``seq`` under ``settings`` (default: the backend's),
        stopping at ``stop_ids`` (default: the end-of-turn id): the sampled ids and their log-probs."""
        if self.server != "vllm":
            raise ValueError(f"server: complete() forwards to a vllm server, this backend speaks {self.server!r}")
        return self._request_vllm(seq, seed, settings, stop_ids)

    def _request_vllm(self, seq: List[int], seed: Optional[int], settings: Optional[SamplingSettings] = None,
                      stop_ids: Optional[List[int]] = None):
        """One vLLM completion of ``seq`` (``settings`` / ``stop_ids``: the backend's own when None)."""
        s = settings or self.settings
        stops = list(stop_ids) if stop_ids else [self.eos_id]
        body = {
            "model": self.request_model, "prompt": list(seq), "max_tokens": s.max_new_tokens, "n": 1,
            "logprobs": 0, "return_tokens_as_token_ids": True, "stop_token_ids": stops,
            "skip_special_tokens": False, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "repetition_penalty": 1.0, **self._common(s),
        }
        if seed is not None:
            body["seed"] = seed
        data = self.post("/v1/completions", body)
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"server: the vllm server's answer has no choices: {data!r:.300}") from None
        lp = choice.get("logprobs")
        if not isinstance(lp, dict) or lp.get("tokens") is None or lp.get("token_logprobs") is None:
            raise ValueError(
                "server: the vllm server returned no logprobs (send logprobs=0; is this a vLLM server?)"
            )
        ids = []
        for tok in lp["tokens"]:
            if not isinstance(tok, str) or not tok.startswith(_TOKEN_ID_PREFIX):
                raise ValueError(
                    f"server: the vllm server returned the token {tok!r} instead of 'token_id:<id>'; it must honour "
                    f"return_tokens_as_token_ids (vLLM >= 0.5, or start it with --return-tokens-as-token-ids)"
                )
            ids.append(int(tok[len(_TOKEN_ID_PREFIX):]))
        plain = choice.get("token_ids")
        if plain is not None and list(plain) != ids:
            raise ValueError("server: the vllm server's token_ids disagree with its logprobs.tokens")
        action, logp, cut = self._finish(ids, list(lp["token_logprobs"]), "vllm choice", s, stops)
        return Action(action, logp, cut)

    def _request_sglang(self, seq: List[int], seed: Optional[int]):
        sp = {
            "max_new_tokens": self.settings.max_new_tokens, "stop_token_ids": [self.eos_id], "min_p": 0.0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0, "skip_special_tokens": False, "no_stop_trim": True,
            **self._common(),
        }
        body = {"input_ids": list(seq), "sampling_params": sp, "return_logprob": True, "logprob_start_len": -1}
        data = self.post("/generate", body)
        if isinstance(data, list):
            data = data[0] if data else {}
        meta = data.get("meta_info") if isinstance(data, dict) else None
        items = (meta or {}).get("output_token_logprobs")
        if not isinstance(items, list):
            raise ValueError(
                "server: the sglang server returned no meta_info.output_token_logprobs (send return_logprob)"
            )
        ids, lps = [], []
        for it in items:
            if not isinstance(it, (list, tuple)) or len(it) < 2:
                raise ValueError(f"server: unexpected sglang output_token_logprobs entry {it!r}")
            lps.append(it[0])
            ids.append(int(it[1]))
        plain = data.get("output_ids")
        if plain is not None and list(plain)[-len(ids):] != ids:
            raise ValueError("server: the sglang server's output_ids disagree with its output_token_logprobs")
        version = None
        wv = (meta or {}).get("weight_version")
        if wv is not None:
            try:
                version = int(wv)
            except (TypeError, ValueError):
                pass
        action, logp, cut = self._finish(ids, lps, "sglang output")
        return Action(action, logp, cut, version)

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model, version: int, save_dir: Union[str, os.PathLike]) -> Path:
        """Save ``model``'s trainable weights and load them into the server
        (:func:`~trajgrad.rollout.weight_sync.sync_server_weights`). Returns the directory
        written; the caller records ``version`` (:meth:`OpenAISampler.sync_weights` does)."""
        return sync_server_weights(self, model, version, save_dir)

    def post_text(self, path: str, body: Dict[str, Any]) -> Any:
        """POST to an endpoint that may answer plain text on success (vLLM's LoRA routes)."""
        resp = self.send("POST", path, body)
        if resp.status_code >= 400:
            return self.json_of(resp, path)
        return resp.text



class OpenAISampler(EpisodeRunner):
    r"""Multi-turn sampler whose actions come from an OpenAI-compatible server.

    ``OpenAISampler(base_url, tokenizer, model_name=..., ...)`` is
    ``EpisodeRunner(OpenAIBackend(base_url, tokenizer, model_name=..., ...), tokenizer, ...)``
    with :meth:`sync_weights`.

    Args:
      base_url, tokenizer, model_name, temperature, top_k, top_p, max_new_tokens, server,
        timeout, max_concurrency, max_batch_size, max_context_tokens, lora_name, client:
        as in :class:`OpenAIBackend`.
      policy_version: the version recorded until the server reports another (§16).
      progress: progress bar over episodes.
    """

    def __init__(self, base_url: str, tokenizer, *, model_name: str, policy_version: int = 0,
                 progress: bool = False, **backend_options):
        backend = OpenAIBackend(base_url, tokenizer, model_name=model_name, **backend_options)
        super().__init__(backend, tokenizer, policy_version=policy_version, progress=progress)

    # the backend's connection, for callers that read them
    @property
    def server(self) -> str:
        return self.backend.server

    @property
    def base_url(self) -> str:
        return self.backend.base_url

    @property
    def request_model(self) -> str:
        return self.backend.request_model

    def close(self) -> None:
        """Release the HTTP client (if the backend created it) and the worker threads."""
        self.backend.close()

    def __enter__(self) -> "OpenAISampler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sync_weights(self, model, version: int, save_dir: Union[str, os.PathLike]) -> Path:
        """:meth:`OpenAIBackend.sync_weights`, then record ``version`` on the turns sampled
        afterwards. Returns the directory written."""
        out = self.backend.sync_weights(model, version, save_dir)
        self.set_policy_version(version)
        return out


_LOGPROB_SOURCE = {
    "trajgrad": "recorded while sampling (processed distribution)",
    "vllm": "vLLM logprobs (exact only with --logprobs-mode processed_logprobs)",
    "sglang": "SGLang return_logprob (after temperature; no top-k/top-p)",
}
