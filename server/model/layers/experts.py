"""How a routed MoE's experts compute, by what their weights are: float (``FloatExperts``)
or int8 of the dynamic scheme (``Int8Experts``).  A MoE asks its form (``expert_form``)
instead of counting how many stacked tensors it holds.

Each form runs the experts two ways over the stacks ``MoE.expert_stacks`` builds:
  * ``routed``: the eager MoE's sorted assignments, a run of rows per expert (the float
    form in one native call where the model's products have one, else expert by expert);
  * ``gathered``: each token through its top-k experts only, their weights read by index
    (static_decode.gathered_moe, inside a compiled graph: a GEMV per chosen expert, as
    gpt-fast runs Mixtral), accumulated in float32.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from server.model.kernels.gemm import materialized
from server.model.quant.experts import gathered_int8_experts, int8_expert

ExpertRunner = Callable[[int, torch.Tensor], torch.Tensor]     # (local expert, its rows) -> output


class FloatExperts:
    """Float experts; stacks: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]."""

    names = ("weight",)

    @staticmethod
    def routed(moe, xs: torch.Tensor, counts: list[int], stacks: tuple) -> torch.Tensor | None:
        return moe.products.experts(xs, counts, *stacks) if stacks else None

    @staticmethod
    def runner(moe, stacks: tuple) -> ExpertRunner:
        return lambda j, rows: moe.experts[j](rows)

    @staticmethod
    def gathered(moe, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                 w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/idx [T, k] -> [T, H]: the products' own kernel where they have
        one, else products and sums, not matmuls of gathered copies, so a compiled graph
        reads each chosen expert's rows in place."""
        out = moe.products.gathered_experts(x, weights, idx, w_gate_up, w_down)
        if out is not None:
            return out
        # Stored, not inlined into the reductions: Inductor would recompute the norm and the
        # SiLU for every output row (gemm.materialized).
        xf = materialized(x.float())
        gu = (w_gate_up[idx].float() * xf[:, None, None, :]).sum(-1)    # [T, k, 2I]
        g, u = gu.chunk(2, dim=-1)
        act = materialized(F.silu(g) * u)                               # [T, k, I]
        y = (w_down[idx].float() * act[:, :, None, :]).sum(-1)          # [T, k, H]
        return (y * weights[:, :, None].float()).sum(1).to(x.dtype)     # [T, H]


class Int8Experts:
    """Int8 experts of the dynamic scheme; stacks: gate_up int8 [E, 2I, H], its
    weight_scale [E, 2I], down int8 [E, H, I], its weight_scale [E, H]."""

    names = ("weight", "weight_scale")

    @staticmethod
    def routed(moe, xs, counts, stacks) -> None:
        return None

    @staticmethod
    def runner(moe, stacks: tuple) -> ExpertRunner:
        """Gate and up as one int8 product (quant.int8_expert: one activation quantization
        and one GEMM where two QuantLinears take two of each; the same numbers)."""
        if not stacks:
            return lambda j, rows: moe.experts[j](rows)
        gate_up, gate_up_scale, down, down_scale = stacks
        backend = moe.experts[0].gate_proj.backend
        return lambda j, rows: int8_expert(rows, gate_up[j], gate_up_scale[j], down[j],
                                           down_scale[j], backend)

    @staticmethod
    def gathered(moe, x, weights, idx, gate_up, gate_up_scale, down, down_scale) -> torch.Tensor:
        return gathered_int8_experts(x, weights, idx, gate_up, gate_up_scale, down, down_scale,
                                     backend=moe.experts[0].gate_proj.backend).to(x.dtype)
