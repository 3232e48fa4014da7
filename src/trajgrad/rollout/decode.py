"""Former location of the lean decode step; it lives in :mod:`trajgrad.model.decode` now.

Kept as a re-export for old imports (remove once nothing imports ``trajgrad.rollout.decode``).
"""
from ..model.decode import KVBuffers, decode_step, fast_backbone

__all__ = ["KVBuffers", "decode_step", "fast_backbone"]
