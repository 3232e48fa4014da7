"""Former location of the learner's log-probs and the value head; they live in
:mod:`trajgrad.model.learner` and :mod:`trajgrad.model.value_head` now.

Kept as re-exports for old imports (remove once nothing imports ``trajgrad.train.policy``).
``position_ids_from_mask`` is :func:`trajgrad.model.positions.position_ids_from_attention_mask`.
"""
from ..model.learner import LearnerOutput, causal_parts, head_inputs, learner_logprobs
from ..model.positions import position_ids_from_attention_mask as position_ids_from_mask
from ..model.value_head import ValueHead

__all__ = ["LearnerOutput", "ValueHead", "causal_parts", "head_inputs", "learner_logprobs", "position_ids_from_mask"]
