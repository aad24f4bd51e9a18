"""The model's view of a checkpoint's settings: ``DeepseekConfig`` and the torch dtypes
its dtype names stand for.

The settings themselves are read torch-free in server/config/checkpoint/architecture.py
(``--check`` sizes a KV block from them without torch); the model, its loader and its
tests import them from here, with the dtype map they need beside them.
"""
from __future__ import annotations

import torch

from server.config.checkpoint.architecture import (
    DTYPES,
    DeepseekConfig,
    UnsupportedConfigError,
    YarnScaling,
    yarn_get_mscale,
)

# The dtype names a config or a checkpoint uses, and the torch dtypes they stand for.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The dtype called ``name``; None for no name or an unknown one (the caller's default)."""
    return TORCH_DTYPES.get(name or "")


__all__ = ["DTYPES", "DeepseekConfig", "TORCH_DTYPES", "UnsupportedConfigError", "YarnScaling",
           "torch_dtype", "yarn_get_mscale"]
