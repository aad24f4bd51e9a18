"""DeepSeek-V3 FP8 weight layout: float8_e4m3fn weights with one scale per 128x128 block.

``weight_scale_inv`` [ceil(out / 128), ceil(in / 128)] float32 multiplies the stored fp8
values back to real ones (the name is the inverse of the quantisation scale). Edge blocks
may be partial when a dimension is not a multiple of 128.
"""
from __future__ import annotations

import torch

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _expand(scale: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    return scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                   block: int = BLOCK) -> torch.Tensor:
    """fp8 [out, in] x scale_inv [ceil(out/b), ceil(in/b)] -> dtype [out, in]."""
    rows, cols = weight.shape
    expected = (-(-rows // block), -(-cols // block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight "
                         f"{(rows, cols)} with {block}x{block} blocks (expected {expected})")
    return (weight.float() * _expand(scale_inv.float(), rows, cols, block)).to(dtype)


def quantize_fp8(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (float8_e4m3fn weight, float32 scale_inv); each block's max maps to FP8_MAX."""
    w = weight.float()
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = w.new_zeros(br * block, bc * block)
    padded[:rows, :cols] = w
    amax = padded.view(br, block, bc, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    q = (w / _expand(scale_inv, rows, cols, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv
