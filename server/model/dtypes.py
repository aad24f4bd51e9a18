"""The dtype names a config or a checkpoint uses, and the torch dtypes they stand for."""
from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16}


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The dtype called ``name``; None for no name or an unknown one (the caller's default)."""
    return TORCH_DTYPES.get(name or "")
