"""Int8 experts of a routed MoE: one expert's SwiGLU with gate and up as one product, and
the gathered form a compiled step reads each chosen expert's rows through."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from server.model.kernels import int8pack
from server.model.kernels.gemm import EXACT_FLOAT_K, converted_mm, materialized
from server.model.kernels.native import kernel_library, ops_ready


from server.model.quant.int8 import (
    _unit_scales,
    dynamic_product,
    packs,
    quantize_rows,
    row_scales,
)
from server.model.quant.linear import QuantLinear

# The operators that take each row through its own expert, by the backend whose kernel
# they run (half_avx2.c's int8_rows, avx512_vnni.c's i8_rows): exact int32 sums.
ROWS_OPS = {
    "avx2": lambda: ((lambda x, e, w: torch.ops.mtp_native.int8_rows(x.to(torch.int16).contiguous(), e, w))
                     if ops_ready() else torch.ops.mtp_serve.int8_rows),
    "vnni": lambda: ((lambda x, e, w: torch.ops.mtp_native.i8_rows(x.to(torch.int8).contiguous(), e, w))
                     if ops_ready() else torch.ops.mtp_serve.i8_rows),
}


# The operators that take a window's whole routed MoE in one call (kernels/int8_moe.h), by
# backend: (kernel library, operator).  Both give the torch path's numbers for bfloat16
# activations; they differ only in their products' instructions.
MOE_OPS = {"avx2": ("half_avx2", "int8_moe"), "vnni": ("avx512_vnni", "i8_moe")}


@torch.compiler.assume_constant_result
def native_moe(backend: str) -> bool:
    """``backend``'s whole-MoE operator loaded (a constant of a traced graph, as ops_ready)."""
    if backend not in MOE_OPS:
        return False
    lib = kernel_library(MOE_OPS[backend][0])
    return lib is not None and hasattr(lib, MOE_OPS[backend][1])


# Backends whose rows kernel reads each chosen expert once for all its rows (i8_rows and
# int8_rows group them): the gathered MoE then costs the routed one's bytes at any number
# of tokens.
GROUPED_ROWS = ("avx2", "vnni")


def gathered_int8_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                          gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                          down: torch.Tensor, down_scale: torch.Tensor, backend: str = "float") -> torch.Tensor:
    """Each token through its top-k int8 experts (dynamic scheme), their weights read by
    index: what the routed MoE computes with one QuantLinear per expert, as one graph
    with no host read of the per-expert counts, so a compiled graph reads each chosen
    expert's int8 rows once, in place; scaled exactly as QuantLinear scales.

    The integer products are summed in float32: each product is exact (|p| <= 127 * 127),
    and so is every partial sum below 2**24, which holds for any input up to 1040 features
    and, past that, unless the row's |products| add up to 2**24 (a rounding of one part in
    2**24 then, far below the bf16 output's).  An int32 sum gave the same numbers at 2.2x
    the time (Inductor widens, multiplies and adds 16 lanes of int32 where float32 fuses a
    multiply-add): 0.72 against 0.32 ms for [1, 1536] x 4 experts of [1536 x 512], 2 threads.

    x [T, H]; weights/idx [T, k]; gate_up int8 [E, 2I, H] (gate rows, then up rows) with
    gate_up_scale [E, 2I]; down int8 [E, H, I] with down_scale [E, H]
    (layers.MoE.expert_stacks) -> float32 [T, H], the routing-weighted sum over k.

    ``backend`` "int8pack" (the experts' QuantLinear backend): the products through
    ``int8pack_experts`` instead, the numbers of the routed experts on that backend.  On
    the AVX2 EPYC the reductions above are not vectorized for int8 weights: the 0.5b
    model's 4 experts of [1536 x 512] took 6.7 ms a token, compiled, 2 threads.

    "avx2" and "vnni" with bfloat16 activations: all of it in one operator (MOE_OPS:
    kernels/int8_moe.h, these operations in this order; the activation's exp is the C
    library's)."""
    if x.dtype == torch.bfloat16 and ops_ready() and native_moe(backend):
        return getattr(torch.ops.mtp_native, MOE_OPS[backend][1])(
            x.float().contiguous(), weights.float().contiguous(), idx.contiguous(), gate_up,
            gate_up_scale.float().contiguous(), down, down_scale.float().contiguous())
    xf = x.float()
    s = row_scales(xf)                                                   # [T, 1]
    if backend in ROWS_OPS:                                              # our kernels
        x_q = quantize_rows(xf, s)
        flat = idx.reshape(-1)
        acc = ROWS_OPS[backend]()(x_q[:, None, :].expand(*idx.shape, -1).reshape(
            flat.shape[0], -1), flat, gate_up).float().view(*idx.shape, -1)
    elif packs(backend, x.shape[-1]):                                    # as int8_matmul takes it
        x_q = quantize_rows(xf, s).to(torch.bfloat16)
        acc = int8pack_experts(x_q[:, None, :].expand(*idx.shape, -1).contiguous(), idx, gate_up)
    else:
        x_q = materialized(quantize_rows(xf, s))
        acc = (gate_up[idx].float() * x_q[:, None, None, :]).sum(-1)      # [T, k, 2I]
    g, u = (acc * (s[:, :, None] * gate_up_scale[idx])).to(x.dtype).chunk(2, dim=-1)
    act = (F.silu(g) * u).float()                                        # [T, k, I]
    s2 = row_scales(act)                                                 # [T, k, 1]
    if backend in ROWS_OPS:
        acc2 = ROWS_OPS[backend]()(quantize_rows(act, s2).reshape(idx.numel(), -1),
                                   idx.reshape(-1), down).float().view(*idx.shape, -1)
    elif packs(backend, down.shape[-1]):
        acc2 = int8pack_experts(quantize_rows(act, s2).to(torch.bfloat16), idx, down)
    else:
        a_q = materialized(quantize_rows(act, s2))
        acc2 = (down[idx].float() * a_q[:, :, None, :]).sum(-1)           # [T, k, H]
    y = (acc2 * (s2 * down_scale[idx])).to(x.dtype)
    return (y * weights[:, :, None].float()).sum(1)


