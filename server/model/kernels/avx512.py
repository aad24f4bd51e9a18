"""Products through our AVX-512 kernels: bf16 weights with AVX-512 BF16
(avx512_bf16.c: ``Avx512Products``, the 16-bit backend "avx512") and exact int8 sums
with AVX-512 VNNI (avx512_vnni.c: the int8 backend "vnni", quant/int8.py).

Why: on a 2-core Zen 4 (AVX-512 BF16 and VNNI; memory 28.9 GB/s by a plain read) a
decode step's products through oneDNN read bf16 weights at 9-20 GB/s and torch._int_mm
int8 ones at 3-5 GB/s, where llama.cpp's kernels read 25 GB/s.  These read a weight once
for up to 4 rows at a time, in one instruction per 64 bytes a row.

Each row's sums are its own (the kernels' comments say how), so a window of k+1 rows
gives each row what a plain step gives: MTP stays lossless on these backends.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from server.model.kernels.gemm import EXACT_FLOAT_K, converted_mm, kernel_operator
from server.model.kernels.native import kernel_library, native_ops, ops_ready
from server.model.kernels.products import Products, native_paged_attention, window_router_logits

KERNEL_ROWS = 64        # eager, up to here our kernel; past it oneDNN's bf16 GEMM (prompts)


def bf16_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (cast to bf16) . w bf16 [N, K]^T -> float32 [M, N] through avx512_bf16.c;
    where the kernel is missing (a graph made with it, loaded without) torch's product."""
    lib = kernel_library("avx512_bf16")
    if lib is None or w.dtype != torch.bfloat16 or not w.is_contiguous():
        return F.linear(x.float(), w.float())
    xb = x.to(torch.bfloat16)
    if xb.stride(-1) != 1:
        xb = xb.contiguous()
    n, k = w.shape
    out = torch.empty(xb.shape[0], n, dtype=torch.float32)
    lib.bf16_mm(xb.data_ptr(), xb.shape[0], k, xb.stride(0), w.data_ptr(), n, out.data_ptr(), n,
                torch.get_num_threads())
    return out


