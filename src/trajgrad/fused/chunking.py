r"""How many positions a chunked kernel processes at once: ``chunk_size="auto"`` from a memory budget.

Every kernel of :mod:`trajgrad.fused` holds a few ``[chunk, V]`` temporaries (logits,
exponentials, the gradient factor) and nothing else of vocabulary size except the
gradients themselves (``[V, H]`` for a trainable head). Its peak *extra* memory is
therefore, to a good approximation,

.. math::

   \text{peak} \approx \underbrace{k \cdot \text{chunk} \cdot V \cdot b}_{\text{temporaries}}
   + \text{gradients},

with :math:`b` the bytes per element of the compute dtype (4 for float32 and for bf16/fp16
inputs, whose statistics are formed in float32; 8 for float64) and :math:`k` the number of
``[chunk, V]`` buffers the kernel keeps alive (:data:`BUFFERS`: 1 for target log-probs,
2 for entropies, 2 for the reverse and the forward KL (the two logits, swept in place by
vocabulary blocks whose ``[chunk, 2048]`` scratch is left out of the count), 8 for the
generalized JSD, whose log-mixture terms need temporaries of their own).

With ``chunk_size="auto"`` (the default everywhere) the chunk is the largest multiple of
:data:`ALIGN` positions whose temporaries fit the budget,

.. math::

   \text{chunk} = \operatorname{clip}\Big(\Big\lfloor\frac{\text{budget}}{k\,V\,b}\Big\rfloor_{\text{ALIGN}},
   \ \text{MIN\_CHUNK},\ \text{MAX\_CHUNK}\Big),

so the temporaries take at most ``budget`` bytes (``MIN_CHUNK`` positions when even that
exceeds it). The default budget, :data:`DEFAULT_BUDGET` = 192 MiB, is the point measured in
``bench/bench_distill.py``: at ``V = 151,936`` it gives 160 positions for both KLs and 320
for target log-probs, large enough for efficient matrix products, while the temporaries
stay far below the naive path's ``[B, L, V]`` tensors (1.2 GB *each* at ``L = 2,048`` in
float32). There (``H = 576``) the KLs' net peak memory is >= 10x below the naive path's, in
less CPU time (``bench/results/distill.md``); 256 MiB gives the KLs 208 positions, a little
faster but the forward KL then at 9.9x.

Override, from the most to the least specific:

* ``chunk_size=<int>`` on the call: exactly that many positions;
* :func:`chunk_budget` (a context manager) or :func:`set_chunk_budget` (process-wide):
  another budget in bytes;
* the environment variable ``TRAJGRAD_CHUNK_BUDGET_MIB`` (read when no budget was set in code).

The budget bounds the temporaries only: gradients (a ``[V, H]`` head gradient is 350 MB at
``V = 151,936, H = 576`` in float32) and the inputs are the caller's and are the same on
the naive path.

**A trainable head: tiles.** When the head itself gets a gradient (its weight or bias
requires grad) on the CPU, that ``[V, H]`` gradient is the call's floor on memory, and chunks of the
whole vocabulary would add a good fraction of it again (320 positions x 151,936 columns
are 194 MB). There the log-prob and entropy kernels (``vocab_chunk_size="auto"``, their
default) work in tiles of ``chunk`` positions x :data:`VOCAB_BLOCK` vocabulary columns
with an online log-sum-exp, the positions per tile from the smaller of the budget and
:data:`TILE_BUDGET`,

.. math::

   \text{chunk} = \operatorname{clip}\Big(\Big\lfloor\frac{\min(\text{budget},\ \text{TILE\_BUDGET})}
   {k_{\text{tile}}\,\text{VOCAB\_BLOCK}\,b}\Big\rfloor_{\text{ALIGN}},\ \text{MIN\_CHUNK},\ \text{MAX\_CHUNK}\Big),
   \qquad k_{\text{tile}} = 2

(the forward pass holds a tile's logits and their exponentials): 256 positions x 2,048
columns, 4 MiB of temporaries, in float32. The matrix products keep an efficient shape,
so the tiles cost no time against whole-vocabulary chunks. Measured at ``V = 151,936,
L = 2,048, H = 576`` (``bench/results/distill.md``, one CPU thread): net peak memory 10.4x
below the naive path's in 0.61x its time, against 6.7x for chunks of 320 positions x the
whole vocabulary, which took the same time as the tiles. A
vocabulary of at most ``VOCAB_BLOCK`` tokens, a frozen head (only the hidden states get
a gradient, e.g. LoRA: the cheaper eager scheme of :mod:`trajgrad.fused.positionwise`
needs the whole vocabulary), calls without a gradient and heads on an accelerator (where
tiles are not measured, and each small tile would cost kernel launches) keep the rule above. A budget
set in code or the environment below ``TILE_BUDGET`` shrinks the tiles too; an explicit
``chunk_size`` / ``vocab_chunk_size`` on the call wins over both.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Tuple, Union

import torch

__all__ = ["DEFAULT_BUDGET", "BUFFERS", "ALIGN", "MIN_CHUNK", "MAX_CHUNK", "VOCAB_BLOCK", "TILE_BUDGET",
           "TILE_BUFFERS", "auto_chunk_size", "auto_tiles", "resolve_chunk_size", "resolve_tiles",
           "get_chunk_budget", "set_chunk_budget", "chunk_budget"]

MiB = 2 ** 20
DEFAULT_BUDGET = 192 * MiB
ALIGN = 16
MIN_CHUNK = 16
MAX_CHUNK = 8192
ENV_VAR = "TRAJGRAD_CHUNK_BUDGET_MIB"

#: ``[chunk, V]`` buffers alive at once, per kernel.
BUFFERS = {"logprob": 1, "entropy": 2, "reverse_kl": 2, "forward_kl": 2, "jsd": 8}
#: vocabulary columns per tile when the head gets a gradient (``vocab_chunk_size="auto"``)
VOCAB_BLOCK = 2048
#: the most bytes of tile temporaries with a trainable head (a lower budget wins)
TILE_BUDGET = 4 * MiB
#: ``[chunk, VOCAB_BLOCK]`` buffers a tile keeps alive (logits and their exponentials)
TILE_BUFFERS = 2

_budget: Optional[int] = None


def _check_budget(nbytes) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes > 0 or nbytes != nbytes:
        raise ValueError(f"budget: expected a positive number of bytes, got {nbytes!r}")
    if nbytes == float("inf"):
        raise ValueError("budget: must be finite")
    return int(nbytes)


def get_chunk_budget() -> int:
    """The budget in bytes that ``chunk_size="auto"`` uses now (see the module docstring)."""
    if _budget is not None:
        return _budget
    env = os.environ.get(ENV_VAR)
    if env:
        try:
            return _check_budget(float(env) * MiB)
        except ValueError:
            raise ValueError(f"{ENV_VAR}: expected a positive number of MiB, got {env!r}") from None
    return DEFAULT_BUDGET


def set_chunk_budget(nbytes: Optional[Union[int, float]]) -> None:
    """Set the process-wide budget in bytes for ``chunk_size="auto"``; ``None`` restores the default."""
    global _budget
    _budget = None if nbytes is None else _check_budget(nbytes)


@contextlib.contextmanager
def chunk_budget(nbytes: Union[int, float]) -> Iterator[int]:
    """Within the block, ``chunk_size="auto"`` sizes chunks to ``nbytes`` of temporaries."""
    global _budget
    previous = _budget
    _budget = _check_budget(nbytes)
    try:
        yield _budget
    finally:
        _budget = previous


def _rows(nbytes: int, buffers: int, width: int, dtype: torch.dtype) -> int:
    """The largest multiple of ALIGN positions whose ``buffers`` ``[rows, width]`` temporaries fit
    ``nbytes`` (clipped to [MIN_CHUNK, MAX_CHUNK])."""
    elem = 8 if dtype == torch.float64 else 4       # bf16/fp16 statistics are formed in float32
    rows = nbytes // (buffers * max(int(width), 1) * elem)
    rows = (rows // ALIGN) * ALIGN
    return int(min(max(rows, MIN_CHUNK), MAX_CHUNK))


def auto_chunk_size(vocab: int, *, kind: str = "logprob", dtype: torch.dtype = torch.float32,
                    budget: Optional[int] = None) -> int:
    """Positions per chunk whose ``BUFFERS[kind]`` temporaries ``[chunk, vocab]`` fit ``budget`` bytes."""
    if kind not in BUFFERS:
        raise ValueError(f"kind: must be one of {', '.join(map(repr, BUFFERS))}, got {kind!r}")
    nbytes = get_chunk_budget() if budget is None else _check_budget(budget)
    return _rows(nbytes, BUFFERS[kind], vocab, dtype)


def auto_tiles(vocab: int, *, trainable_head: bool, kind: str = "logprob", dtype: torch.dtype = torch.float32,
               budget: Optional[int] = None) -> Tuple[int, int]:
    """``(positions, vocabulary columns)`` per piece of the log-prob / entropy kernels when both
    sizes are ``"auto"`` (module docstring): tiles of :data:`VOCAB_BLOCK` columns within
    ``min(budget, TILE_BUDGET)`` for a trainable head over more than ``VOCAB_BLOCK`` tokens,
    else :func:`auto_chunk_size` positions of the whole vocabulary."""
    if not isinstance(trainable_head, bool):
        raise ValueError(f"trainable_head: must be True or False, got {trainable_head!r}")
    vocab = int(vocab)
    if not trainable_head or vocab <= VOCAB_BLOCK:
        return auto_chunk_size(vocab, kind=kind, dtype=dtype, budget=budget), vocab
    if kind not in BUFFERS:
        raise ValueError(f"kind: must be one of {', '.join(map(repr, BUFFERS))}, got {kind!r}")
    nbytes = min(get_chunk_budget() if budget is None else _check_budget(budget), TILE_BUDGET)
    return _rows(nbytes, TILE_BUFFERS, VOCAB_BLOCK, dtype), VOCAB_BLOCK


def resolve_chunk_size(chunk_size, vocab: int, kind: str, dtype: torch.dtype) -> int:
    """``chunk_size`` as an int: ``"auto"`` through :func:`auto_chunk_size`, else validated."""
    if isinstance(chunk_size, str):
        if chunk_size != "auto":
            raise ValueError(f"chunk_size: must be 'auto' or a positive int, got {chunk_size!r}")
        return auto_chunk_size(vocab, kind=kind, dtype=dtype)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be 'auto' or a positive int, got {chunk_size!r}")
    return int(chunk_size)


def resolve_tiles(chunk_size, vocab_chunk_size, vocab: int, kind: str, dtype: torch.dtype,
                  trainable_head: bool) -> Tuple[int, int]:
    """``(chunk_size, vocab_chunk_size)`` as ints for the log-prob / entropy kernels.

    ``vocab_chunk_size``: ``"auto"`` (tiles for a trainable head, :func:`auto_tiles`), ``None``
    (the whole vocabulary) or a positive int (at most ``vocab``). ``chunk_size``: ``"auto"``
    sizes it to the resolved block (the tile budget for auto tiles, else the budget as in
    :func:`auto_chunk_size`), or a positive int.
    """
    V = int(vocab)
    if isinstance(vocab_chunk_size, str):
        if vocab_chunk_size != "auto":
            raise ValueError(f"vocab_chunk_size: must be 'auto', None or a positive int, got {vocab_chunk_size!r}")
        rows, block = auto_tiles(V, trainable_head=trainable_head, kind=kind, dtype=dtype)
        return (rows if chunk_size == "auto" else resolve_chunk_size(chunk_size, block, kind, dtype)), block
    if vocab_chunk_size is None:
        block = V
    elif isinstance(vocab_chunk_size, bool) or not isinstance(vocab_chunk_size, int) or vocab_chunk_size < 1:
        raise ValueError(f"vocab_chunk_size: must be 'auto', None or a positive int, got {vocab_chunk_size!r}")
    else:
        block = min(int(vocab_chunk_size), V)
    return resolve_chunk_size(chunk_size, block, kind, dtype), block

