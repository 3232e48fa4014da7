r"""A small router producing per-position teacher weights :math:`w_i(h)` for §15's "learned" option."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _checks

__all__ = ["TeacherRouter"]

GATES = ("softmax", "sigmoid")


class TeacherRouter(torch.nn.Module):
    r"""Per-position teacher weights from features, for :func:`multi_teacher_distill_loss`.

    .. math::

       u(h) = (U\,\mathrm{sg}[h] + c)/\tau \in \mathbb R^M,\qquad
       w_i(h) = \operatorname{softmax}_i\,u(h)\ \ (\texttt{gate="softmax"})
       \quad\text{or}\quad w_i(h) = \sigma(u_i(h))\ \ (\texttt{gate="sigmoid"})

    ``U`` (``[M, H]``) and ``c`` (``[M]``) start at zero, so an untrained router gives the
    uniform weights :math:`1/M` (softmax) or :math:`1/2` each (sigmoid). Softmax weights
    already sum to 1 (``renormalize`` in the loss then changes nothing); sigmoid gates are
    independent, and ``renormalize=False`` keeps them so.

    **Detached.** With ``detach_input=True`` (default) the router reads :math:`\mathrm{sg}[h]`:
    its parameters receive the gradient of the loss w.r.t. the weights
    (:math:`\omega_n\mathrm{KL}_i(h_n)`, see :func:`multi_teacher_distill_loss`), and
    nothing flows back into the features, so the student's representation is not trained
    to make routing easier. ``detach_input=False`` lets that gradient reach the features.

    Args:
      hidden_size: ``H``, the feature size.
      num_teachers: ``M >= 1``.
      gate: ``"softmax"`` or ``"sigmoid"``.
      temperature: :math:`\tau > 0`.
      detach_input: read the features detached (above).

    Shapes: ``forward(hidden [B, L, H], mask=None) -> [M, B, L]`` (the layout the loss
    takes). With ``mask`` (``[B, L]``) the features at masked positions are replaced by 0
    *by selection* before the projection, so NaN/inf there cannot reach the router's
    parameter gradient (the loss does this itself when it calls the router).
    """

    def __init__(self, hidden_size: int, num_teachers: int, *, gate: str = "softmax", temperature: float = 1.0,
                 detach_input: bool = True) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_teachers", num_teachers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        _checks.check_choice("gate", gate, GATES)
        _checks.check_positive("temperature", float(temperature))
        self.gate = gate
        self.temperature = float(temperature)
        self.detach_input = bool(detach_input)
        self.proj = torch.nn.Linear(hidden_size, num_teachers)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    @property
    def num_teachers(self) -> int:
        return int(self.proj.out_features)

    def forward(self, hidden: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = _checks.as_tensor("hidden", hidden)
        _checks.check_ndim("hidden", hidden, 3)
        if hidden.shape[-1] != self.proj.in_features:
            raise ValueError(f"hidden: expected a last dimension of {self.proj.in_features}, "
                             f"got shape {tuple(hidden.shape)}")
        x = hidden.detach() if self.detach_input else hidden
        if mask is not None:
            mask = _checks.check_mask("mask", mask, hidden.shape[:-1])
            x = torch.where(mask[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))
        u = self.proj(x.to(self.proj.weight.dtype)) / self.temperature          # [B, L, M]
        w = torch.softmax(u, dim=-1) if self.gate == "softmax" else torch.sigmoid(u)
        return w.permute(2, 0, 1)                                                # [M, B, L]
