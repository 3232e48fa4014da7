r"""In-process multi-turn sampler that records exact behaviour log-probabilities (§4, §7, §16, §19).

:class:`HFSampler` runs many episodes at once with a Hugging Face causal LM. At every
turn the current token sequences of the active episodes are left padded and decoded with
an explicit KV-cached loop. Each token is drawn from the *sampling distribution*

.. math::

   \mu(v\mid h) = \operatorname{softmax}\big(\texttt{sampling\_logits}(z; T, k, p)\big)_v,

(temperature :math:`T`, then top-k, then top-p, exactly as ``generate()`` warps; see
:func:`trajgrad.logprobs.sampling_logits`), and its behaviour log-prob
:math:`\log\mu(x_j\mid x_{<j})` is recorded with the same operations as
:func:`trajgrad.logprobs.token_logprobs`. The denominator of every importance ratio (§7)
is therefore the probability of the distribution that actually sampled, and a learner
that recomputes the log-probs with unchanged weights gets a ratio of exactly one (§24).

Positions: a token's position id is its index among the non-padding tokens of its row
(:func:`~trajgrad.rollout.collate.position_ids_from_attention_mask`), in the left-padded
sampler and in the right-padded learner alike, so both evaluate the same function.

Each action ends at ``<|im_end|>`` (kept as its last token) or is cut at
``max_new_tokens`` (``Turn.cut``; the observation then starts with the ``<|im_end|>``
that closes the message, a token the policy did not sample). The action text (without
the end-of-turn token) goes to ``env.step``; the returned messages are appended as
observation tokens (:func:`~trajgrad.rollout.chat.observation_ids`), never re-tokenized
together with the action.

Decoding: the context of a turn runs through the model's own forward; the tokens after it
run through :func:`~trajgrad.rollout.decode.decode_step` for Llama models (preallocated
key/value buffers, the same function up to float rounding; ``fast_decode=False`` turns it
off). Rows that have ended stay in the batch, ignored, until a quarter of it has ended.
Episodes on their last allowed turn keep no keys/values.

KV reuse: the keys and values an episode's context produced are kept between its turns,
so a turn only runs the model on the tokens added since (the last action token and the
observation); at the first turn, a prompt prefix that several episodes share (a group's
prompt, a common system prompt) is computed once. Cached states belong to the weights that produced them: they are dropped
when the policy version changes (:meth:`HFSampler.set_policy_version`) and can be dropped
by hand with :meth:`HFSampler.clear_cache` after loading weights in place under the same
version. The values are the same function of the same tokens as a full recompute (float
rounding aside; the §24 ratio check holds within 1e-5 in float32).

Partial rollouts (§16): every turn records ``policy_version``, the value of
:attr:`HFSampler.policy_version` when it was sampled; :meth:`set_policy_version` changes
it between turns (e.g. after a weight sync).

Compaction (§19): when ``info["compact"]`` holds a summary, the current sub-trace is
closed after that action, and the episode continues in sub-trace ``segment + 1`` whose
prompt is the first system message of the episode, a user message carrying the summary,
then the messages the step returned (same ``episode_id``).

Greedy decoding (``temperature == 0``): the argmax token is taken; the policy is then
deterministic and the recorded behaviour log-prob is 0.0 (probability one). Such
trajectories are for evaluation; an importance ratio against them is not defined by
:func:`~trajgrad.logprobs.token_logprobs` (which requires ``temperature > 0``).
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .chat import decode_action, end_of_turn_id, observation_ids, prompt_ids
from .collate import position_ids_from_attention_mask, prefix_groups
from .decode import KVBuffers, decode_step, fast_backbone
from .models import cache_kwarg, output_cache
from .trajectory import Trajectory, Turn

__all__ = ["HFSampler", "RowKV", "sample_actions"]


def _validate_sampling(temperature, top_k, top_p, max_new_tokens) -> Tuple[float, Optional[int], Optional[float], int]:
    if isinstance(temperature, bool):
        raise ValueError(f"temperature: must be a non-negative number, got {temperature!r}")
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise ValueError(f"temperature: must be a non-negative number, got {temperature!r}") from None
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature: must be a finite non-negative number, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None:
        if isinstance(top_p, bool):
            raise ValueError(f"top_p: must lie in (0, 1], got {top_p!r}")
        try:
            p = float(top_p)
        except (TypeError, ValueError):
            raise ValueError(f"top_p: must lie in (0, 1], got {top_p!r}") from None
        if not (0.0 < p <= 1.0):
            raise ValueError(f"top_p: must lie in (0, 1], got {top_p!r}")
        top_p = p
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
    return t, top_k, top_p, max_new_tokens


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        return torch.device("cpu")


@dataclass
class RowKV:
    """The cached keys and values of the first ``length`` tokens of one row.

    ``keys[l]`` / ``values[l]`` have shape ``[heads, length, head_dim]`` for layer ``l``.
    Produced and consumed by :func:`sample_actions` (``past_kv`` / ``return_kv``).
    """

    keys: List[torch.Tensor]
    values: List[torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[-2]) if self.keys else 0


def _cache_layers(cache) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """``[(keys, values), ...]`` of a ``DynamicCache`` (``[B, H, T, D]`` each), or None."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    out = []
    for layer in layers:
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4:
            return None
        out.append((k, v))
    return out


