r"""Explicit aggregation of per-token terms into one scalar (spec §13).

Let sequence :math:`i` have :math:`L_i = \sum_j m_{ij}` valid action tokens and let
:math:`x_{ij}` be a per-token term (for example a surrogate). The five modes are

=======================  ==============================================================
``token_mean``           :math:`\sum_{ij} m_{ij} x_{ij} \,/\, D`,  :math:`D=\sum_i L_i`
                         (DAPO; every token weighs the same)
``seq_mean_token_mean``  :math:`\sum_i \frac{1}{L_i}\sum_j m_{ij} x_{ij} \,/\, D`,
                         :math:`D = \#\{i: L_i>0\}` (GRPO, GSPO, SAPO; every response
                         weighs the same)
``seq_mean_token_sum``   :math:`\sum_{ij} m_{ij} x_{ij} \,/\, D`,  :math:`D = \#\{i: L_i>0\}`
                         (sum over tokens, mean over responses)
``seq_sum_constant``     :math:`\sum_{ij} m_{ij} x_{ij} \,/\, (C\,D)`,
                         :math:`D = \#\{i: L_i>0\}`, :math:`C` a constant that does not
                         depend on the sample (Dr. GRPO; default :math:`C` = the padded
                         length ``L``; with micro-batches of different padded
                         lengths pass it explicitly, e.g. the maximum generation length)
``token_sum``            :math:`\sum_{ij} m_{ij} x_{ij} \,/\, D`,  :math:`D = 1` (no
                         normalization at all: the plain sum over valid tokens)
=======================  ==============================================================

Sequences with no valid token are not counted: appending all-padding rows leaves every
mode unchanged (§24 "padding/repacking does not change globally normalized loss").

``denominator=`` replaces :math:`D` by a caller-supplied count, typically the count over
all micro-batches of an optimizer step and all data-parallel ranks (see
:class:`Normalizer`). Then the *sum* of the micro-batch/rank losses equals the loss of the
concatenated batch, which averaging locally normalized losses does not (§13).

``token_sum`` has :math:`D=1` locally and needs no global count: the sum over micro-batches
is already the sum over the batch. A ``denominator=`` passed with it is still honoured
(the loss is :math:`\sum m x / D`), which expresses any *fixed* normalizer: e.g. verl's
``seq-mean-token-sum-norm`` (:math:`\sum_{ij} m_{ij}x_{ij}/C`, no division by the number of
responses) is ``token_sum`` with ``denominator=C``; TRL's ``dr_grpo``
(:math:`\sum m x/(B\,C_{max})`, :math:`B` every row, empty or not) is ``token_sum`` with
``denominator=B*max_completion_length``. :class:`Normalizer` returns :math:`1` for it (or
:math:`1/W` under gradient averaging over :math:`W` ranks).

A denominator or constant must be positive and finite: an infinite one would turn every
loss into an exact 0 and silently stop training.

Masked positions are removed by selection, so NaN/inf stored there never reaches the
result or its gradient.
"""
from __future__ import annotations

from typing import Iterable, Optional, Union

import torch

from . import _checks
from ._aggregation import MODES, aggregate_valid, validate_mode

Number = Union[float, int, torch.Tensor]


