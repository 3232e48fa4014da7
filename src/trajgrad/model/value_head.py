"""Token-wise critics (§20.3): a value head on the policy backbone's hidden states
(:class:`ValueHead`), or a critic with a backbone of its own (:class:`CriticModel`,
``critic.path``)."""
from __future__ import annotations

import torch
from torch import nn

from .learner import head_inputs
from .parts import causal_parts

__all__ = ["CriticModel", "ValueHead"]


class ValueHead(nn.Module):
    """Token-wise critic V(h_t) on the policy backbone's hidden states (detached input).

    ``values[b, j]`` is the value of the prefix that predicts target ``j`` (aligned with the
    targets, like every per-token tensor). The input is detached so that critic updates
    never move the policy; K critic updates per actor update (§20.3) reuse the cached
    hidden states.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.Tanh(), nn.Linear(hidden_size, 1))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    #: it reads the policy's hidden states (``CriticModel`` reads the token ids instead)
    reads_tokens = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.values(hidden.detach())

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, L]`` values of ``[B, L, H]`` hidden states (gradient kept into ``hidden``)."""
        return self.net(hidden.to(self.net[0].weight.dtype)).squeeze(-1)


class CriticModel(nn.Module):
    r"""A critic with its own backbone: :math:`V(s_j)=\mathrm{head}(h^{c}_j)`, where
    :math:`h^{c}` are the final hidden states of a separate causal LM (``critic.path``) on the
    same tokens (§20.3).

    ``forward(batch)`` reads ``batch.input_ids`` ``[B, T]`` and ``batch.attention_mask`` and
    returns ``[B, T-1]`` values aligned with the targets, like :class:`ValueHead` on the
    policy's hidden states. The backbone and the head both train (the critic optimizer holds
    every parameter of this module); the policy is never touched, so a critic update cannot
    move it. The backbone must read the policy's token ids (the same tokenizer; the builder
    checks it); its size and architecture may differ. Its output head is not used.
    """

    reads_tokens = True

    def __init__(self, backbone: nn.Module):
        super().__init__()

        self.backbone = backbone
        self.head = ValueHead(causal_parts(backbone)[1].weight.shape[1])
        for p in self.backbone.parameters():
            p.requires_grad_(True)
        out = getattr(backbone, "get_output_embeddings", lambda: None)()
        tied = out is not None and out.weight is getattr(backbone.get_input_embeddings(), "weight", None)
        if out is not None and not tied:  # the LM head never enters a value
            out.weight.requires_grad_(False)

    def forward(self, batch) -> torch.Tensor:
        hidden, _, _ = head_inputs(self.backbone, batch.input_ids, batch.attention_mask)
        return self.head.values(hidden)
