"""Float32 GEMMs over weights held in another dtype, a graph's stored buffers, and the
fragment our native kernels are registered on as torch operators."""
from __future__ import annotations

from collections.abc import Callable

import torch

EXACT_FLOAT_K = 1024          # 1024 * 127 * 128 < 2**24: float32 sums of int8 products are exact


BLOCK_BYTES = 4 << 20   # converted_mm: float32 weight converted per block


FLIP_ROWS = 128         # converted_mm: up to here the weight is the GEMM's left operand


def converted_mm(xf: torch.Tensor, w: torch.Tensor, k_split: int | None = None) -> torch.Tensor:
    """xf float32 [M, K] . w [N, K]^T (w int8 or 16-bit) through float32 GEMMs, eager: the
    weight converted BLOCK_BYTES of float32 at a time (each block's copy stays in cache for
    its GEMMs, where a whole copy round-trips memory: the 0.5b head at 16 rows 21 ms by
    blocks, 42 whole) and, up to FLIP_ROWS rows, the GEMM's left operand (MKL with few rows
    on the left ran at a third to a half of the speed: [512, 1536] at 4 rows 0.18 against
    0.60 ms).  ``k_split``: at most that many inputs per float32 product, the parts summed
    in float64 (the exact int8 path).  Each output element is one dot product either way."""
    n, k = w.shape
    flip = xf.shape[0] <= FLIP_ROWS
    split = k_split or k
    step = max(1, BLOCK_BYTES // (4 * k))
    out = xf.new_empty(xf.shape[0], n, dtype=torch.float32 if k <= split else torch.float64)
    for r0 in range(0, n, step):
        wf = float_block(w, r0, step)
        acc = None
        for k0 in range(0, k, split):
            a, b = wf[:, k0:k0 + split], xf[:, k0:k0 + split]
            part = torch.mm(a, b.t()).t() if flip else torch.mm(b, a.t())
            acc = part if acc is None else acc.double() + part
        out[:, r0:r0 + step] = acc
    return out


def float_block(w: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows ``start .. start + rows`` of ``w`` as float32: the only copy ``converted_mm`` makes."""
    return w[start:start + rows].float()


# The kernel's operators for compiled graphs (Dynamo cannot trace ctypes).  Defined on a
# library fragment rather than with torch.library.custom_op: its dispatch costs 20 us a
# call against 49, and a decode step makes about 90 of these.
_OPS = torch.library.Library("mtp_serve", "FRAGMENT")


def kernel_operator(schema: str, impl: Callable[..., torch.Tensor],
                    fake: Callable[..., torch.Tensor]) -> None:
    """Define ``mtp_serve::<schema>`` on that fragment: ``impl`` for CPU tensors, ``fake``
    (the output's shape and dtype) while a graph is traced."""
    name = schema.split("(", 1)[0]
    _OPS.define(schema)
    _OPS.impl(name, impl, "CPU")
    torch.library.register_fake(f"mtp_serve::{name}")(fake)


def materialized(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, made a buffer of its own in a compiled graph.  Inductor inlines a
    pointwise producer into its consumer; inlined into the reduction above, the
    activation's quantization (divide, round, clamp) would run again for every output
    row: measured at [1, 1536] x 4 experts of [1536, 1536], one thread, 3.2 ms against
    1.0 ms stored.  A concatenation is a kernel of its own, so its result is."""
    pad = t.new_zeros(*t.shape[:-1], 1)
    return torch.cat([t, pad], dim=-1)[..., :-1]