def _extract_rows(cache, rows: torch.Tensor, mask: torch.Tensor) -> Optional[List[RowKV]]:
    """Per-row :class:`RowKV` for ``rows`` of a batched cache; ``mask`` [B, T] marks real tokens."""
    layers = _cache_layers(cache)
    if layers is None:
        return None
    out = []
    for i in rows.tolist():
        keep = mask[i].bool()
        # boolean indexing copies: the row owns its tensors (the batch buffers are reused)
        out.append(RowKV([k[i][:, keep, :] for k, _ in layers], [v[i][:, keep, :] for _, v in layers]))
    return out


def _batched_cache(past: Sequence[RowKV], device) -> Tuple[Any, torch.Tensor]:
    """A left-padded ``DynamicCache`` holding ``past`` and its attention mask ``[B, Lc]``."""
    from transformers import DynamicCache

    B = len(past)
    Lc = max(p.length for p in past)
    n_layers = len(past[0].keys)
    mask = torch.zeros((B, Lc), dtype=torch.long, device=device)
    data = []
    for layer in range(n_layers):
        k0, v0 = past[0].keys[layer], past[0].values[layer]
        K = k0.new_zeros((B, k0.shape[0], Lc, k0.shape[-1]))
        V = v0.new_zeros((B, v0.shape[0], Lc, v0.shape[-1]))
        for b, p in enumerate(past):
            n = p.length
            if n:
                K[b, :, Lc - n:, :] = p.keys[layer]
                V[b, :, Lc - n:, :] = p.values[layer]
        data.append((K, V))
    for b, p in enumerate(past):
        if p.length:
            mask[b, Lc - p.length:] = 1
    return DynamicCache(ddp_cache_data=data), mask


def _empty_row(like: RowKV) -> RowKV:
    return RowKV([k[:, :0, :] for k in like.keys], [v[:, :0, :] for v in like.values])


