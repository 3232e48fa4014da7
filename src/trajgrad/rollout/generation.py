r"""Token generation with recorded behaviour log-probabilities (§4, §7, §24), apart from episodes.

:func:`sample_actions` continues each of a batch of token sequences with one sampled
action, KV-cached and left padded. Each token is drawn from the *sampling distribution*

.. math::

   \mu(v\mid h) = \operatorname{softmax}\big(\texttt{sampling\_logits}(z; T, k, p)\big)_v,

(temperature :math:`T`, then top-k, then top-p, exactly as ``generate()`` warps; see
:func:`trajgrad.logprobs.sampling_logits`; drawn by :func:`draw_tokens`), and its behaviour log-prob
:math:`\log\mu(x_j\mid x_{<j})` is recorded with the same operations as
:func:`trajgrad.logprobs.token_logprobs`. The denominator of every importance ratio (§7)
is therefore the probability of the distribution that actually sampled, and a learner
that recomputes the log-probs with unchanged weights gets a ratio of exactly one (§24).

Positions: a token's position id is its index among the non-padding tokens of its row
(:func:`~trajgrad.model.positions.position_ids_from_attention_mask`), in the left-padded
sampler and in the right-padded learner alike, so both evaluate the same function.

Decoding: the context runs through the model's own forward; the tokens after it run
through :func:`~trajgrad.model.decode.decode_step` for Llama models (preallocated
key/value buffers, the same function up to float rounding; ``fast_decode=False`` turns it
off). Rows given the same :class:`~trajgrad.model.kv.RowKV` object as ``past_kv`` (the
rows of a group, from :class:`HFBackend`'s shared prompt prefix) keep its keys and values
once (:mod:`~trajgrad.model.shared_prefix`); where each such row has one token after its
prefix (a group's prompt but its last token), that token is a decode step as well. Rows that have ended stay in the batch,
ignored, until a quarter of it has ended.

:class:`HFBackend` is the in-process *action backend* of the episode loop
(:class:`~trajgrad.rollout.episodes.EpisodeRunner`): it samples one action per episode in
chunks of ``max_batch_size``, reads each episode's keys and values back
(:class:`~trajgrad.model.kv.RowKV`) so that its next turn only runs the new tokens, and
computes a prompt prefix that several episodes share once.

Greedy decoding (``temperature == 0``): the argmax token is taken and the recorded
behaviour log-prob is 0.0 (probability one).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..logprobs import sampling_logits
from ..model.build import model_device
from ..model.decode import KVBuffers, decode_step, fast_backbone
from ..model.decode_plan import DecodePlan
from ..model.kv import RowKV, batched_cache, cache_kwarg, cache_layers, empty_row, extract_rows, output_cache
from ..model.parts import causal_lm
from ..model.positions import position_ids_from_attention_mask, prefix_groups
from ..model.shared_prefix import SharedPrefix
from .chat import end_of_turn_id

__all__ = ["Action", "HFBackend", "RowKV", "SamplingSettings", "draw_tokens", "sample_actions", "validate_sampling"]


def validate_sampling(temperature, top_k, top_p, max_new_tokens) -> Tuple[float, Optional[int], Optional[float], int]:
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


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling distribution and action length, validated (:func:`validate_sampling`)."""

    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    max_new_tokens: int

    @classmethod
    def create(cls, temperature, top_k, top_p, max_new_tokens) -> "SamplingSettings":
        return cls(*validate_sampling(temperature, top_k, top_p, max_new_tokens))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Action(NamedTuple):
    """One sampled action: its token ids, their behaviour log-probs, whether it was cut at
    ``max_new_tokens``, and the policy version that sampled it when the backend knows it
    (``None``: the episode loop records its own current version)."""

    ids: List[int]
    logp: List[float]
    cut: bool
    policy_version: Optional[int] = None


