r"""Log-probabilities, entropies and divergences from hidden states without holding ``[B, L, V]``.

A language-model head maps a hidden state :math:`h \in \mathbb R^H` to logits
:math:`z = (W h + b)/T` over a vocabulary of size :math:`V`. The naive path
``log_softmax(hidden @ W.T)`` materializes ``[B, L, V]`` logits, their log-softmax and,
in the backward pass, a gradient of the same size: at ``L = 4096`` and ``V = 151936`` that
is 2.5 GB per tensor in float32, several of them alive at once (§14: "full vocabulary
costs memory/bandwidth").

The functions here compute the same quantities *exactly* (same formula, float rounding
aside) while holding only a chunk of ``chunk_size`` positions' logits at a time:

=========================  ================================================================
``fused_token_logprobs``   :math:`\log\pi(y_n\mid h_n) = z_{n,y_n} - \operatorname{lse}(z_n)`
                           (§4), ``[B, L]``
``fused_entropy``          :math:`\mathcal H_n = \operatorname{lse}(z_n) - \sum_v \pi_{n,v} z_{n,v}`,
                           ``[B, L]``
=========================  ================================================================

Both are ``torch.autograd.Function`` s that save only their inputs and one or two floats per
position (the log-partition :math:`\operatorname{lse}(z_n)`, the entropy) and *recompute*
each chunk's logits in the backward pass. The gradients w.r.t. ``hidden``, ``weight`` and
``bias`` are the analytic ones,

.. math::

   \frac{\partial \log\pi(y_n)}{\partial z_{n,v}} = \mathbb 1[v=y_n]-\pi_{n,v},\qquad
   \frac{\partial \mathcal H_n}{\partial z_{n,v}} = -\pi_{n,v}\,(\log\pi_{n,v}+\mathcal H_n),

pushed through :math:`z = (Wh+b)/T` by two matrix products per chunk. Peak extra memory is
:math:`O(\text{chunk\_size}\cdot V)` instead of :math:`O(B L V)`: one ``[chunk_size, V]``
buffer for log-probs, two for entropies, reused by every chunk of a call (plus the
gradients themselves, e.g. ``[V, H]`` for the head). Cost: one matrix product per chunk
forward, three backward (the naive path: one + two), i.e. about 4/3 of the naive matrix
work. When only ``hidden`` needs a gradient (a frozen head, as in LoRA training) the
hidden-state gradient factor is formed in the forward pass instead and nothing is
recomputed: two products, as for the naive path.

**Masks.** With ``mask`` given, masked positions are never read (NaN/inf hidden rows there
cannot leak), produce 0, and receive exactly zero gradient; they cost no compute.

**Vocabulary chunking.** ``vocab_chunk_size`` additionally splits the vocabulary into
blocks and combines them with an online log-sum-exp (running maximum :math:`m`, running
:math:`s = \sum e^{z-m}`, rescaled by :math:`e^{m_{old}-m_{new}}` when the maximum grows).
Memory then is :math:`O(\text{chunk\_size}\cdot\text{vocab\_chunk\_size})`, independent of
:math:`V`. By default (``vocab_chunk_size="auto"``) the log-prob and entropy kernels use it
when the head itself gets a gradient on the CPU and :math:`V > 2048`: tiles of 256 positions x 2,048
columns (:mod:`trajgrad.fused.chunking`), which leave the ``[V, H]`` head gradient as the
only vocabulary-sized allocation at no cost in time (the tiles' products keep an efficient
shape and the head gradient is written block by block). A frozen head keeps whole-vocabulary
chunks, whose eager scheme (above) needs every column of a row at once.

**Divergences.** The kernel behind :mod:`trajgrad.losses.distill` lives here too
(:func:`weighted_divergence`). It differs in one respect: a distillation loss is a scalar
:math:`\sum_n \omega_n D_n` with known per-position weights :math:`\omega_n` (the
aggregation), so its gradient is formed in the *forward* chunk loop, while each chunk's
logits are at hand, and the backward pass only scales it by the incoming scalar. Nothing is
recomputed: forward + backward costs the same four matrix products as the naive path
(student and teacher logits, hidden-state and head gradients). The KLs hold two
``[chunk_size, V]`` buffers, the two logits: after each side's log-partition they are
swept once in blocks of 2,048 columns that stay in cache, which turn them into
log-probabilities, read off the entropies and the divergence, and leave the gradient
w.r.t. the student logits in one of them (the reverse KL, whose gradient needs the
divergence itself, sweeps once more). The JSD holds about eight (its log-mixture terms need
temporaries).

**Chunk size.** Every function takes ``chunk_size="auto"`` by default: the chunk is the
largest (multiple of 16) number of positions whose ``[chunk, V]`` temporaries fit a memory
budget, 192 MiB unless changed with :func:`chunk_budget` / :func:`set_chunk_budget` or the
environment variable ``TRAJGRAD_CHUNK_BUDGET_MIB`` (rule and buffer counts in
:mod:`trajgrad.fused.chunking`); an int ``chunk_size`` is used as given.

**Modules.** :mod:`~trajgrad.fused.positionwise` (log-probs, entropies),
:mod:`~trajgrad.fused.divergence` (the divergence kernel), :mod:`~trajgrad.fused.chunking`
(the chunk rule), :mod:`~trajgrad.fused.checks` (validation shared with the losses).

**Precision.** Statistics are formed in float32 at least (bf16/fp16 inputs are upcast per
chunk); vocabulary-wide sums use pairwise-style blocked accumulation so that float32 results
match a float32 naive computation to ~1e-7 relative at ``V ~ 1.5e5``.
"""
from __future__ import annotations

from .checks import check_finite_fast, check_head, check_sizes
from .chunking import auto_chunk_size, auto_tiles, chunk_budget, get_chunk_budget, set_chunk_budget
from .divergence import DIVERGENCES, Head, head_entropy, weighted_divergence
from .positionwise import fused_entropy, fused_token_logprobs

__all__ = ["fused_token_logprobs", "fused_entropy", "weighted_divergence", "head_entropy", "Head", "DIVERGENCES",
           "check_finite_fast", "check_head", "check_sizes", "auto_chunk_size", "auto_tiles", "chunk_budget",
           "get_chunk_budget", "set_chunk_budget"]