@torch.library.custom_op("mtp_serve::int8pack_experts", mutates_args=())
def int8pack_experts(rows: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """rows bf16 [T, k, K] (quantized activations), idx [T, k], w int8 [E, N, K] -> float32
    [T, k, N]: row (t, j) through expert idx[t, j] on the "int8pack" backend.  An operator
    of its own so that a compiled graph calls it as is: traced, indexing a weight by a
    tensor would copy it first (and Inductor's int8 reductions are slow on AVX2)."""
    out = rows.new_empty(*idx.shape, w.shape[1], dtype=torch.float32)
    ones = _unit_scales(w)
    for t, experts in enumerate(idx.tolist()):
        for j, e in enumerate(experts):
            if int8pack.weight_fits(w[e]):
                out[t, j] = int8pack.int8pack_mm(rows[t, j:j + 1], w[e], ones)[0]
            else:                    # the same numbers: the exact sums, rounded once to bf16
                exact = converted_mm(rows[t, j:j + 1].float(), w[e], EXACT_FLOAT_K)[0]
                out[t, j] = exact.to(torch.bfloat16).float()
    return out


@int8pack_experts.register_fake
def _(rows: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(*idx.shape, w.shape[1], dtype=torch.float32)


def int8_expert(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                down: torch.Tensor, down_scale: torch.Tensor, backend: str) -> torch.Tensor:
    """One int8 SwiGLU expert (dynamic scheme) on its rows x [n, H]: gate and up as one
    product over their stacked rows (gate_up [2I, H]), so the rows are quantized once and
    one GEMM runs where two QuantLinears run two of each; the integer sums and every
    scaling step are QuantLinear's, so the output is the same bit for bit."""
    g, u = dynamic_product(x.float(), gate_up, gate_up_scale, backend).to(x.dtype).chunk(2, dim=-1)
    act = (F.silu(g) * u).float()
    return dynamic_product(act, down, down_scale, backend).to(x.dtype)


def gatherable(linear: nn.Module) -> bool:
    """An int8 layer the gathered experts can read by index: dynamic scheme, no bias,
    whole on this rank."""
    return isinstance(linear, QuantLinear) and linear.scheme == "w8a8_dynamic" \
        and linear.bias is None and not linear.row_parallel
