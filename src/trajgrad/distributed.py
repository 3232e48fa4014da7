r"""Data-parallel learners with ``torch.distributed``: exact global normalization (§13).

A loss normalized by a count (valid tokens, non-empty responses) is *not* additive over
ranks. With ranks :math:`r=1..W`, local numerators :math:`N_r` and local counts
:math:`D_r`, the loss of the concatenated batch is

.. math::
    \mathcal L = \frac{\sum_r N_r}{\sum_r D_r},

whereas averaging locally normalized losses gives
:math:`\frac1W\sum_r N_r/D_r`, which reweights every token of rank :math:`r` by
:math:`\frac{\sum_s D_s}{W D_r}`: it differs from :math:`\mathcal L` as soon as ranks
hold different counts (§13, §24 last bullet). The remedy is to sum the *counts* over
ranks (and over the micro-batches of one optimizer step) before the backward pass:

* with DDP (:func:`wrap_ddp`), which *averages* gradients over the :math:`W` ranks, pass
  ``denominator=Normalizer(mode).denominator()`` to every micro-batch loss. The
  :class:`trajgrad.aggregate.Normalizer` all-reduces the count with SUM and, because
  ``torch.distributed`` is initialized, returns :math:`D_{global}/W`, so that

  .. math:: \frac1W\sum_r\nabla\frac{N_r}{D_{global}/W}=\nabla\frac{\sum_rN_r}{D_{global}}.

* without DDP, accumulate the local gradients and call :func:`sync_gradients_sum`
  (all-reduce SUM); the matching normalizer is
  ``Normalizer(mode, grad_average_over_ranks=False)``, whose denominator is
  :math:`D_{global}` itself.

For ``seq_sum_constant`` pass the same ``constant=`` (e.g. the maximum generation length)
to every micro-batch loss: its default, the padded length of the tensor it receives,
differs between micro-batches padded to different lengths.

Everything here is a no-op (or the identity) in a single process, so the same training
code runs under ``python`` and under ``torchrun``.
"""
from __future__ import annotations

import datetime
import math
import os
import zlib
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist

__all__ = [
    "DistInfo",
    "init_from_env",
    "get_info",
    "is_distributed",
    "is_main",
    "barrier",
    "cleanup",
    "shard",
    "all_reduce_metrics",
    "wrap_ddp",
    "sync_gradients_sum",
    "gather_objects",
    "sum_over_ranks",
    "min_over_ranks",
    "mean_metrics_over_ranks",
]

SHARD_STRATEGIES = ("contiguous", "strided")


class DistInfo(NamedTuple):
    """Where this process sits in the data-parallel job.

    Attributes:
      rank: global rank in ``[0, world_size)``.
      world_size: number of processes (1 when not distributed).
      local_rank: rank on this node (selects the CUDA device under NCCL).
      is_main: ``rank == 0``; the process that logs, evaluates and saves checkpoints.
    """

    rank: int
    world_size: int
    local_rank: int
    is_main: bool

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def is_distributed() -> bool:
    """True when a ``torch.distributed`` default process group is initialized."""
    return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: Optional[int] = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"{name}: environment variable required when WORLD_SIZE > 1, but it is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: environment variable must be an integer, got {raw!r}") from None


def get_info() -> DistInfo:
    """The current :class:`DistInfo`, without initializing anything.

    ``local_rank`` is read from ``LOCAL_RANK`` (defaults to the rank).
    """
    if not is_distributed():
        return DistInfo(0, 1, 0, True)
    rank = dist.get_rank()
    local_rank = _env_int("LOCAL_RANK", rank)
    return DistInfo(rank, dist.get_world_size(), local_rank, rank == 0)