class _Stepper:
    """One KV-cached forward step returning float logits ``[B, V]`` of the last position.

    With ``head_in_float32`` the backbone (``causal.model``) is run and its last hidden
    state is multiplied by the float32 output embedding (cast once per call), matching a
    learner that computes its head in float32.
    """

    def __init__(self, model, head_in_float32: bool, extra_capacity: Optional[int] = None,
                 max_position: Optional[int] = None):
        self.model = model
        self.cache_kw = cache_kwarg(model)
        self.cache = None
        self.backbone = None
        # with extra_capacity, the cache of the first call becomes preallocated buffers and
        # later one-token calls run the lean decode step (Llama models; decode.py)
        self.fast = fast_backbone(model) if extra_capacity is not None else None
        self.extra = extra_capacity
        # the decode step's fused calls, made from the weights of this sampling call
        self.plan = DecodePlan(self.fast, max_position) if self.fast is not None else None
        # set by the caller when rows share prefixes: the buffers keep each prefix once
        self.shared: Optional[SharedPrefix] = None
        causal = causal_lm(model)
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
            h = decode_step(self.fast, cache, input_ids[:, 0], position_ids[:, 0], attention_mask, plan=self.plan)
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
        layers = cache_layers(cache) if self.fast is not None and self.lm_head is not None else None
        self.cache = KVBuffers(layers, self.extra, shared=self.shared) if layers else cache


