"""Parameter dtypes: names from a config, and the fastest exact-enough default for a device."""
from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["DTYPES", "preferred_dtype", "resolve_dtype"]

#: dtype names a config or the command line may give.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def preferred_dtype(device: Optional[str] = None) -> torch.dtype:
    """bfloat16 where the hardware computes it natively, else float32.

    CUDA devices with bf16 support, and CPUs whose oneDNN has native bf16 kernels
    (AVX512-BF16 / AMX), get ``bfloat16``; elsewhere (e.g. AVX2-only CPUs) bf16 is
    emulated and several times slower than float32, so ``float32`` is returned.
    """
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(dev).startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # pragma: no cover - builds without oneDNN
        native = False
    return torch.bfloat16 if native else torch.float32



def resolve_dtype(dtype: Union[str, torch.dtype, None], *, name: str = "dtype") -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` / a floating ``torch.dtype`` as given; ``"auto"`` or
    ``None``: :func:`preferred_dtype`. Anything else raises ValueError naming ``name``."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return preferred_dtype()
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"{name}: expected one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
        return DTYPES[dtype]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating torch dtype, got {dtype!r}")
    return dtype
