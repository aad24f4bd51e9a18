"""``torch._weight_int8pack_mm`` behind the rules it does not check itself.

Measured on torch 2.13.0+cpu (AMD EPYC, AVX-512 BF16/VNNI; each case in a child process):
* in-features not a multiple of 16: wrong sums (136: errors of 1e26) or SIGSEGV (24, 40,
  72), at any row count;
* the int8 weight 8 bytes past a 16-byte boundary: SIGSEGV from 4 rows (1-3 rows ran);
* the bf16 activations 2 or 16 bytes past a 32-byte boundary: SIGSEGV at any row count.
On the AVX2 EPYC it was written on, in-features that were multiples of 8 ran.  So one
rule for every CPU: in-features a multiple of 16, weight and activations contiguous and
64-byte aligned (the loader aligns weights: alignment.py; activations are copied here when
they are not).  Where the rule cannot hold the caller takes the exact float path.
"""
from __future__ import annotations

import torch

from server.model.kernels.alignment import aligned, is_aligned

K_MULTIPLE = 16


def takes(in_features: int) -> bool:
    """Whether products with ``in_features`` inputs may go through the operator at all."""
    return in_features % K_MULTIPLE == 0


def weight_fits(w: torch.Tensor) -> bool:
    """Whether ``w`` (int8 [N, K]) meets the operator's rules (outside a traced graph;
    a traced graph holds the loader's aligned parameters)."""
    return (w.dtype == torch.int8 and w.dim() == 2 and takes(w.shape[1])
            and (torch.compiler.is_compiling() or (w.is_contiguous() and is_aligned(w))))


def int8pack_mm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``torch._weight_int8pack_mm(x, w, scales)`` (x bf16 [M, K], w int8 [N, K], scales
    bf16 [N]) for a ``w`` that ``weight_fits``; ValueError for one that does not, so a
    broken rule is an error, never a crash."""
    if not weight_fits(w):
        raise ValueError(f"int8pack cannot take this weight: shape {tuple(w.shape)}, "
                         f"contiguous {w.is_contiguous()}, offset {w.data_ptr() % 64} bytes "
                         f"past a 64-byte boundary; in-features must be a multiple of {K_MULTIPLE}")
    if not torch.compiler.is_compiling():
        if not x.is_contiguous():
            x = x.contiguous()
        x = aligned(x)
        scales = aligned(scales.contiguous())
    return torch._weight_int8pack_mm(x, w, scales)
