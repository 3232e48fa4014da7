r"""In-process multi-turn sampler that records exact behaviour log-probabilities (§4, §7, §16, §19).

:class:`HFSampler` is the episode loop (:class:`~trajgrad.rollout.episodes.EpisodeRunner`)
composed with the in-process action backend
(:class:`~trajgrad.rollout.generation.HFBackend`): a Hugging Face causal LM sampled with
:func:`~trajgrad.rollout.generation.sample_actions`, whose recorded log-probs are those of
the distribution that sampled (temperature, then top-k, then top-p; §7), with keys and
values kept between an episode's turns. See those modules for the details.
"""
from __future__ import annotations

from typing import Optional

from .episodes import EpisodeRunner
from .generation import HFBackend, RowKV, sample_actions

__all__ = ["HFSampler", "RowKV", "sample_actions"]


class HFSampler(EpisodeRunner):
    r"""Multi-turn, batched, KV-cached sampler for a Hugging Face causal LM.

    ``HFSampler(model, tokenizer, ...)`` is ``EpisodeRunner(HFBackend(model, tokenizer, ...),
    tokenizer, ...)``.

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
        :func:`~trajgrad.rollout.generation.sample_actions`); keep it equal to the
        learner's convention.
      reuse_kv: keep each episode's keys and values between turns and compute the prompt
        prefix shared by a batch once; ``False`` recomputes the whole context every turn
        (same tokens under greedy decoding, more compute).
      fast_decode: decode with :func:`~trajgrad.model.decode.decode_step` where the model
        qualifies.
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
        backend = HFBackend(
            model, tokenizer, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens,
            max_batch_size=max_batch_size, head_in_float32=head_in_float32, reuse_kv=reuse_kv,
            fast_decode=fast_decode,
        )
        super().__init__(backend, tokenizer, policy_version=policy_version, progress=progress,
                         max_context_tokens=max_context_tokens)

    @property
    def model(self):
        """The sampled model (held by the backend)."""
        return self.backend.model