def bf16_rows(x: torch.Tensor, expert: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Row a of x [A, K] (cast to bf16) through expert expert[a] of w bf16 [E, N, K] ->
    float32 [A, N]: a window's gathered experts, each chosen expert's rows read in place."""
    lib = kernel_library("avx512_bf16")
    if lib is None or not w.is_contiguous():
        return torch.stack([F.linear(r.float(), w[e].float()) for r, e in zip(x, expert.tolist())])
    xb = x.to(torch.bfloat16).contiguous()
    ids = expert.to(torch.int64).contiguous()
    out = torch.empty(xb.shape[0], w.shape[1], dtype=torch.float32)
    lib.bf16_rows(xb.data_ptr(), xb.shape[0], xb.shape[1], ids.data_ptr(), w.data_ptr(), w.shape[1],
                  out.data_ptr(), torch.get_num_threads())
    return out


kernel_operator("bf16_mm(Tensor x, Tensor weight) -> Tensor", bf16_mm,
                lambda x, w: x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32))
kernel_operator("bf16_rows(Tensor x, Tensor expert, Tensor w) -> Tensor", bf16_rows,
                lambda x, expert, w: x.new_empty(x.shape[0], w.shape[1], dtype=torch.float32))


def bf16_experts(xs: torch.Tensor, counts: list[int], gate_up: torch.Tensor,
                 down: torch.Tensor) -> torch.Tensor | None:
    """A routed MoE's experts over their rows in one call (avx512_bf16.c ``bf16_experts``):
    xs [A, H], expert e's rows the e-th ``counts[e]``; gate_up bf16 [E, 2I, H], down bf16
    [E, H, I] -> float32 [A, H].  None where it does not apply (no kernel, other dtypes, an
    expert with more than KERNEL_ROWS rows)."""
    lib = kernel_library("avx512_bf16")
    if (lib is None or torch.compiler.is_compiling() or gate_up.dtype != torch.bfloat16
            or not (gate_up.is_contiguous() and down.is_contiguous())
            or max(counts, default=0) > KERNEL_ROWS):
        return None
    e, i2, h = gate_up.shape
    xb = xs.to(torch.bfloat16).contiguous()
    offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
    a = xb.shape[0]
    gu = torch.empty(a, i2, dtype=torch.float32)
    act = torch.empty(a, i2 // 2, dtype=torch.bfloat16)
    out = torch.empty(a, h, dtype=torch.float32)
    lib.bf16_experts(xb.data_ptr(), h, i2 // 2, offsets.data_ptr(), e, gate_up.data_ptr(),
                     down.data_ptr(), gu.data_ptr(), act.data_ptr(), out.data_ptr(),
                     torch.get_num_threads())
    return out


class Avx512Products(Products):
    """bf16 weights on a CPU with AVX-512 BF16: our kernel for a decode window's rows,
    oneDNN's native bf16 GEMM for a prompt's; other dtypes torch's own."""

    name = "avx512"

    def __init__(self) -> None:
        super().__init__(native_half=True)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2
                or not weight.is_contiguous() or x.dim() < 2
                or x.numel() // max(1, x.shape[-1]) > KERNEL_ROWS):
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        if ops_ready():                               # the C++ operator: 2 us, ctypes 8
            out = torch.ops.mtp_native.bf16_mm(rows.to(torch.bfloat16), weight)
        else:
            out = bf16_mm(rows, weight)
        if bias is not None:
            out += bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])

    def columns_exact(self, weight: torch.Tensor, rows: int) -> bool:
        # avx512_bf16.c's bf16_mm: every path (few rows, blocks, the tail columns) runs each
        # output's chain over K alike (see ``dot`` there); past KERNEL_ROWS oneDNN's GEMM.
        return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and weight.dim() == 2 and weight.is_contiguous() and 0 < rows <= KERNEL_ROWS
                and (ops_ready() or kernel_library("avx512_bf16") is not None))

    def experts(self, xs, counts, gate_up, down):
        return bf16_experts(xs, counts, gate_up, down)

    def gathered_experts(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                         gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor | None:
        if gate_up.dtype != torch.bfloat16:
            return None
        if ops_ready():
            # One call from the router's choice to the weighted sum (avx512_bf16.c bf16_moe):
            # each chosen expert read once for all its tokens, the eager MoE's numbers.
            out = torch.ops.mtp_native.bf16_moe(x.to(torch.bfloat16).contiguous(),
                                                weights.float().contiguous(),
                                                idx.to(torch.int64).contiguous(), gate_up, down)
            return out.to(x.dtype)
        t, k = idx.shape
        flat = idx.reshape(-1)
        rows = x[:, None, :].expand(t, k, -1).reshape(t * k, -1)
        op = torch.ops.mtp_serve.bf16_rows
        gu = op(rows.to(torch.bfloat16).contiguous(), flat, gate_up)           # [T*k, 2I]
        g, u = gu.chunk(2, dim=-1)
        act = (F.silu(g) * u).to(torch.bfloat16)
        y = op(act.contiguous(), flat, down).view(t, k, -1)                   # [T, k, H]
        return (y * weights[:, :, None].float()).sum(1).to(x.dtype)

    def groups_experts(self, dtype: torch.dtype) -> bool:
        return dtype == torch.bfloat16 and native_ops()

    def takes_head_rows(self, weight: torch.Tensor) -> bool:
        return weight.dtype == torch.bfloat16 and weight.device.type == "cpu"

    def head_rows(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Each (token, head) a row through its head's weight, read in place: the absorbed
        attention's W_UK / W_UV products, where oneDNN's bf16 bmm of a decode step's few
        rows took 3 ms a step on the 0.5b model for 26 MB.  The C++ operator groups the
        rows by head (bf16_heads: each head's weight read once a step, where bf16_rows
        read it once a token: 7% of a batch-8 step); the Python one takes bf16_rows."""
        if ops_ready():
            return self._heads(x.to(torch.bfloat16).contiguous(), w).to(x.dtype)
        t, nh, k = x.shape
        heads = torch.arange(nh, device=x.device).repeat(t)
        out = torch.ops.mtp_serve.bf16_rows(x.reshape(t * nh, k).to(torch.bfloat16).contiguous(), heads, w)
        return out.view(t, nh, -1).to(x.dtype)

    @staticmethod
    def _heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Past 64 rows oneDNN's (ops.cpp bf16_heads_wide): a prompt's, and an eager
        window's as its projections past KERNEL_ROWS."""
        return torch.ops.mtp_native.bf16_heads_wide(x, w)

    def column_major(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32            # our kernel reads bf16 weights by rows

    def window(self, window: str) -> Products:
        super().window(window)
        return self if window == "prompt" else Avx512Window()


class Avx512Window(Avx512Products):
    """A decode window's graph: every bf16 product through the kernel's operator (its rows
    are few, and symbolic in a batch graph)."""

    def linear(self, x, weight, bias=None):
        if not torch.compiler.is_compiling():
            return super().linear(x, weight, bias)
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        op = torch.ops.mtp_native.bf16_mm if ops_ready() else torch.ops.mtp_serve.bf16_mm
        out = op(rows, weight).view(*x.shape[:-1], weight.shape[0])
        return (out if bias is None else out + bias.float()).to(x.dtype)

    @staticmethod
    def _heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The kernel at any number of rows: a window's rows alike whatever its size."""
        return torch.ops.mtp_native.bf16_heads(x, w)

    def router_logits(self, x, weight):
        """Traced, ``window_router_logits``: a token's scores alike alone and in a window."""
        if not torch.compiler.is_compiling():
            return super().router_logits(x, weight)
        return window_router_logits(x, weight)

    def latent_attention(self, q, ctx, bias, scale, kvr):
        """Traced, avx512_bf16.c's ``bf16_attend``: each query row alone, scores and softmax
        in float32, one rounding to bf16 at the end (a verify window's rows equal the same
        rows one at a time).  oneDNN's bf16 bmms took 100-150 us a layer at batch 1 on the
        0.5b model (12 heads, ~170 positions), ~8% of the step; the kernel ~25.  Uncompiled,
        torch's bmms, as every backend's."""
        if (not torch.compiler.is_compiling() or q.dtype != torch.bfloat16 or not ops_ready()
                or q.device.type != "cpu"):
            return super().latent_attention(q, ctx, bias, scale, kvr)
        out = torch.ops.mtp_native.bf16_attend(q.contiguous(), ctx.to(torch.bfloat16).contiguous(),
                                               bias.float().contiguous(), scale, kvr)
        return out.to(q.dtype)

    def paged_latent_attention(self, q, cache, block_tables, positions, scale, kvr):
        """Traced, avx512_bf16.c's ``bf16_attend_paged`` (an int8 cache's tensors:
        ``bf16_attend_paged_i8``, its rows dequantized as the step's int8_gather does them):
        ``bf16_attend``'s numbers, the context read in place through the block tables (no
        gathered copy of every sequence's context, no mask or bias tensors: at 1.5K positions
        those cost ~300 us a layer on the 0.5b model)."""
        if not torch.compiler.is_compiling() or not ops_ready():
            return None
        return native_paged_attention("bf16", q, cache, block_tables, positions, scale, kvr)


def vnni_mm(x_q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x_q int8 [M, K] . w int8 [N, K]^T -> int32 [M, N], the exact sums, through
    avx512_vnni.c (int8 backend "vnni"); without the kernel, the exact float path."""
    lib = kernel_library("avx512_vnni")
    if lib is None or not w.is_contiguous():
        return converted_mm(x_q.float(), w, EXACT_FLOAT_K).to(torch.int32)
    x = x_q if x_q.stride(-1) == 1 else x_q.contiguous()
    n, k = w.shape
    out = torch.empty(x.shape[0], n, dtype=torch.int32)
    if lib.i8_mm(x.data_ptr(), x.shape[0], k, x.stride(0), w.data_ptr(), n, out.data_ptr(), n,
                 torch.get_num_threads()) != 0:
        raise MemoryError("avx512_vnni.c: no memory for the activations' scratch")
    return out


def vnni_rows(rows: torch.Tensor, expert: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """rows [A, K] (quantized activations, any dtype holding int8 values), expert [A], w
    int8 [E, N, K] -> int32 [A, N], exact: row a through expert expert[a]."""
    lib = kernel_library("avx512_vnni")
    if lib is None or not w.is_contiguous():
        return torch.stack([converted_mm(r[None].float(), w[e], EXACT_FLOAT_K)[0]
                            for r, e in zip(rows, expert.tolist())]).to(torch.int32)
    x = rows.to(torch.int8).contiguous()
    ids = expert.to(torch.int64).contiguous()
    out = torch.empty(x.shape[0], w.shape[1], dtype=torch.int32)
    if lib.i8_rows(x.data_ptr(), x.shape[0], x.shape[1], ids.data_ptr(), w.data_ptr(), w.shape[1],
                   out.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError("avx512_vnni.c: no memory for the activations' scratch")
    return out


kernel_operator("i8_mm(Tensor x_q, Tensor w) -> Tensor", vnni_mm,
                lambda x_q, w: x_q.new_empty(x_q.shape[0], w.shape[0], dtype=torch.int32))
kernel_operator("i8_rows(Tensor rows, Tensor expert, Tensor w) -> Tensor", vnni_rows,
                lambda rows, expert, w: rows.new_empty(rows.shape[0], w.shape[1], dtype=torch.int32))