class _Stepper:
    """One KV-cached forward step returning float logits ``[B, V]`` of the last position.

    With ``head_in_float32`` the backbone (``causal.model``) is run and its last hidden
    state is multiplied by the float32 output embedding (cast once per call), matching a
    learner that computes its head in float32.
    """

    def __init__(self, model, head_in_float32: bool, extra_capacity: Optional[int] = None):
        self.model = model
        self.cache_kw = cache_kwarg(model)
        self.cache = None
        self.backbone = None
        # with extra_capacity, the cache of the first call becomes preallocated buffers and
        # later one-token calls run the lean decode step (Llama models; decode.py)
        self.fast = fast_backbone(model) if extra_capacity is not None else None
        self.extra = extra_capacity
        causal = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.lm_head = getattr(causal, "lm_head", None)
        if head_in_float32:
            backbone = getattr(causal, "model", None)
            head = getattr(causal, "lm_head", None)
            if backbone is not None and isinstance(getattr(head, "weight", None), torch.Tensor):
                self.backbone = backbone
                self.backbone_cache_kw = cache_kwarg(backbone)
                self.weight = head.weight.detach().float()
                bias = getattr(head, "bias", None)
                self.bias = None if bias is None else bias.detach().float()

    def __call__(self, *, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        if isinstance(cache, KVBuffers):
            h = decode_step(self.fast, cache, input_ids[:, 0], position_ids[:, 0], attention_mask)
            self.cache = cache
            if self.backbone is not None:
                return torch.nn.functional.linear(h.float(), self.weight, self.bias)
            return self.lm_head(h).float()
        kw = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
        if self.backbone is not None:
            if cache is not None:
                kw[self.backbone_cache_kw] = cache
            out = self.backbone(**kw)
            self._keep(output_cache(out))
            h = out.last_hidden_state[:, -1, :].float()
            return torch.nn.functional.linear(h, self.weight, self.bias)
        if cache is not None:
            kw[self.cache_kw] = cache
        out = self.model(logits_to_keep=1, **kw)
        self._keep(output_cache(out))
        return out.logits[:, -1, :].float()

    def _keep(self, cache) -> None:
        layers = _cache_layers(cache) if self.fast is not None and self.lm_head is not None else None
        self.cache = KVBuffers(layers, self.extra) if layers else cache


def _model_name(model) -> str:
    name = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    return str(name) if name else type(model).__name__


@torch.no_grad()
def sample_actions(
    model,
    sequences: Sequence[Sequence[int]],
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    max_new_tokens: int = 64,
    generator: Optional[torch.Generator] = None,
    head_in_float32: bool = True,
    past_kv: Optional[Sequence[Optional[RowKV]]] = None,
    return_kv: bool = False,
    fast_decode: bool = True,
):
    r"""Continue each token sequence with one sampled action (KV-cached, left padded).

    Args:
      model: a Hugging Face causal LM, PEFT-wrapped or not (its forward takes
        ``input_ids, attention_mask, position_ids, use_cache`` and the KV cache as
        ``cache`` or, in older transformers, ``past_key_values``).
      sequences: the contexts, one list of token ids per row (non-empty).
      eos_ids: tokens that end an action (kept as its last token).
      pad_id: id used for left padding (never attended).
      temperature, top_k, top_p: the sampling distribution; ``temperature == 0`` is greedy.
      max_new_tokens: cut an action after this many tokens.
      generator: random generator on the model's device (reproducible draws).
      head_in_float32: compute the logits as ``float32(h) @ float32(W_head)^T`` from the
        final hidden state ``h`` (as the learner does), instead of the model's own
        ``lm_head`` in its parameter dtype. Identical for float32 models; for bfloat16
        models it removes the bf16 rounding of the logits (~1% on a ratio). Models
        without ``.model`` / ``lm_head`` always use their own logits.

      past_kv: optional per-row :class:`RowKV` holding the keys and values of a prefix
        of that row (``None`` entries: nothing cached), computed by the same weights;
        only the remaining tokens are run. The prefix must be shorter than the row.
      return_kv: also return, per row, the :class:`RowKV` of its context plus its action
        without the action's last token (the next call's ``past_kv``); ``None`` where the
        model's cache cannot be read back.
      fast_decode: after the context has run, decode with
        :func:`~trajgrad.rollout.decode.decode_step` (preallocated key/value buffers, no
        per-call mask or cache objects) where the model qualifies
        (:func:`~trajgrad.rollout.decode.fast_backbone`); ``False`` calls the model's own
        forward for every token. The same distribution up to float rounding.

    Returns:
      per row ``(action_ids, behaviour_logp, cut)``: ``behaviour_logp[j]`` is
      :math:`\log\mu(x_j\mid x_{<j})` under the warped distribution (0.0 when greedy);
      ``cut`` is True when the action hit ``max_new_tokens`` before an end token. With
      ``return_kv``: ``(results, kv)``.
    """
    from ..logprobs import sampling_logits

    t, top_k, top_p, max_new_tokens = _validate_sampling(temperature, top_k, top_p, max_new_tokens)
    if not sequences:
        return []
    device = _model_device(model)
    B = len(sequences)
    lengths = [len(s) for s in sequences]
    if min(lengths) < 1:
        raise ValueError("sequences: every sequence needs at least one token")
    cached = [0] * B
    if past_kv is not None:
        if len(past_kv) != B:
            raise ValueError(f"past_kv: expected {B} entries (one per sequence), got {len(past_kv)}")
        for b, p in enumerate(past_kv):
            if p is not None:
                if not isinstance(p, RowKV):
                    raise ValueError(f"past_kv: entry {b} is a {type(p).__name__}, expected RowKV or None")
                if p.length >= lengths[b]:
                    raise ValueError(f"past_kv: entry {b} caches {p.length} tokens of a {lengths[b]}-token sequence; "
                                     "at least one token must remain")
                cached[b] = p.length
    new_lengths = [n - c for n, c in zip(lengths, cached)]
    L = max(new_lengths)
    input_ids = torch.full((B, L), int(pad_id), dtype=torch.long)
    new_mask = torch.zeros((B, L), dtype=torch.long)
    for b, s in enumerate(sequences):
        n = new_lengths[b]
        input_ids[b, L - n:] = torch.as_tensor(list(s)[cached[b]:], dtype=torch.long)
        new_mask[b, L - n:] = 1
    input_ids = input_ids.to(device)
    new_mask = new_mask.to(device)
    cache = None
    if any(cached):
        like = next(p for p in past_kv if p is not None)
        cache, past_mask = _batched_cache([p if p is not None else _empty_row(like) for p in past_kv], device)
        attention_mask = torch.cat([past_mask, new_mask], dim=1)
    else:
        attention_mask = new_mask
    position_ids = position_ids_from_attention_mask(attention_mask)[:, -L:]
    eos = torch.as_tensor(sorted(set(int(e) for e in eos_ids)), dtype=torch.long, device=device)

    if not isinstance(fast_decode, bool):
        raise ValueError(f"fast_decode: expected a bool, got {fast_decode!r}")
    step_fn = _Stepper(model, head_in_float32, extra_capacity=max_new_tokens if fast_decode else None)
    logits = step_fn(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache)
    past = step_fn.cache
    row_kv: List[Optional[RowKV]] = [None] * B
    want_kv = bool(return_kv) and _cache_layers(past) is not None
    next_pos = torch.as_tensor(lengths, dtype=torch.long, device=device)
    alive = torch.arange(B, device=device)  # original row of each row still decoding
    actions: List[List[int]] = [[] for _ in range(B)]
    logps: List[List[float]] = [[] for _ in range(B)]
    cut = [False] * B
    can_prune = hasattr(past, "batch_select_indices")
    # rows that ended stay in the batch (their tokens are ignored) until a quarter of it has
    # ended: dropping them from the cache copies every layer, which costs more than decoding them
    finished = torch.zeros(B, dtype=torch.bool, device=device)

    for step in range(max_new_tokens):
        if t == 0.0:
            token = logits.argmax(-1)
            token_logp = torch.zeros(token.shape, dtype=torch.float32, device=device)
        else:
            warped = sampling_logits(logits, temperature=t, top_k=top_k, top_p=top_p)
            probs = torch.softmax(warped, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            # the same operations as token_logprobs: z_y - logsumexp(z) on the warped logits
            token_logp = warped.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(warped, dim=-1)
        tok_list = token.tolist()
        lp_list = token_logp.tolist()
        ended = torch.isin(token, eos) & ~finished
        last = step == max_new_tokens - 1
        for i, (r, done, end) in enumerate(zip(alive.tolist(), finished.tolist(), ended.tolist())):
            if done:
                continue
            actions[r].append(tok_list[i])
            logps[r].append(lp_list[i])
            if last and not end:
                cut[r] = True
        if last:
            break
        if want_kv and bool(ended.any()):  # the cache holds each of these rows' tokens before its end token
            gone = ended.nonzero().squeeze(-1)
            for r, kv in zip(alive[gone].tolist(), _extract_rows(past, gone, attention_mask)):
                row_kv[r] = kv
        finished |= ended
        n_done = int(finished.sum())
        if n_done == finished.numel():
            break
        if can_prune and n_done * 4 >= finished.numel():
            idx = (~finished).nonzero().squeeze(-1)
            past.batch_select_indices(idx)
            attention_mask = attention_mask[idx]
            token = token[idx]
            next_pos = next_pos[idx]
            alive = alive[idx]
            finished = finished[idx]
        attention_mask = torch.cat(
            [attention_mask, torch.ones((attention_mask.shape[0], 1), dtype=attention_mask.dtype, device=device)], dim=1
        )
        logits = step_fn(input_ids=token[:, None], attention_mask=attention_mask, position_ids=next_pos[:, None], cache=past)
        past = step_fn.cache
        next_pos = next_pos + 1
    results = [(actions[b], logps[b], cut[b]) for b in range(B)]
    if not return_kv:
        return results
    if want_kv:
        # rows still decoding at the end (cut at max_new_tokens): every cached token is theirs
        # (the last sampled token is not in the cache yet); ended rows were extracted on ending
        missing = [i for i, r in enumerate(alive.tolist()) if row_kv[r] is None]
        if missing:
            idx = torch.as_tensor(missing, dtype=torch.long, device=device)
            for r, kv in zip(alive[idx].tolist(), _extract_rows(past, idx, attention_mask)):
                row_kv[r] = kv
    return results, row_kv


@dataclass
class _Episode:
    task: Any
    group_index: int
    env: Any
    episode_id: str
    system: List[Dict[str, str]]
    prompt: List[int]
    tokens: List[int]
    initial_potential: float
    reset_seconds: float
    segment: int = 0
    turns: List[Turn] = field(default_factory=list)
    closed: List[Trajectory] = field(default_factory=list)
    n_turns: int = 0
    done: bool = False
    success: Optional[bool] = None
    kv: Optional[RowKV] = None  # keys/values of a prefix of ``tokens`` (KV reuse across turns)
    kv_epoch: int = -1


def _messages_key(messages) -> Optional[Tuple[Tuple[str, str], ...]]:
    """A hashable key of a chat (role, content pairs), or None if a message has other fields."""
    key = []
    for m in messages:
        if not (isinstance(m, dict) and set(m) <= {"role", "content"}
                and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return None
        key.append((m["role"], m["content"]))
    return tuple(key)


def _may_continue(ep: "_Episode") -> bool:
    """Whether the episode can have a turn after the one being sampled."""
    max_turns = getattr(ep.env, "max_turns", None)
    return max_turns is None or ep.n_turns + 1 < int(max_turns)


def _potential(env) -> float:
    fn = getattr(env, "potential", None)
    if fn is None:
        return 0.0
    return float(fn())


def _as_step_result(res) -> Tuple[List[Dict[str, str]], float, bool, bool, Dict[str, Any]]:
    try:
        messages, reward, terminated, truncated, info = res
    except (TypeError, ValueError):
        raise ValueError(
            f"env: step() must return StepResult(messages, reward, terminated, truncated, info), got {res!r}"
        ) from None
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"env: step() returned a non-finite reward {reward}")
    return list(messages or []), reward, bool(terminated), bool(truncated), dict(info or {})


class HFSampler:
    r"""Multi-turn, batched, KV-cached sampler for a Hugging Face causal LM.

    Args:
      model: a causal LM (``LlamaForCausalLM``, a PEFT wrapper of one, ...). Its device is
        used for sampling; its mode is restored after each call.
      tokenizer: the model's tokenizer (ChatML, ``<|im_end|>`` ends a turn).
      temperature: :math:`T \ge 0`; 0 means greedy (behaviour log-prob 0.0).
      top_k: keep the k most probable tokens (``None``: off).
      top_p: nucleus mass in (0, 1] (``None``: off).
      max_new_tokens: the most tokens of one action.
      policy_version: recorded on every turn sampled (§16).
      progress: show a progress bar over episodes.
      max_batch_size: at most this many episodes per forward pass (``None``: all).
      max_context_tokens: an episode whose context plus ``max_new_tokens`` would exceed
        this is truncated (default: the model's ``max_position_embeddings``).
      head_in_float32: logits from the float32 output embedding (see
        :func:`sample_actions`); keep it equal to the learner's convention.
      reuse_kv: keep each episode's keys and values between turns and compute the prompt
        prefix shared by a batch once (see the module docstring); ``False`` recomputes the
        whole context every turn (same tokens under greedy decoding, more compute).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        max_new_tokens: int = 64,
        policy_version: int = 0,
        progress: bool = False,
        max_batch_size: Optional[int] = None,
        max_context_tokens: Optional[int] = None,
        head_in_float32: bool = True,
        reuse_kv: bool = True,
        fast_decode: bool = True,
    ):
        self.temperature, self.top_k, self.top_p, self.max_new_tokens = _validate_sampling(
            temperature, top_k, top_p, max_new_tokens
        )
        self.model = model
        self.tokenizer = tokenizer
        self.eos_id = end_of_turn_id(tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.progress = bool(progress)
        if max_batch_size is not None and (isinstance(max_batch_size, bool) or int(max_batch_size) < 1):
            raise ValueError(f"max_batch_size: must be a positive integer or None, got {max_batch_size!r}")
        self.max_batch_size = None if max_batch_size is None else int(max_batch_size)
        if max_context_tokens is None:
            max_context_tokens = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.max_context_tokens = None if max_context_tokens is None else int(max_context_tokens)
        self.head_in_float32 = bool(head_in_float32)
        self.reuse_kv = bool(reuse_kv)
        self.fast_decode = bool(fast_decode)
        self._kv_epoch = 0  # bumped whenever cached keys/values become stale
        self.policy_version = 0
        self.set_policy_version(policy_version)

    # -------------------------------------------------------------------- settings
    def set_policy_version(self, version: int) -> None:
        """The version recorded on turns sampled from now on (after a weight update)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version: must be a non-negative integer, got {version!r}")
        if version != self.policy_version:
            self.clear_cache()
        self.policy_version = version

    def clear_cache(self) -> None:
        """Drop the keys and values cached for episodes in progress (new weights loaded)."""
        self._kv_epoch += 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampling_params(self) -> Dict[str, Any]:
        """What every trajectory records in ``Trajectory.sampling``."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "model": _model_name(self.model),
            "greedy": self.greedy,
        }

    # -------------------------------------------------------------------- sampling
    def _generate(self, seqs: List[List[int]], generator, past: Optional[List[Optional[RowKV]]] = None,
                  keep_kv: bool = True):
        """Sample one action per row, in chunks of ``max_batch_size``; with ``past`` (KV
        reuse) also return each row's new :class:`RowKV` (None for every row when not
        ``keep_kv``)."""
        step = self.max_batch_size or len(seqs)
        out: List[Tuple[List[int], List[float], bool]] = []
        kvs: List[Optional[RowKV]] = []
        for start in range(0, len(seqs), step):
            chunk = seqs[start:start + step]
            kw = dict(eos_ids=[self.eos_id], pad_id=self.pad_id, temperature=self.temperature, top_k=self.top_k,
                      top_p=self.top_p, max_new_tokens=self.max_new_tokens, generator=generator,
                      head_in_float32=self.head_in_float32, fast_decode=self.fast_decode)
            if past is None:
                out.extend(sample_actions(self.model, chunk, **kw))
                continue
            chunk_past = self._shared_prefix(chunk, list(past[start:start + step]))
            if keep_kv:
                res, kv = sample_actions(self.model, chunk, past_kv=chunk_past, return_kv=True, **kw)
            else:
                res, kv = sample_actions(self.model, chunk, past_kv=chunk_past, **kw), [None] * len(chunk)
            out.extend(res)
            kvs.extend(kv)
        return out if past is None else (out, kvs)

    @torch.no_grad()
    def _shared_prefix(self, seqs: List[List[int]], past: List[Optional[RowKV]], min_tokens: int = 8):
        """Rows with nothing cached that share prefixes (a group's prompt, a common system
        prompt; :func:`~trajgrad.rollout.collate.prefix_groups`): run each distinct prefix
        once and give its rows its keys and values."""
        fresh = [i for i, p in enumerate(past) if p is None]
        if len(fresh) < 2:
            return past
        T = max(len(seqs[i]) for i in fresh)
        ids = torch.zeros((len(fresh), T), dtype=torch.long)
        mask = torch.zeros((len(fresh), T), dtype=torch.long)
        for r, i in enumerate(fresh):
            ids[r, :len(seqs[i])] = torch.as_tensor(seqs[i], dtype=torch.long)
            mask[r, :len(seqs[i])] = 1
        groups = prefix_groups(ids, mask, min_prefix=min_tokens)
        if groups is None:
            return past
        device = _model_device(self.model)
        head = ids[groups.rows, :groups.length].to(device)
        ones = torch.ones_like(head)
        step_fn = _Stepper(self.model, False)
        step_fn(input_ids=head, attention_mask=ones, position_ids=position_ids_from_attention_mask(ones), cache=None)
        shared = _extract_rows(step_fn.cache, torch.arange(head.shape[0]), ones)
        if shared is None:
            return past
        out = list(past)
        for r, i in enumerate(fresh):
            out[i] = shared[int(groups.index[r])]
        return out

    def rollout(
        self,
        task_source_or_env_factory: Union[Any, Callable[[], Any]],
        tasks: Sequence[Any],
        *,
        group_size: int = 1,
        seed: Optional[int] = None,
        before_turn: Optional[Callable[[int], None]] = None,
    ) -> List[Trajectory]:
        """Run ``len(tasks) * group_size`` episodes in one batch; return their sub-traces.

        Args:
          task_source_or_env_factory: a ``TaskSource`` (its ``make_env()`` is called) or a
            zero-argument callable returning an ``Environment``; one fresh environment per
            episode.
          tasks: the ``Task`` objects.
          group_size: episodes per task (a group shares ``task_id``).
          seed: seeds the token draws (same seed, same model, same batch: same samples).
          before_turn: optional callback, called with the turn index (0, 1, ...)
            immediately before each batched generation call, i.e. after the environment
            steps of the previous turn. It may load new weights into the model in place
            and call :meth:`set_policy_version`: the turns sampled afterwards record the
            new version and their behaviour log-probs come from the new weights, while the
            earlier turns keep theirs (partial rollouts, §16).

        Returns:
          the trajectories ordered by task, then group member, then segment. Every
          trajectory of an episode carries the episode's final ``success``;
          ``metadata`` holds ``group_index``, ``env``, ``initial_potential``,
          ``episode_reward`` (summed over segments), ``num_segments``, ``compacted``.
        """
        make_env = getattr(task_source_or_env_factory, "make_env", None)
        if make_env is None:
            if not callable(task_source_or_env_factory):
                raise ValueError(
                    "task_source_or_env_factory: expected a TaskSource (with make_env) or a callable returning an Environment"
                )
            make_env = task_source_or_env_factory
        tasks = list(tasks)
        if not tasks:
            raise ValueError("tasks: empty; nothing to roll out")
        for task in tasks:
            if not hasattr(task, "id") or not hasattr(task, "split"):
                raise ValueError(f"tasks: expected Task objects, got {type(task).__name__}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size: must be a positive integer, got {group_size!r}")
        if before_turn is not None and not callable(before_turn):
            raise ValueError(f"before_turn: expected a callable taking the turn index, got {type(before_turn).__name__}")

        device = _model_device(self.model)
        generator = torch.Generator(device=device)
        if seed is not None:
            generator.manual_seed(int(seed))
        else:
            generator.seed()
        sampling = dict(self.sampling_params(), seed=seed)
        run = uuid.uuid4().hex[:10]

        episodes: List[_Episode] = []
        encoded: Dict[Tuple[Tuple[str, str], ...], List[int]] = {}  # a group's members share a prompt
        for task in tasks:
            for g in range(group_size):
                env = make_env()
                t0 = time.perf_counter()
                messages = list(env.reset(task))
                reset_s = time.perf_counter() - t0
                key = _messages_key(messages)
                if key is None:
                    ids = prompt_ids(self.tokenizer, messages)
                else:
                    if key not in encoded:
                        encoded[key] = prompt_ids(self.tokenizer, messages)
                    ids = list(encoded[key])
                self._check_fits(ids, task)
                system = [m for m in messages[:1] if m.get("role") == "system"]
                episodes.append(
                    _Episode(
                        task=task, group_index=g, env=env, episode_id=f"{task.id}#{g}-{run}", system=system,
                        prompt=ids, tokens=list(ids), initial_potential=_potential(env), reset_seconds=reset_s,
                    )
                )

        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(episodes), desc="rollout", unit="episode", leave=False)
        was_training = getattr(self.model, "training", False)
        self.model.eval()
        try:
            active = list(episodes)
            turn = 0
            while active:
                for ep in active:
                    if self.max_context_tokens is not None and len(ep.tokens) + self.max_new_tokens > self.max_context_tokens:
                        self._close(ep, terminated=False, truncated=True, sampling=sampling, reason="context")
                active = [ep for ep in active if not ep.done]
                if not active:
                    break
                if before_turn is not None:
                    before_turn(turn)
                turn += 1
                version = self.policy_version
                epoch = self._kv_epoch
                t0 = time.perf_counter()
                if self.reuse_kv:
                    past = [ep.kv if ep.kv is not None and ep.kv_epoch == epoch else None for ep in active]
                    # an episode on its last allowed turn ends after it: its keys/values are not kept
                    keep = any(_may_continue(ep) for ep in active)
                    results, kvs = self._generate([ep.tokens for ep in active], generator, past, keep_kv=keep)
                else:
                    results, kvs = self._generate([ep.tokens for ep in active], generator), [None] * len(active)
                gen_s = time.perf_counter() - t0
                for ep, (action, logp, cut), kv in zip(active, results, kvs):
                    ep.kv, ep.kv_epoch = kv, epoch
                    self._advance(ep, action, logp, cut, version, gen_s, sampling)
                    if ep.done and bar is not None:
                        bar.update(1)
                active = [ep for ep in active if not ep.done]
                if bar is not None:
                    bar.set_postfix(active=len(active))
        finally:
            if was_training:
                self.model.train()
            if bar is not None:
                bar.close()

        out: List[Trajectory] = []
        for ep in episodes:
            total = float(sum(t.total_reward for t in ep.closed))
            for tr in ep.closed:
                tr.success = ep.success
                tr.metadata["episode_reward"] = total
                tr.metadata["num_segments"] = len(ep.closed)
            out.extend(ep.closed)
        return out

    # -------------------------------------------------------------------- episode logic
    def _check_fits(self, ids: List[int], task) -> None:
        if self.max_context_tokens is not None and len(ids) + self.max_new_tokens > self.max_context_tokens:
            raise ValueError(
                f"tasks: the prompt of task {task.id!r} has {len(ids)} tokens; with max_new_tokens="
                f"{self.max_new_tokens} it exceeds max_context_tokens={self.max_context_tokens}"
            )

    def _advance(self, ep: _Episode, action, logp, cut, version, gen_s, sampling) -> None:
        text = decode_action(self.tokenizer, action, self.eos_id)
        t0 = time.perf_counter()
        messages, reward, terminated, truncated, info = _as_step_result(ep.env.step(text))
        env_s = time.perf_counter() - t0
        ep.n_turns += 1
        max_turns = getattr(ep.env, "max_turns", None)
        if not (terminated or truncated) and max_turns is not None and ep.n_turns >= int(max_turns):
            truncated = True
            info.setdefault("truncated_by", "max_turns")
        done = terminated or truncated
        summary = info.get("compact") if not done else None
        if done or summary is not None:
            obs: List[int] = []
        else:
            obs = observation_ids(self.tokenizer, messages, action_closed=not cut)
        ep.turns.append(
            Turn(
                action_ids=action, observation_ids=obs, behaviour_logp=logp, policy_version=version,
                reward=reward, info=info, action_text=text, cut=cut, gen_seconds=gen_s, env_seconds=env_s,
            )
        )
        ep.tokens.extend(action)
        ep.tokens.extend(obs)
        if "success" in info and info["success"] is not None:
            ep.success = bool(info["success"])
        if done:
            self._close(ep, terminated=terminated, truncated=truncated, sampling=sampling)
        elif summary is not None:
            self._close_segment(ep, sampling, compacted=True)
            context = ep.system + [{"role": "user", "content": str(summary)}] + messages
            ep.segment += 1
            ep.prompt = prompt_ids(self.tokenizer, context)
            self._check_fits(ep.prompt, ep.task)
            ep.tokens = list(ep.prompt)
            ep.kv = None
            ep.initial_potential = _potential(ep.env)

    def _close_segment(self, ep: _Episode, sampling, *, terminated=False, truncated=False, compacted=False) -> None:
        task = ep.task
        ep.closed.append(
            Trajectory(
                task_id=task.id, episode_id=ep.episode_id, segment=ep.segment, split=task.split,
                prompt_ids=ep.prompt, turns=ep.turns, terminated=terminated, truncated=truncated,
                sampling=dict(sampling),
                metadata={
                    "group_index": ep.group_index,
                    "env": getattr(ep.env, "name", type(ep.env).__name__),
                    "initial_potential": ep.initial_potential,
                    "reset_seconds": ep.reset_seconds if ep.segment == 0 else 0.0,
                    "compacted": compacted,
                },
            )
        )
        ep.turns = []

    def _close(self, ep: _Episode, *, terminated: bool, truncated: bool, sampling, reason: str = "") -> None:
        ep.done = True
        ep.kv = None
        if reason == "context" and ep.turns:
            # nothing was generated after the last observation: drop it, so that the
            # trajectory itself fits in the context window
            last = ep.turns[-1]
            del ep.tokens[len(ep.tokens) - len(last.observation_ids):]
            last.observation_ids = []
        if ep.turns:
            self._close_segment(ep, sampling, terminated=terminated, truncated=truncated)
        elif ep.closed:  # nothing sampled in the new segment: the previous one ends the episode
            ep.closed[-1].truncated = ep.closed[-1].truncated or truncated
            ep.closed[-1].terminated = ep.closed[-1].terminated or terminated
        if reason and ep.closed:
            ep.closed[-1].metadata["truncated_by"] = reason
