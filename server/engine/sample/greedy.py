"""Greedy tokens: each row's argmax of the logits.

Why not ``logits.argmax(-1)`` alone: torch's CPU argmax reads a row one element at a time
(29 us a 32000-wide float32 row on a 2-core Zen 4, 171 us at DeepSeek-V3's 129280), and a
greedy MTP step takes one a verified row and one a draft.  ops.cpp's ``argmax_rows`` gives
the same ids (the first largest value, a NaN above any number) in two SSE2 passes a row.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _native() -> bool:
    from server.model.kernels.native import native_ops
    return native_ops()


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> int64 [R]: ``logits.argmax(-1)``, through ops.cpp's operator for
    float32 rows on the CPU where it is loaded."""
    if (logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and logits.shape[1] > 0 and logits.stride(1) == 1 and _native()):
        return torch.ops.mtp_native.argmax_rows(logits)
    return logits.argmax(-1)