def init_from_env(
    backend: Optional[str] = None,
    *,
    timeout: Optional[datetime.timedelta] = None,
) -> DistInfo:
    """Initialize ``torch.distributed`` from the variables ``torchrun`` sets.

    When ``WORLD_SIZE`` (default 1) is greater than 1, reads ``RANK``, ``LOCAL_RANK``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` and initializes the default process group with
    ``init_method="env://"``. Otherwise nothing is initialized and a single-process
    :class:`DistInfo` ``(0, 1, 0, True)`` is returned.

    Idempotent: if a default group already exists it is reused and described.

    Args:
      backend: ``"gloo"`` or ``"nccl"``; default ``"nccl"`` when CUDA is available, else
        ``"gloo"``. Under NCCL the CUDA device ``LOCAL_RANK`` is made current first.
      timeout: collective/rendezvous timeout (PyTorch's default when None).

    Raises:
      ValueError: a required variable is missing or not an integer, or the rank is out of
        range (message starts with the variable name).
    """
    if is_distributed():
        return get_info()
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE: must be >= 1, got {world_size}")
    if world_size == 1:
        return DistInfo(0, 1, 0, True)
    rank = _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(f"{name}: environment variable required when WORLD_SIZE > 1, but it is not set")
    _env_int("MASTER_PORT")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK: must lie in [0, {world_size}), got {rank}")
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK: must be >= 0, got {local_rank}")
    if not dist.is_available():  # pragma: no cover - builds without distributed support
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    kwargs: Dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size, **kwargs)
    return DistInfo(rank, world_size, local_rank, rank == 0)


def is_main() -> bool:
    """True on rank 0, and in a single process."""
    return not is_distributed() or dist.get_rank() == 0


