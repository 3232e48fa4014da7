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
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Union

import torch

__all__ = ["DEFAULT_BUDGET", "BUFFERS", "ALIGN", "MIN_CHUNK", "MAX_CHUNK", "auto_chunk_size", "resolve_chunk_size",
           "get_chunk_budget", "set_chunk_budget", "chunk_budget"]

MiB = 2 ** 20
DEFAULT_BUDGET = 192 * MiB
ALIGN = 16
MIN_CHUNK = 16
MAX_CHUNK = 8192
ENV_VAR = "TRAJGRAD_CHUNK_BUDGET_MIB"

#: ``[chunk, V]`` buffers alive at once, per kernel.
BUFFERS = {"logprob": 1, "entropy": 2, "reverse_kl": 2, "forward_kl": 2, "jsd": 8}

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


def auto_chunk_size(vocab: int, *, kind: str = "logprob", dtype: torch.dtype = torch.float32,
                    budget: Optional[int] = None) -> int:
    """Positions per chunk whose ``BUFFERS[kind]`` temporaries ``[chunk, vocab]`` fit ``budget`` bytes."""
    if kind not in BUFFERS:
        raise ValueError(f"kind: must be one of {', '.join(map(repr, BUFFERS))}, got {kind!r}")
    nbytes = get_chunk_budget() if budget is None else _check_budget(budget)
    elem = 8 if dtype == torch.float64 else 4       # bf16/fp16 statistics are formed in float32
    rows = nbytes // (BUFFERS[kind] * max(int(vocab), 1) * elem)
    rows = (rows // ALIGN) * ALIGN
    return int(min(max(rows, MIN_CHUNK), MAX_CHUNK))


def resolve_chunk_size(chunk_size, vocab: int, kind: str, dtype: torch.dtype) -> int:
    """``chunk_size`` as an int: ``"auto"`` through :func:`auto_chunk_size`, else validated."""
    if isinstance(chunk_size, str):
        if chunk_size != "auto":
            raise ValueError(f"chunk_size: must be 'auto' or a positive int, got {chunk_size!r}")
        return auto_chunk_size(vocab, kind=kind, dtype=dtype)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be 'auto' or a positive int, got {chunk_size!r}")
    return int(chunk_size)
