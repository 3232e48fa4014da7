r"""Log-probabilities and importance ratios: the per-token quantities a policy loss is built
from (spec §4, §7, §16, §17).

===========================  ===============================================================
:mod:`.sampling`             token log-probs and entropies under the sampling distribution
                             (temperature, top-k, top-p), alignment helpers (§4, §7)
:mod:`.ratios`               token, sequence, GSPO and per-segment log ratios (§7, §16, §17)
:mod:`.correction`           rollout correction of the ratios: TIS, MIS/IcePop, k1/k2/k3
                             rejection, off-policy sequence masking (§7)
===========================  ===============================================================

The chunked kernels that compute log-probs and entropies from hidden states without holding
``[B, L, V]`` logits are their own package, :mod:`trajgrad.fused` (the distillation losses use
them too); :func:`fused_token_logprobs` and :func:`fused_entropy` are re-exported here.
"""
from ..fused import fused_entropy, fused_token_logprobs
from .correction import Correction, RolloutCorrection, rollout_correction, turn_metrics
from .ratios import (
    gspo_log_sequence_ratio,
    gspo_sequence_ratio,
    gspo_token_ratio,
    segment_log_ratios,
    sequence_log_ratio,
    token_log_ratio,
)
from .sampling import entropy, sampling_logits, shift_logits_and_targets, shift_mask, token_logprobs

__all__ = [
    # log-probs under the sampling distribution (§4, §7)
    "shift_logits_and_targets", "shift_mask", "sampling_logits", "token_logprobs", "entropy",
    "fused_token_logprobs", "fused_entropy",
    # ratios (§7, §16, §17)
    "token_log_ratio", "sequence_log_ratio", "gspo_log_sequence_ratio", "gspo_sequence_ratio",
    "gspo_token_ratio", "segment_log_ratios",
    # rollout correction (§7)
    "Correction", "RolloutCorrection", "rollout_correction", "turn_metrics",
]
