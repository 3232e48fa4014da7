r"""Full fine-tuning beyond one device: FSDP2 (``torch.distributed.fsdp.fully_shard``) (§13).

With ``dist.fsdp: true`` under ``torchrun``, every decoder layer of the policy is sharded
over the ranks with ``fully_shard``: each rank stores ``1/W`` of each layer's parameters,
gradients and AdamW moments, and all-gathers a layer just before it runs. The embeddings,
the final norm and the output head stay replicated (the learner and the lean decode step
read them directly, outside any module's ``forward``); their gradients are summed with
:func:`trajgrad.distributed.sync_gradients_sum` like every non-FSDP parameter.

**The reduction is a sum.** Every loss of an update step is normalized by the step's
*global* count :math:`D_{global}` (summed over micro-batches and ranks before the backward
pass, ``Normalizer(mode, grad_average_over_ranks=False)``), so rank :math:`r` holds
:math:`\nabla N_r / D_{global}` and the single-process gradient is the *sum* over ranks:

.. math:: \sum_r \nabla\frac{N_r}{D_{global}} = \nabla\frac{\sum_r N_r}{D_{global}}.

FSDP's reduce-scatter averages by default (it divides by :math:`W`), which would give
:math:`1/W` of that gradient. :func:`shard_model` sets the divide factor of every sharded
group to 1 (``set_gradient_divide_factor(1.0)``): the reduce-scatter then sums, and
:func:`sync_gradients` (sum for replicated parameters, nothing more for sharded ones)
leaves every parameter holding its shard of the exact single-process gradient, also when
ranks hold unequal numbers of sequences and tokens.

Checkpoints: :func:`full_state_dict` gathers the full (unsharded) tensors on every rank
(a collective: every rank calls it), so rank 0 writes an ordinary checkpoint that a single
process loads (:func:`full_state_module`, and :func:`full_optimizer_state` for AdamW's
moments); :func:`load_full_state_dict` puts such a state back into a sharded model.

Sampling and evaluation run inside :func:`gathered` (every layer held unsharded), because
ranks sample different numbers of tokens and only rank 0 evaluates, while a sharded layer
all-gathers in every forward. Every learner forward outside it is one call per micro-batch
on every rank (no shared-prefix split, :func:`trajgrad.model.learner.head_inputs`).

Every rank runs the same number of micro-batches (:func:`micro_batch_plan`): FSDP's
collectives run in every forward and backward pass.

LoRA keeps replicated adapters with summed gradients (no FSDP): the adapters are small and
the frozen base holds no gradient or optimizer state.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Iterator, List, Mapping

import torch
from torch import nn

from .. import distributed as dist_lib
from ..model.parts import causal_parts
from ..weights.state import is_peft

__all__ = [
    "is_sharded",
    "is_fsdp_model",
    "decoder_layers",
    "shard_model",
    "active",
    "micro_batch_plan",
    "sync_gradients",
    "clip_grad_norm",
    "full_state_dict",
    "load_full_state_dict",
    "full_state_module",
    "full_optimizer_state",
    "gathered",
]


def is_sharded(p: torch.Tensor) -> bool:
    """True for a parameter FSDP manages (a ``DTensor`` shard)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without distributed support
        return False
    return isinstance(p, DTensor)


