r"""``trajgrad serve``: an OpenAI-compatible sampling server that reports exact log-probs.

Every completion token is drawn by :func:`trajgrad.rollout.generation.sample_actions`, the
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
* ``POST /v1/chat/completions`` (:mod:`~trajgrad.serve.chat`): ``messages`` rendered with
  the tokenizer's chat template, ``tools`` (OpenAI function schemas, passed to the
  template), ``tool_choice`` (``auto`` / ``none``), ``temperature``, ``top_p``, ``top_k``
  (extension), ``max_tokens`` / ``max_completion_tokens``, ``seed``, ``logprobs`` /
  ``top_logprobs``, ``n``, ``stream`` (server-sent events, ``data: [DONE]`` last). Replies
  in Hermes ``<tool_call>`` form or bare JSON become ``message.tool_calls``
  (``finish_reason: "tool_calls"``). Sampled by the same batcher and transform as
  ``/v1/completions``; ``logprobs.content`` lists every sampled token, the end of turn
  included.
* ``POST /v1/messages`` (:mod:`~trajgrad.serve.messages`, the Anthropic Messages API) and
  ``POST /v1/responses`` (:mod:`~trajgrad.serve.responses`, the OpenAI Responses API,
  stateless): translated into the chat conversation and answered (sampled, recorded) by the
  same code as ``/v1/chat/completions``; streamed as each API's event sequence
  (:mod:`~trajgrad.serve.messages_stream`, :mod:`~trajgrad.serve.responses_stream`);
  ``/v1/messages`` errors in Anthropic's shape.
* Sessions (:mod:`~trajgrad.serve.sessions`): the ``X-Trajgrad-Session`` header, the
  ``/s/{session}/v1/...`` base URL or the ``user`` field groups the calls of one
  episode; each call must extend the previous call's prompt + sampled tokens (token in /
  token out), else the divergence is counted and the episode marked.
  ``POST /v1/trajgrad/episodes/{id}/reward`` ``{"reward", "success"?, "info"?}`` ends it
  (:func:`trajgrad.serve.client.report_reward`); ``GET /v1/trajgrad/episodes/{id}`` returns
  its :class:`~trajgrad.rollout.trajectory.Trajectory`; ``GET /v1/trajgrad/stats`` the counts.
* ``GET /v1/models``, ``GET /health``.
* ``POST /reload`` ``{"path": ..., "version": N}``: load new weights into the served
  model in place, under the sampling lock; tokens sampled afterwards report version N.
  Accepted formats (see :func:`~trajgrad.serve.reload.load_weights`): a peft adapter
  directory (``PeftModel.save_pretrained``: ``adapter_config.json`` +
  ``adapter_model.safetensors``), a trajgrad checkpoint run or step directory (module
  ``policy``), a ``.safetensors`` file of named tensors (e.g. the trainable parameters),
  or a Hugging Face ``save_pretrained`` directory (``model.safetensors``, sharded or not).
  A file that cannot be read or does not fit the served model is answered with 400
  naming ``path``, and nothing changes.

Batching: the ``n`` choices of every prompt of a request are one
:func:`~trajgrad.rollout.generation.sample_actions` call; unseeded concurrent requests with
the same sampling settings are merged into one call as well. A request with a ``seed`` is
sampled on its own with a generator seeded by it (same seed, same weights, same request:
same tokens).

Request fields that would change the distribution without being reflected in the log-probs
(penalties, ``logit_bias``, ``min_p``, stop strings, streaming) are rejected with 400
unless they hold their neutral value; so are unknown fields.

Security: the server has **no authentication**; ``/reload`` reads any path the server
process can read. It binds to 127.0.0.1 by default; expose it only on a trusted network.

Modules: :mod:`~trajgrad.serve.app` (the FastAPI app, ``main``), :mod:`~trajgrad.serve.requests`
(request fields and the sampling plan), :mod:`~trajgrad.serve.completions` (choices,
log-probs), :mod:`~trajgrad.serve.chat_requests` / :mod:`~trajgrad.serve.chat` (chat
completions), :mod:`~trajgrad.serve.messages` / :mod:`~trajgrad.serve.responses` (and their
``_stream`` modules), :mod:`~trajgrad.serve.sessions` (episode recording), :mod:`~trajgrad.serve.client`
(reward helper), :mod:`~trajgrad.serve.loopback` (in-process server),
:mod:`~trajgrad.serve.state` (model, lock, batcher, scoring),
:mod:`~trajgrad.serve.reload` (``/reload``), :mod:`~trajgrad.serve.errors`. It builds on
:mod:`trajgrad.model`, :mod:`trajgrad.weights` and the public API of :mod:`trajgrad.rollout`,
never on :mod:`trajgrad.train`.
"""
from .app import create_app, main
from .errors import RequestError
from .reload import load_weights
from .chat_requests import ChatRequest
from .client import report_reward
from .loopback import LoopbackServer
from .requests import CompletionRequest, ReloadRequest
from .sessions import Sessions
from .state import ServerState

__all__ = ["ChatRequest", "CompletionRequest", "LoopbackServer", "ReloadRequest", "RequestError", "ServerState",
           "Sessions", "create_app", "load_weights", "main", "report_reward"]
