"""The dense SwiGLU feed-forward (DeepSeek's first dense layers and shared experts)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from server.model.layers.linear import Linear, restacked
from server.model.quant.linear import stacked_forward, stacked_int8


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        # stack_projections(): gate rows, then up; a buffer so that a graph takes it as an
        # input; int8 layers' weight scales beside it (quant/linear.stacked_int8)
        self.register_buffer("gate_up", None, persistent=False)
        self.register_buffer("gate_up_int8", None, persistent=False)
        self.register_buffer("gate_up_scale", None, persistent=False)
        # A routed expert's int8 gate and up are rows of its MoE's stacks (moe.expert_stacks),
        # read there: a stack of its own would be a copy.
        self.routed_expert = False

    def stack_projections(self) -> None:
        """Gate and up as one weight, read by one product (linear.stacked says why); kept
        where they already are views of one (a routed expert's rows of its MoE's stack)."""
        pair = [self.gate_proj, self.up_proj]
        self.gate_up = restacked(pair, self.gate_up)
        if self.gate_up is None and not self.routed_expert:
            self.gate_up_int8, self.gate_up_scale = stacked_int8(pair, self.gate_up_int8, self.gate_up_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            g, u = self.gate_proj.products.linear(x, self.gate_up).chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * u)
        if self.gate_up_scale is not None:
            g, u = stacked_forward(x, self.gate_up_int8, self.gate_up_scale,
                                   self.gate_proj.backend).chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
