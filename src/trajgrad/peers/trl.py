r"""TRL's own GRPO loss code behind verify's adapter signature (TRL 1.16).

TRL computes its loss inside ``GRPOTrainer._compute_loss(self, model, inputs)``. The adapter
calls that method itself — TRL's code, unchanged — on a minimal trainer state that holds
only the attributes the method reads, and whose ``_get_per_token_logps_and_entropies``
returns the log-probs under test (so gradients flow from TRL's loss back to them). Nothing of
TRL's formula is re-written here.

``loss_fn(logp, old_logp, advantages, mask[, denominator=][, ref_logp=])``: ``denominator`` is
passed as TRL's ``num_items_in_batch`` for the loss types that read it (``dapo``, ``cispo``,
``vespo``);
``ref_logp`` as ``ref_per_token_logps`` when ``beta > 0``.
"""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Callable, Optional

import torch

PINNED = "1.16.0"
# TRL's loss types that divide by the accumulated batch's token count (``num_items_in_batch``)
GLOBAL_COUNT_TYPES = ("dapo", "cispo", "vespo")


class _Accelerator:
    """The accelerator calls ``_compute_loss`` makes, for one process."""

    num_processes = 1
    sync_gradients = True

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x


def _state(loss_type: str, *, beta: float, epsilon_low: float, epsilon_high: float, importance_sampling_level: str,
           max_completion_length: Optional[int], use_bias_correction_kl: bool, delta: Optional[float],
           sapo_temperature_pos: float, sapo_temperature_neg: float):
    args = SimpleNamespace(use_bias_correction_kl=use_bias_correction_kl, delta=delta,
                           sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                           steps_per_generation=1, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                           vespo_lambda_neg=2.0)
    return SimpleNamespace(
        loss_type=loss_type, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
        importance_sampling_level=importance_sampling_level, max_completion_length=max_completion_length,
        args=args, aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, accelerator=_Accelerator(),
    )


def grpo_loss(
    loss_type: str = "grpo",
    *,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: Optional[float] = None,
    importance_sampling_level: str = "token",
    max_completion_length: Optional[int] = None,
    use_bias_correction_kl: bool = False,
    delta: Optional[float] = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
) -> Callable:
    """An adapter running ``trl.GRPOTrainer._compute_loss`` with these ``GRPOConfig`` settings."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    def loss_fn(logp, old_logp, advantages, mask, denominator=None, ref_logp=None):
        B, L = logp.shape
        state = _state(loss_type, beta=beta, epsilon_low=epsilon,
                       epsilon_high=epsilon if epsilon_high is None else epsilon_high,
                       importance_sampling_level=importance_sampling_level,
                       max_completion_length=L if max_completion_length is None else max_completion_length,
                       use_bias_correction_kl=use_bias_correction_kl, delta=delta,
                       sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg)
        state._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp).detach(), None)
        state.get_gamma_weights = GRPOTrainer.get_gamma_weights  # TRL's own (a static method), for "vespo"
        m = mask.to(logp.dtype)
        inputs = {
            "prompt_ids": torch.zeros(B, 0, dtype=torch.long), "prompt_mask": torch.zeros(B, 0, dtype=torch.long),
            "completion_ids": torch.zeros(B, L, dtype=torch.long), "completion_mask": m,
            "advantages": advantages, "old_per_token_logps": old_logp,
            "num_items_in_batch": torch.as_tensor(m.sum() if denominator is None else denominator, dtype=logp.dtype),
        }
        if beta != 0.0:
            if ref_logp is None:
                raise ValueError("ref_logp: TRL's loss with beta > 0 needs reference log-probs")
            inputs["ref_per_token_logps"] = ref_logp
        return GRPOTrainer._compute_loss(state, None, inputs)

    if loss_type not in GLOBAL_COUNT_TYPES:
        # the other loss types normalize within the micro-batch and read no global count
        def per_batch(logp, old_logp, advantages, mask, ref_logp=None):
            return loss_fn(logp, old_logp, advantages, mask, ref_logp=ref_logp)

        if beta == 0.0:
            return lambda logp, old_logp, advantages, mask: loss_fn(logp, old_logp, advantages, mask)
        return per_batch
    if beta == 0.0:
        return lambda logp, old_logp, advantages, mask, denominator=None: loss_fn(logp, old_logp, advantages, mask,
                                                                               denominator=denominator)
    return loss_fn


class _PairModel:
    """Stands in for the policy in ``DPOTrainer._compute_loss``: returns the log-probs under test per token."""

    training = True

    def __init__(self, per_token_logps: torch.Tensor):
        self.lp = per_token_logps

    def __call__(self, **kwargs):
        z = torch.zeros_like(self.lp).detach()
        return SimpleNamespace(log_probs=self.lp, entropy=z, mean_logits=z, is_top1=torch.zeros_like(z, dtype=torch.bool),
                               aux_loss=None)


def _spread(seq_logp: torch.Tensor, lengths: torch.Tensor, L: int) -> torch.Tensor:
    """``[B, L]`` per-token log-probs summing to ``seq_logp`` over the first ``lengths`` tokens (0 after)."""
    m = (torch.arange(L)[None, :] < lengths[:, None]).to(seq_logp.dtype)
    return seq_logp[:, None] / lengths[:, None].to(seq_logp.dtype) * m


def dpo_loss(loss_type: str = "sigmoid", *, beta: float = 0.1, label_smoothing: float = 0.0) -> Callable:
    """``loss_fn(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_length, rejected_length)``
    running ``trl.DPOTrainer._compute_loss`` (TRL's code, unchanged) with ``DPOConfig(loss_type=[loss_type])``,
    precomputed reference log-probs and the reverse-KL f-divergence (TRL's defaults). The policy's forward pass
    is replaced by the log-probs under test, spread over each response's tokens (TRL sums them back)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    def loss_fn(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, chosen_length, rejected_length):
        lengths = torch.cat([chosen_length, rejected_length]).long()
        L = int(lengths.max())
        per_token = torch.cat([_spread(chosen_logp, lengths[: len(chosen_length)], L),
                               _spread(rejected_logp, lengths[len(chosen_length):], L)])
        # position 0 stands for the prompt: TRL's labels are the completion mask shifted by one
        completion = torch.cat([torch.zeros(len(lengths), 1, dtype=torch.long),
                                (torch.arange(L)[None, :] < lengths[:, None]).long()], dim=1)
        state = SimpleNamespace(
            model=SimpleNamespace(training=True), accelerator=SimpleNamespace(
                device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x),
            aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
            loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing,
            use_weighting=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
            _total_train_tokens=0, _tp_size=1)
        inputs = {"input_ids": torch.zeros_like(completion), "attention_mask": torch.ones_like(completion),
                  "completion_mask": completion, "ref_chosen_logps": ref_chosen_logp,
                  "ref_rejected_logps": ref_rejected_logp}
        return DPOTrainer._compute_loss(state, _PairModel(per_token), inputs, False)

    return loss_fn
