"""Every tensor a native kernel reads starts on a 64-byte boundary.

Why: a private torch operator has rules nobody wrote down.  ``torch._weight_int8pack_mm``
on an AVX-512 CPU (torch 2.13) dies with SIGSEGV when its int8 weight starts 8 bytes past a
64-byte boundary (at 4 rows or more) or its bf16 activations 16 bytes past one, where the
same call on AVX2 runs.  Safetensors hands out tensors at whatever offset the file's
header leaves, and a slice for a tensor-parallel shard starts mid-row.  So after a model
is loaded every parameter and buffer is moved, where it is not already, to storage of its
own (torch's CPU allocator aligns to 64 bytes), and the operator's guard (int8pack.py)
checks the rule again before each call.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

ALIGNMENT = 64


def is_aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s first element sits on an ALIGNMENT-byte boundary (CPU tensors;
    other devices' allocators give their own guarantees)."""
    return t.device.type != "cpu" or t.data_ptr() % ALIGNMENT == 0


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where aligned, else a copy in fresh storage with the same layout where
    it is row- or column-major (heads are held column-major: layers.column_major)."""
    if is_aligned(t) or t.numel() == 0:
        return t
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
        return aligned(t.t()).t()
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    assert is_aligned(out), "torch's CPU allocator no longer aligns to 64 bytes"
    return out


def align_module(model: nn.Module) -> int:
    """Move every parameter and buffer of ``model`` that is not aligned to aligned storage
    (tied parameters stay tied: the Parameter object is kept, its data replaced); the
    number moved."""
    moved = 0
    with torch.no_grad():
        for p in model.parameters():
            if not is_aligned(p.data):
                p.data = aligned(p.data)
                moved += 1
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and not is_aligned(buf):
                    module._buffers[name] = aligned(buf)
                    moved += 1
    return moved


def misaligned(model: nn.Module) -> Iterator[str]:
    """Names of the parameters and buffers of ``model`` not on an ALIGNMENT boundary."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.numel() and not is_aligned(t):
            yield name