def _fsdp_modules(model: nn.Module) -> List[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_fsdp_model(model: nn.Module) -> bool:
    """True when :func:`shard_model` (or any ``fully_shard``) sharded part of ``model``."""
    return bool(_fsdp_modules(model))


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers``)."""
    if is_peft(model):
        raise ValueError("dist.fsdp: shards full fine-tuning; a LoRA model keeps replicated adapters "
                         "(set model.lora: null, or dist.fsdp: false)")
    backbone, _ = causal_parts(model)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError("model: expected a causal LM whose backbone has a non-empty .layers ModuleList to shard")
    return list(layers)


_SHARDED = [False]  # whether this process sharded a model (micro-batch counts must then agree)


def active() -> bool:
    """True once :func:`shard_model` sharded a model in this (distributed) process."""
    return _SHARDED[0] and dist_lib.is_distributed()


def micro_batch_plan(n: int, size: int) -> List[List[int]]:
    r"""Row indices of this rank's micro-batches when every rank must run the *same number*
    of forward/backward passes (FSDP all-gathers a layer in every forward and reduce-scatters
    its gradient in every backward: a rank with one micro-batch fewer would leave the others
    waiting). The count is :math:`K=\max_r\lceil n_r/	ext{size}
ceil`; each rank splits its
    :math:`n_r` rows into :math:`K` consecutive blocks (sizes differ by at most one, none
    larger than ``size``). The global denominators make the result independent of the split.

    Raises:
      ValueError: on every rank, when some rank holds fewer than :math:`K` rows (it would
        need an empty micro-batch); names ``train.micro_batch_size``.
    """
    k = -dist_lib.min_over_ranks(-((n + size - 1) // size))
    if dist_lib.min_over_ranks(n - k) < 0:
        raise ValueError(f"train.micro_batch_size: under dist.fsdp every rank runs {k} micro-batches this step, "
                         f"but a rank holds fewer than {k} rows; raise train.micro_batch_size")
    return [p for p in (dist_lib.shard(list(range(n)), i, k) for i in range(k)) if p]


def shard_model(model: nn.Module, *, reshard_after_forward: bool = True) -> nn.Module:
    """Shard every decoder layer of ``model`` over the default process group, in place.

    Gradients are *summed* over ranks (divide factor 1): pair with the global denominators
    of :func:`trajgrad.train.updates.global_denominator` (see the module docstring). A
    single process (no process group) returns ``model`` unchanged. Build the optimizer
    *after* sharding (it must hold the sharded parameters).

    Raises:
      ValueError: ``model`` is a peft (LoRA) model, or has no decoder layers.
    """
    layers = decoder_layers(model)
    if not dist_lib.is_distributed():
        return model
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
        layer.set_gradient_divide_factor(1.0)
        # plain SUM collectives (a custom factor may otherwise use PREMUL_SUM, which gloo lacks)
        layer.set_force_sum_reduction_for_comms(True)
    _SHARDED[0] = True
    return model


def sync_gradients(params: Iterable[nn.Parameter]) -> None:
    """Sum gradients over ranks: replicated parameters with an all-reduce
    (:func:`trajgrad.distributed.sync_gradients_sum`); FSDP shards are already summed by
    their reduce-scatter. A trainable sharded parameter without a gradient gets zeros."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        if is_sharded(p) and p.grad is None:
            p.grad = torch.zeros_like(p)
    dist_lib.sync_gradients_sum([p for p in params if not is_sharded(p)])


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> float:
    r"""Clip the global gradient norm :math:`\lVert g\rVert_2` over every parameter (sharded
    or replicated) to ``max_norm``; returns the norm before clipping, the same number on
    every rank and the one a single process would compute."""
    params = [p for p in params if p.grad is not None]
    sharded = [p for p in params if is_sharded(p)]
    if not sharded:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    sq = torch.zeros((), dtype=torch.float64)
    for p in sharded:  # the squared norm of this rank's shards, summed over ranks
        sq = sq + p.grad.to_local().detach().double().pow(2).sum().cpu()
    sq = torch.tensor(dist_lib.sum_over_ranks(sq), dtype=torch.float64)
    for p in params:
        if not is_sharded(p):  # replicated: the same on every rank, counted once
            sq = sq + p.grad.detach().double().pow(2).sum().cpu()
    total = float(sq.sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in params:
            g = p.grad.to_local() if is_sharded(p) else p.grad
            g.mul_(coef)
    return total


def full_state_dict(model: nn.Module, *, trainable_only: bool = False) -> Dict[str, torch.Tensor]:
    """Every parameter (and, unless ``trainable_only``, buffer) of ``model`` as a full CPU
    tensor, by ``state_dict`` name. Sharded parameters are all-gathered: a collective that
    every rank must call. Works unchanged on a model that is not sharded."""
    out: Dict[str, torch.Tensor] = {}
    source = model.named_parameters() if trainable_only else model.state_dict().items()
    for name, t in source:
        if trainable_only and not t.requires_grad:
            continue
        full = t.full_tensor() if is_sharded(t) else t
        out[name] = full.detach().to("cpu", copy=True)
    return out


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy full tensors (from :func:`full_state_dict` or a single-process checkpoint) into
    ``model``, each rank keeping its shard of the sharded parameters.

    Raises:
      ValueError: ``state`` misses a key or has one ``model`` lacks (with ``strict``), or a
        shape differs (names the key).
    """
    own = dict(model.state_dict(keep_vars=True))
    missing = [k for k in own if k not in state]
    unknown = [k for k in state if k not in own]
    if strict and (missing or unknown):
        raise ValueError(f"state: missing keys {missing[:5]!r}, unexpected keys {unknown[:5]!r}")
    with torch.no_grad():
        for name, value in state.items():
            if name not in own:
                continue
            t = own[name]
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(f"state: {name!r} has shape {tuple(value.shape)}, the model {tuple(t.shape)}")
            if is_sharded(t):
                from torch.distributed.tensor import distribute_tensor

                shard = distribute_tensor(value.to(t.dtype), t.device_mesh, t.placements)
                t.to_local().copy_(shard.to_local())
            else:
                t.copy_(value)


class _FullState(nn.Module):
    """A module whose parameters are given full tensors, named as in the sharded model."""

    def __init__(self, tensors: Dict[str, torch.Tensor], trainable: set):
        super().__init__()
        self._full = {n: nn.Parameter(t, requires_grad=n in trainable) for n, t in tensors.items()}

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        yield from ((prefix + n, p) for n, p in self._full.items())

    def state_dict(self, *args, **kwargs):
        return {n: p.detach() for n, p in self._full.items()}


def full_state_module(model: nn.Module) -> nn.Module:
    """What a checkpoint saves of a sharded ``model``: a module holding the full (gathered)
    parameters under their usual names, so that :func:`trajgrad.train.checkpoint.save_checkpoint`
    writes an ordinary checkpoint a single process loads. ``model`` itself when nothing is
    sharded. A collective: every rank calls it (rank 0 then saves)."""
    if not is_fsdp_model(model):
        return model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    tensors = {n: (p.full_tensor() if is_sharded(p) else p).detach().to("cpu", copy=True)
               for n, p in model.named_parameters()}
    return _FullState(tensors, trainable)


class _FullOptimizerState:
    """What a checkpoint saves of an optimizer over sharded parameters (``state_dict()`` only)."""

    def __init__(self, state: Dict):
        self._state = state

    def state_dict(self) -> Dict:
        return self._state

    def load_state_dict(self, state: Dict) -> None:  # a save-side view only
        raise ValueError("optimizers: a gathered optimizer state is written, not loaded into (load it into "
                         "a single-process optimizer)")


def full_optimizer_state(optimizer: torch.optim.Optimizer):
    """What a checkpoint saves of ``optimizer``: an object whose ``state_dict()`` is the
    optimizer's, with every sharded state tensor (AdamW's moments of a sharded parameter)
    all-gathered into a full CPU tensor, so that it is the state a single process would
    hold. ``optimizer`` itself when nothing in it is sharded. A collective: every rank calls
    it, in the same order (rank 0 then saves)."""
    sd = optimizer.state_dict()
    if not any(is_sharded(v) for st in sd["state"].values() for v in st.values()):
        return optimizer
    state = {}
    for key in sorted(sd["state"]):  # the same order on every rank (one all-gather each)
        state[key] = {n: (v.full_tensor().detach().to("cpu", copy=True) if is_sharded(v) else v)
                      for n, v in sd["state"][key].items()}
    return _FullOptimizerState({"state": state, "param_groups": sd["param_groups"]})


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Hold every sharded layer of ``model`` unsharded inside the block, resharded on exit.

    Sampling runs a different number of forward passes on each rank (episodes end at
    different lengths; only rank 0 evaluates), while a sharded layer all-gathers in every
    forward: inside this block forwards issue no collective, so ranks may sample freely.
    Entering and leaving are collectives (every rank enters, e.g. around the rollout and
    the evaluation). A no-op for a model that is not sharded. Not for backward passes.
    """
    mods = _fsdp_modules(model)
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)