def _collective_device(group=None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if not is_distributed():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def cleanup() -> None:
    """Destroy the default process group if one exists (safe to call twice)."""
    if is_distributed():
        dist.destroy_process_group()


def shard(items: Sequence, rank: int, world_size: int, *, strategy: str = "contiguous") -> list:
    """The part of ``items`` that ``rank`` of ``world_size`` processes.

    Deterministic, uses every item exactly once, and tolerates ``len(items)`` not divisible
    by ``world_size`` (shard sizes differ by at most one; no item is dropped or repeated,
    so ranks may hold different numbers of items, and some may hold none).

    * ``"contiguous"`` (default): consecutive blocks in order; the first
      ``len(items) % world_size`` ranks get one extra item. ``[0..9]`` over 3 ranks gives
      ``[0,1,2,3] [4,5,6] [7,8,9]``. Keeps neighbouring items (e.g. the responses of one
      GRPO group, when groups are not split elsewhere) together.
    * ``"strided"``: ``items[rank::world_size]``; ``[0..9]`` over 3 ranks gives
      ``[0,3,6,9] [1,4,7] [2,5,8]``.

    Also splits one rank's batch into micro-batches (``rank`` = micro-batch index).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: must be an integer in [0, {world_size}), got {rank!r}")
    if strategy not in SHARD_STRATEGIES:
        raise ValueError(f"strategy: must be one of {', '.join(map(repr, SHARD_STRATEGIES))}, got {strategy!r}")
    items = list(items)
    if strategy == "strided":
        return items[rank::world_size]
    base, extra = divmod(len(items), world_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return items[start:stop]


Number = Union[float, int, torch.Tensor]


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: expected a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().reshape(()).cpu().item())
    if isinstance(value, (int, float)):
        return float(value)
    raise ValueError(f"{name}: expected a number or a 1-element tensor, got {type(value).__name__}")


def _keys_hash(keys: Sequence[str]) -> float:
    # 16 bits: h and h^2 summed over up to 2^21 ranks stay exact in float64.
    return float(zlib.crc32("\x00".join(keys).encode("utf-8")) & 0xFFFF)


def all_reduce_metrics(
    metrics: Mapping[str, Number],
    weights: Optional[Union[Mapping[str, Number], Number]] = None,
    *,
    group=None,
) -> Dict[str, float]:
    r"""Mean of scalar metrics over ranks, optionally weighted, in one ``all_reduce``.

    .. math::
        \bar m_k = \frac{\sum_r w_{r,k}\, m_{r,k}}{\sum_r w_{r,k}}

    with :math:`w_{r,k}` = ``weights[k]`` on rank :math:`r` (1 for keys absent from
    ``weights``; a number applies to every key). Use a per-rank count as the weight (valid
    tokens for a token-level clip fraction, sequences for a sequence-level one) to get the
    value the metric would have on the concatenated batch.

    A rank whose weight is 0 is left out by selection, so its value may be NaN (e.g. a
    fraction over zero tokens). A key whose weights are 0 on every rank has no defined
    mean and is reported as ``nan``. A non-finite value with a positive weight propagates
    to the result: it is reported, not hidden. In a single process this is the identity
    (up to the same weight rules).

    The numerators, weights, a validity flag and a fingerprint of the key set are packed
    into one float64 tensor and reduced with one ``all_reduce(SUM)``. Every rank must
    call this with the same *number* of keys; different key names, or a negative /
    non-finite weight on any rank, raise ``ValueError`` on *every* rank after the
    collective (never on one rank only, which would leave the others waiting).

    Args:
      metrics: name -> Python number or 1-element tensor (detached on the way).
      weights: ``None`` (plain mean over ranks), a number, or name -> number; keys must be
        a subset of ``metrics``.
      group: process group (default group when None).

    Returns:
      ``dict`` name -> float, in the order of ``metrics``.
    """
    if not isinstance(metrics, Mapping):
        raise ValueError(f"metrics: expected a mapping of name -> number, got {type(metrics).__name__}")
    names = list(metrics.keys())
    for k in names:
        if not isinstance(k, str):
            raise ValueError(f"metrics: keys must be strings, got {k!r}")
    values = {k: _as_float(f"metrics: {k!r}", metrics[k]) for k in names}
    if weights is None:
        w = {k: 1.0 for k in names}
    elif isinstance(weights, Mapping):
        unknown = [k for k in weights if k not in values]
        if unknown:
            raise ValueError(f"weights: keys not in metrics: {unknown!r}")
        w = {k: _as_float(f"weights: {k!r}", weights[k]) if k in weights else 1.0 for k in names}
    else:
        scalar = _as_float("weights", weights)
        w = {k: scalar for k in names}

    ordered = sorted(names)
    n = len(ordered)
    bad = sum(1 for k in ordered if not (math.isfinite(w[k]) and w[k] >= 0.0))
    h = _keys_hash(ordered)
    num = [values[k] * w[k] if w[k] > 0.0 else 0.0 for k in ordered]
    den = [w[k] if math.isfinite(w[k]) and w[k] > 0.0 else 0.0 for k in ordered]
    packed = torch.tensor(num + den + [float(bad), h, h * h, 1.0], dtype=torch.float64)

    if is_distributed():
        t = packed.to(_collective_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        packed = t.cpu()
    world = packed[-1].item()
    if packed[-2].item() != world * h * h or packed[-3].item() != world * h:
        raise ValueError("metrics: ranks passed different metric names to all_reduce_metrics")
    if packed[2 * n].item() > 0:
        raise ValueError("weights: must be finite and >= 0 on every rank (a rank passed a negative or non-finite weight)")
    out_sorted = {}
    for i, k in enumerate(ordered):
        total_w = packed[n + i].item()
        out_sorted[k] = packed[i].item() / total_w if total_w > 0 else float("nan")
    return {k: out_sorted[k] for k in names}


def wrap_ddp(model: torch.nn.Module, **ddp_kwargs) -> torch.nn.Module:
    """Wrap ``model`` in ``DistributedDataParallel`` when distributed; else return it.

    Defaults: ``find_unused_parameters=False`` (every trainable parameter must get a
    gradient in every backward; a frozen base under LoRA has ``requires_grad=False`` and
    is ignored by DDP). On CPU/gloo no ``device_ids`` are passed; under NCCL
    ``device_ids=[current CUDA device]`` and the model must already be on that device.
    Extra keyword arguments go to ``DistributedDataParallel``.

    DDP averages gradients over ranks: pair it with the default
    :class:`trajgrad.aggregate.Normalizer` (``grad_average_over_ranks`` True when
    distributed). Use ``model.no_sync()`` for all but the last micro-batch of a step.
    """
    if not is_distributed():
        return model
    from torch.nn.parallel import DistributedDataParallel

    kwargs: Dict[str, Any] = {"find_unused_parameters": False}
    if dist.get_backend(ddp_kwargs.get("process_group")) == "nccl":
        device = torch.cuda.current_device()
        kwargs["device_ids"] = [device]
        kwargs["output_device"] = device
    kwargs.update(ddp_kwargs)
    return DistributedDataParallel(model, **kwargs)


def sync_gradients_sum(params: Iterable[torch.nn.Parameter], *, group=None) -> None:
    r"""All-reduce (SUM) the ``.grad`` of ``params`` in place, for code without DDP.

    After every rank has accumulated its local gradient
    :math:`\sum_{m}\nabla N_{r,m}/D_{global}`, the sum over ranks is the gradient of the
    global loss exactly when the losses used ``denominator=`` from
    ``Normalizer(mode, grad_average_over_ranks=False)`` (the global count, not divided by
    the world size). With DDP use :func:`wrap_ddp` and the default normalizer instead.

    Parameters with ``requires_grad=False`` are skipped; a trainable parameter whose
    ``.grad`` is None gets a zero gradient first, so that every rank reduces the same
    tensors. Gradients are flattened per (device, dtype) and reduced in one call each.
    No-op in a single process.
    """
    params = [p for p in params if p.requires_grad]
    if not is_distributed() or not params:
        return
    buckets: Dict[tuple, List[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets.setdefault((p.grad.device, p.grad.dtype), []).append(p)
    for key in sorted(buckets, key=lambda k: (str(k[0]), str(k[1]))):
        grads = [p.grad for p in buckets[key]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n


def gather_objects(value: Any) -> list:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` in a single process."""
    if not is_distributed():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def sum_over_ranks(value: Number) -> float:
    """The sum of a number over ranks (float64; the identity in a single process)."""
    v = _as_float("value", value)
    if not is_distributed():
        return v
    t = torch.tensor([v], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def min_over_ranks(value: int) -> int:
    """The minimum of an integer over ranks (the identity in a single process)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"value: expected an integer, got {value!r}")
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.long, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def mean_metrics_over_ranks(metrics: Mapping[str, Any], weight: float = 1.0) -> Dict[str, float]:
    r"""Mean over ranks of each finite numeric metric, over the union of keys:
    :math:`\sum_r w_r m_{r,k} / \sum_r w_r` over the ranks that hold key :math:`k` with a
    finite value and a positive weight (``weight``: this rank's, e.g. its number of pairs,
    so that a per-item mean becomes the mean over every rank's items; default 1, the plain
    mean over ranks).

    Unlike :func:`all_reduce_metrics` the ranks may log different keys (a rank that held
    no data skipped a phase). In a single process the metrics are returned unchanged.
    """
    w = _as_float("weight", weight)
    if not math.isfinite(w) or w < 0:
        raise ValueError(f"weight: must be finite and >= 0, got {weight!r}")
    if not is_distributed():
        return dict(metrics)
    every = gather_objects((dict(metrics), w))
    keys = sorted(set().union(*[m.keys() for m, _ in every]))
    out: Dict[str, float] = {}
    for k in keys:
        vals = [(float(m[k]), wr) for m, wr in every
                if k in m and isinstance(m[k], (int, float)) and math.isfinite(m[k]) and wr > 0]
        if vals:
            out[k] = float(sum(v * wr for v, wr in vals) / sum(wr for _, wr in vals))
    return out
