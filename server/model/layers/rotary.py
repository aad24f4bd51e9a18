"""Rotary position embedding for the rope part of q and k, with YaRN scaling."""
from __future__ import annotations

import math

import torch

from server.model.config import DeepseekConfig, yarn_get_mscale


def _yarn_inv_freq(cfg: DeepseekConfig, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN frequencies: interpolate low frequencies by ``factor``, keep high ones, ramp between."""
    y = cfg.rope_scaling
    assert y is not None
    base = cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (y.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 = extrapolate (high frequency), 0 = interpolate
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    # cos/sin amplitude correction (1.0 when mscale == mscale_all_dim, as in DeepSeek-V3).
    attention_factor = yarn_get_mscale(y.factor, y.mscale) / yarn_get_mscale(y.factor, y.mscale_all_dim)
    return inv_freq, attention_factor


class RotaryEmbedding:
    """cos/sin for the rope part of q and k; not a module so ``.to(dtype)`` never touches it.

    DeepSeek checkpoints store the rope dims as interleaved pairs (x0, x1), (x2, x3), ...
    (``rope_interleave``, default true). The rotated output is written de-interleaved,
    [even dims rotated | odd dims rotated], exactly as transformers does; q and k get the
    same permutation, so q.k (and therefore attention) equals the interleaved original.
    """

    def __init__(self, cfg: DeepseekConfig) -> None:
        dim = cfg.qk_rope_head_dim
        if cfg.rope_scaling is None:
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
            self.attention_factor = 1.0
        else:
            inv_freq, self.attention_factor = _yarn_inv_freq(cfg, dim)
        self.interleave = cfg.rope_interleave
        self._inv_freq = {torch.device("cpu"): inv_freq}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] int -> cos, sin [..., rope_dim // 2] float32."""
        inv = self._inv_freq.get(positions.device)
        if inv is None:
            inv = self._inv_freq[torch.device("cpu")].to(positions.device)
            self._inv_freq[positions.device] = inv
        freqs = positions.float()[..., None] * inv
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., heads, rope_dim] (cos/sin broadcast over heads as [..., 1, rope_dim // 2])."""
        dtype = x.dtype
        xf = x.float()
        if self.interleave:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
        else:
            half = xf.shape[-1] // 2
            x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)
