"""msModelSlim's W4A8 packing: two int4 values a byte along the output rows."""
from __future__ import annotations

import torch


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """msModelSlim W4A8 weight int8 [out/2, in] -> int8 [out, in] holding int4 values.

    Two output rows share a byte: the low nibble is row 2j, the high nibble row 2j+1, both
    two's-complement int4 (-8..7).
    """
    p = packed.to(torch.int8)
    low = ((p & 0xF) ^ 0x8) - 0x8                     # sign-extend the low nibble
    high = p >> 4                                     # arithmetic shift sign-extends
    return torch.stack([low, high], dim=1).reshape(2 * p.shape[0], p.shape[1]).to(torch.int8)


def pack_int4_rows(w: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_int4_rows``: int4 values in int8 [out, in] -> [out/2, in]."""
    w = w.to(torch.int8)
    return ((w[1::2] << 4) | (w[0::2] & 0xF)).to(torch.int8)