def draw_tokens(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    r"""One token per row of ``probs`` ``[B, V]``, token :math:`v` with probability
    :math:`p_{b,v} / \sum_w p_{b,w}`, by the inverse of the cumulative distribution:

    .. math::

       x_b = \min\{\, v : C_{b,v} \ge (1 - u_b)\, C_{b,V-1} \,\}, \qquad
       C_{b,v} = \sum_{w \le v} p_{b,w}, \quad u_b \sim \mathcal U[0, 1),

    with :math:`C` accumulated in float64. One uniform per row: ``torch.multinomial`` draws
    one exponential per row *and token* (0.18 to 0.30 ms against 0.04 to 0.08 ms for this on
    ``64 x 101`` probabilities, one CPU thread). :math:`(1 - u_b) \in (0, 1]`, so the threshold is positive and at
    most the total: a token of probability zero (removed by top-k / top-p) is never drawn
    (its :math:`C` equals its predecessor's, which already reaches the threshold) and the
    index never passes the vocabulary.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64, device=probs.device)
    threshold = u.neg_().add_(1.0).mul_(cdf[:, -1:])
    return torch.searchsorted(cdf, threshold).squeeze(-1)


def _left_padded_mask(lengths: Sequence[int], device) -> torch.Tensor:
    """``[B, max(lengths)]``, 1 at the last ``lengths[b]`` columns of row ``b`` (the mask of
    :func:`~trajgrad.model.kv.batched_cache`)."""
    width = max(lengths)
    n = torch.as_tensor(list(lengths), dtype=torch.long)
    return (torch.arange(width)[None, :] >= width - n[:, None]).long().to(device)


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
        :func:`~trajgrad.model.decode.decode_step` (preallocated key/value buffers, no
        per-call mask or cache objects) where the model qualifies
        (:func:`~trajgrad.model.decode.fast_backbone`); ``False`` calls the model's own
        forward for every token. The same distribution up to float rounding.

    Returns:
      per row ``(action_ids, behaviour_logp, cut)``: ``behaviour_logp[j]`` is
      :math:`\log\mu(x_j\mid x_{<j})` under the warped distribution (0.0 when greedy);
      ``cut`` is True when the action hit ``max_new_tokens`` before an end token. With
      ``return_kv``: ``(results, kv)``.
    """
    t, top_k, top_p, max_new_tokens = validate_sampling(temperature, top_k, top_p, max_new_tokens)
    if not sequences:
        return []
    device = model_device(model)
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
    if not isinstance(fast_decode, bool):
        raise ValueError(f"fast_decode: expected a bool, got {fast_decode!r}")
    step_fn = _Stepper(model, head_in_float32, extra_capacity=max_new_tokens if fast_decode else None,
                       max_position=max(lengths) + max_new_tokens)
    cache = None
    if any(cached):
        like = next(p for p in past_kv if p is not None)
        past_mask = _left_padded_mask(cached, device)
        if step_fn.fast is not None:
            # rows given the same RowKV object (a group's prompt) keep its keys/values once
            step_fn.shared = SharedPrefix.from_rows(past_kv, past_mask.shape[1], device)
        if step_fn.shared is not None and L == 1:
            # one token after each prefix (a GRPO group's prompt but its last token): it is a
            # decode step over the shared prefixes, no batched copy of them is built
            cache = KVBuffers.after_prefix(step_fn.shared, B, L + max_new_tokens, like.keys[0].dtype)
        else:
            cache, _ = batched_cache([p if p is not None else empty_row(like) for p in past_kv], device)
        attention_mask = torch.cat([past_mask, new_mask], dim=1)
    else:
        attention_mask = new_mask
    position_ids = position_ids_from_attention_mask(attention_mask)[:, -L:]
    eos = torch.as_tensor(sorted(set(int(e) for e in eos_ids)), dtype=torch.long, device=device)

    logits = step_fn(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache)
    past = step_fn.cache
    row_kv: List[Optional[RowKV]] = [None] * B
    want_kv = bool(return_kv) and (hasattr(past, "rows_kv") or cache_layers(past) is not None)
    next_pos = torch.as_tensor(lengths, dtype=torch.long, device=device)
    alive = torch.arange(B, device=device)  # original row of each row still decoding
    # step j's token and log-prob of original row r at [r, j]; a row's action is its first
    # ends[r] columns (later columns of a row that has ended, until it is dropped, are unread)
    drawn = torch.empty((B, max_new_tokens), dtype=torch.long, device=device)
    drawn_logp: Optional[torch.Tensor] = None
    ends = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
    cut = torch.zeros(B, dtype=torch.bool, device=device)
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
            token = draw_tokens(torch.softmax(warped, dim=-1), generator)
            # the same operations as token_logprobs: z_y - logsumexp(z) on the warped logits
            token_logp = warped.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(warped, dim=-1)
        if drawn_logp is None:
            drawn_logp = torch.empty((B, max_new_tokens), dtype=token_logp.dtype, device=device)
        drawn[alive, step] = token
        drawn_logp[alive, step] = token_logp
        ended = torch.isin(token, eos) & ~finished
        ends[alive[ended]] = step + 1
        if step == max_new_tokens - 1:
            cut[alive[~(finished | ended)]] = True
            break
        if want_kv and bool(ended.any()):  # the cache holds each of these rows' tokens before its end token
            gone = ended.nonzero().squeeze(-1)
            for r, kv in zip(alive[gone].tolist(), extract_rows(past, gone, attention_mask)):
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
    ids, lps, n = drawn.tolist(), drawn_logp.tolist(), ends.tolist()
    results = [(ids[b][:n[b]], lps[b][:n[b]], c) for b, c in enumerate(cut.tolist())]
    if not return_kv:
        return results
    if want_kv:
        # rows still decoding at the end (cut at max_new_tokens): every cached token is theirs
        # (the last sampled token is not in the cache yet); ended rows were extracted on ending
        missing = [i for i, r in enumerate(alive.tolist()) if row_kv[r] is None]
        if missing:
            idx = torch.as_tensor(missing, dtype=torch.long, device=device)
            for r, kv in zip(alive[idx].tolist(), extract_rows(past, idx, attention_mask)):
                row_kv[r] = kv
    return results, row_kv


class HFBackend:
    r"""In-process action backend: a Hugging Face causal LM sampled with :func:`sample_actions`.

    Args:
      model: a causal LM (``LlamaForCausalLM``, a PEFT wrapper of one, ...). Its device is
        used for sampling; :meth:`eval_mode` puts it in eval mode for a rollout.
      tokenizer: its tokenizer (``end_of_turn_id`` ends an action; padding id for rows).
      temperature, top_k, top_p, max_new_tokens: the sampling distribution and action length.
      max_batch_size: at most this many rows per forward pass (``None``: all).
      head_in_float32: logits from the float32 output embedding (see :func:`sample_actions`).
      reuse_kv: keep each episode's keys and values between its turns and compute a shared
        prompt prefix once; ``False`` recomputes the whole context every turn.
      fast_decode: use the lean decode step where the model qualifies.
    """

    def __init__(self, model, tokenizer, *, temperature: float = 1.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, max_new_tokens: int = 64, max_batch_size: Optional[int] = None,
                 head_in_float32: bool = True, reuse_kv: bool = True, fast_decode: bool = True):
        self.settings = SamplingSettings.create(temperature, top_k, top_p, max_new_tokens)
        self.model = model
        self.eos_id = end_of_turn_id(tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        if max_batch_size is not None and (isinstance(max_batch_size, bool) or int(max_batch_size) < 1):
            raise ValueError(f"max_batch_size: must be a positive integer or None, got {max_batch_size!r}")
        self.max_batch_size = None if max_batch_size is None else int(max_batch_size)
        self.head_in_float32 = bool(head_in_float32)
        self.reuse_kv = bool(reuse_kv)
        self.fast_decode = bool(fast_decode)

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def context_limit(self) -> Optional[int]:
        """The model's ``max_position_embeddings`` (None if it has none)."""
        n = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return None if n is None else int(n)

    def describe(self) -> Dict[str, Any]:
        """What a trajectory records about the backend in ``Trajectory.sampling``."""
        return {"model": _model_name(self.model)}

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        """The model in eval mode for the block; its mode is restored afterwards."""
        was_training = getattr(self.model, "training", False)
        self.model.eval()
        try:
            yield
        finally:
            if was_training:
                self.model.train()

    def generate(self, seqs: List[List[int]], generator: torch.Generator, *, seeded: bool = True,
                 past: Optional[List[Optional[RowKV]]] = None, keep_kv: bool = True):
        """Sample one :class:`Action` per row, in chunks of ``max_batch_size``.

        With ``past`` (KV reuse, one entry per row) also read back each row's new
        :class:`RowKV` (None for every row when not ``keep_kv``); without it, nothing is
        cached. Returns ``(actions, kvs)``. ``seeded`` is unused (``generator`` is seeded).
        """
        s = self.settings
        step = self.max_batch_size or len(seqs)
        out: List[Action] = []
        kvs: List[Optional[RowKV]] = []
        for start in range(0, len(seqs), step):
            chunk = seqs[start:start + step]
            kw = dict(eos_ids=[self.eos_id], pad_id=self.pad_id, temperature=s.temperature, top_k=s.top_k,
                      top_p=s.top_p, max_new_tokens=s.max_new_tokens, generator=generator,
                      head_in_float32=self.head_in_float32, fast_decode=self.fast_decode)
            if past is None:
                res, kv = sample_actions(self.model, chunk, **kw), [None] * len(chunk)
            else:
                chunk_past = self._shared_prefix(chunk, list(past[start:start + step]))
                if keep_kv:
                    res, kv = sample_actions(self.model, chunk, past_kv=chunk_past, return_kv=True, **kw)
                else:
                    res, kv = sample_actions(self.model, chunk, past_kv=chunk_past, **kw), [None] * len(chunk)
            out.extend(Action(a, lp, c) for a, lp, c in res)
            kvs.extend(kv)
        return out, kvs

    @torch.no_grad()
    def _shared_prefix(self, seqs: List[List[int]], past: List[Optional[RowKV]], min_tokens: int = 8):
        """Rows with nothing cached that share prefixes (a group's prompt, a common system
        prompt; :func:`~trajgrad.model.positions.prefix_groups`): run each distinct prefix
        once, each group's as long as its rows share (a GRPO group: its prompt but the last
        token, whatever the other groups' lengths), and give its rows its keys and values."""
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
        device = model_device(self.model)
        # each group's prefix as long as its rows share, right padded to the longest
        width = int(groups.lengths.max())
        head = ids[groups.rows, :width].to(device)
        head_mask = (torch.arange(width)[None, :] < groups.lengths[:, None]).long().to(device)
        step_fn = _Stepper(self.model, False)
        step_fn(input_ids=head, attention_mask=head_mask, position_ids=position_ids_from_attention_mask(head_mask),
                cache=None)
        shared = extract_rows(step_fn.cache, torch.arange(head.shape[0]), head_mask)
        if shared is None:
            return past
        out = list(past)
        for r, i in enumerate(fresh):
            out[i] = shared[int(groups.index[r])]
        return out
