"""RMSNorm, computed in float32 whatever the weights' dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused kernel, same maths as below (bitwise equal in float32, measured);
            # saves ~4 op dispatches per norm, which dominate on small batches.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32, scale in the input dtype (as the reference implementations do).
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