def local_count(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The local value of :math:`D` for ``mode``: valid tokens, non-empty sequences, or 1 (``token_sum``)."""
    mask = _checks.check_mask("mask", mask)
    _checks.check_ndim("mask", mask, 2)
    _checks.check_choice("mode", mode, MODES)
    if mode == "token_mean":
        return mask.sum().to(torch.float64)
    if mode == "token_sum":
        return torch.ones((), dtype=torch.float64)
    return mask.any(-1).sum().to(torch.float64)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    *,
    constant: Optional[float] = None,
    denominator: Optional[Number] = None,
) -> torch.Tensor:
    """Aggregate ``per_token`` ``[B, L]`` over ``mask`` ``[B, L]`` into a scalar.

    Args:
      per_token: ``[B, L]`` floating tensor; values at ``mask == 0`` are ignored (may be
        NaN/inf).
      mask: ``[B, L]`` 0/1 (or bool) mask of action tokens.
      mode: one of :data:`MODES` (see module docstring for the formulas).
      constant: :math:`C` for ``seq_sum_constant``; defaults to ``L``.
      denominator: overrides :math:`D` (a global count over micro-batches / ranks). Must be
        positive and finite; a zero local count with no override yields 0 (nothing to
        aggregate). With ``token_sum`` the default is 1.

    Returns:
      A scalar tensor, differentiable w.r.t. ``per_token`` at valid positions only.
    """
    per_token = _checks.as_tensor("per_token", per_token)
    _checks.check_ndim("per_token", per_token, 2)
    _checks.check_floating("per_token", per_token)
    mask = _checks.check_mask("mask", mask, per_token.shape)
    validate_mode(mode, constant)
    return aggregate_valid(per_token, mask, mode, constant=constant, denominator=denominator)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean of ``x`` over ``mask`` (``aggregate(..., "token_mean")``), any shape."""
    mask = _checks.check_mask("mask", mask, x.shape)
    return _checks.fill_masked(x, mask).sum() / mask.sum().clamp_min(1).to(x.dtype)


class Normalizer:
    """Global denominator for one optimizer step across micro-batches and ranks (§13).

    Usage::

        norm = Normalizer("token_mean")
        for mb in micro_batches:
            norm.add(mb.mask)
        d = norm.denominator()            # all-reduced (SUM) over ranks if distributed
        for mb in micro_batches:
            loss = ppo_clip_loss(..., mb.mask, denominator=d).loss
            loss.backward()               # gradients accumulate to the full-batch gradient

    Numerators and denominators are *summed* over micro-batches and ranks before the
    backward pass; locally normalized losses are never averaged.

    ``grad_average_over_ranks``: data-parallel wrappers (DDP, FSDP) average gradients over
    the world size ``W``. To make the averaged gradient equal the gradient of the global
    loss, :meth:`denominator` then returns :math:`D_{global} / W`. It defaults to True
    exactly when ``torch.distributed`` is initialized; pass False if you reduce gradients
    with a sum.
    """

    def __init__(
        self,
        mode: str = "token_mean",
        *,
        constant: Optional[float] = None,
        process_group=None,
        grad_average_over_ranks: Optional[bool] = None,
    ) -> None:
        validate_mode(mode, constant)
        self.mode = mode
        self.constant = constant
        self.process_group = process_group
        self.grad_average_over_ranks = grad_average_over_ranks
        self._local = torch.zeros((), dtype=torch.float64)
        self._global: Optional[torch.Tensor] = None

    @classmethod
    def from_masks(cls, masks: Iterable[torch.Tensor], mode: str = "token_mean", **kwargs) -> "Normalizer":
        norm = cls(mode, **kwargs)
        for m in masks:
            norm.add(m)
        return norm

    def add(self, mask: torch.Tensor) -> None:
        if self._global is not None:
            raise ValueError("mask: cannot add after denominator() was computed; call reset()")
        self._local = self._local + local_count(mask, self.mode).cpu()

    def reset(self) -> None:
        self._local = torch.zeros((), dtype=torch.float64)
        self._global = None

    @property
    def local_count(self) -> float:
        return float(self._local)

    def global_count(self) -> torch.Tensor:
        """Sum of the counts over all micro-batches and (if initialized) all ranks (1 for ``token_sum``)."""
        if self._global is None and self.mode == "token_sum":
            self._global = torch.ones((), dtype=torch.float64)
        if self._global is None:
            total = self._local.clone()
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                backend = dist.get_backend(self.process_group)
                device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
                t = total.to(device)
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
                total = t.cpu()
            self._global = total
        return self._global

    def denominator(self) -> torch.Tensor:
        """The ``denominator=`` to pass to each micro-batch loss (see class docstring).

        ``token_sum``: 1 (nothing to count), divided by ``W`` under gradient averaging.
        """
        total = self.global_count().clamp_min(1.0)
        dist = torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        average = self.grad_average_over_ranks
        if average is None:
            average = distributed
        if average and distributed:
            total = total / dist.get_world_size(self.process_group)
        return total

    def aggregate(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return aggregate(per_token, mask, self.mode, constant=self.constant, denominator=self.denominator())
