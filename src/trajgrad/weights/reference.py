r"""pi_ref: a frozen snapshot of a policy's trainable parameters (the KL reference, §9).

The reference policy of a KL term is the policy as it stands when RL starts, that is after
the SFT warm start when there is one. :class:`ReferenceWeights` keeps a frozen copy of the
policy's trainable parameters at that moment (with LoRA: only the adapters; the frozen base
weights are shared) and swaps it in while the reference log-probs are computed.
:class:`ReferenceModel` is the other kind of pi_ref: a separate frozen model (``reference.path``,
a checkpoint with the policy's tokenizer), used as is. Both are entered the same way,
``with ref.applied(policy) as model:``, and ``model`` computes pi_ref.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch

__all__ = ["ReferenceModel", "ReferenceWeights"]


class ReferenceWeights(torch.nn.Module):
    """pi_ref: a frozen snapshot of ``model``'s trainable parameters (the KL reference, §9).

    ``ReferenceWeights(model)`` copies every parameter with ``requires_grad`` (all weights
    of a fully fine-tuned model; only the adapters of a LoRA model). ``with ref.applied(model):``
    points those parameters at the snapshot, so the model computes pi_ref, and restores them
    on exit. Nothing is copied on entry or exit (the parameters' ``.data`` are swapped), so use
    it under ``torch.no_grad()`` and with no autograd graph of the model pending.

    The snapshot is a module whose parameters are the saved weights, so a checkpoint keeps
    it and a resumed run computes the same pi_ref; the snapshot is never given to an optimizer.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("model: has no trainable parameters to snapshot as the reference")
        self.names: List[str] = [n for n, _ in named]
        # requires_grad=True only marks them as the state a checkpoint must keep
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone()) for _, p in named])

    def _targets(self, model: torch.nn.Module) -> List[torch.nn.Parameter]:
        params = dict(model.named_parameters())
        out = []
        for name, ref in zip(self.names, self.weights):
            p = params.get(name)
            if p is None or p.shape != ref.shape:
                raise ValueError(f"model: parameter {name!r} does not match the reference snapshot")
            out.append(p)
        return out

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """Run ``model`` as pi_ref for the duration of the block (the block receives ``model``)."""
        targets = self._targets(model)
        saved = [p.data for p in targets]
        try:
            for p, ref in zip(targets, self.weights):
                p.data = ref.data
            yield model
        finally:
            for p, data in zip(targets, saved):
                p.data = data


class ReferenceModel(torch.nn.Module):
    """pi_ref: a separate frozen causal LM (``reference.path``; the KL term, §9, and DPO, §10).

    ``ReferenceModel(model)`` freezes ``model`` (eval mode, no parameter requires a
    gradient) and keeps it as the reference; ``with ref.applied(policy) as m:`` yields that
    model (the policy is left untouched), so the caller computes the reference log-probs
    with ``m`` exactly as with :class:`ReferenceWeights`. The model must share the policy's
    tokenizer (the KL compares log-probs of the same token ids); the builder checks it.

    Nothing of it is trainable, so a checkpoint stores no weights for it: a resumed run
    loads the same frozen model from its path again.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        self.train(False)

    def train(self, mode: bool = True) -> "ReferenceModel":
        """The reference stays in eval mode (no dropout) whatever its parent's mode."""
        return super().train(False)

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The frozen reference model for the duration of the block (``model``, the policy, is not used)."""
        yield self.model
