"""16-bit float products on a CPU without 16-bit float instructions (AVX2 only: no
AVX512_BF16, no AMX).

Why: there oneDNN's bf16 product converts the weight to float32 for every row it
multiplies, so it costs a single-row product per row (2 threads, AMD EPYC):

* a decode window's rows: the 0.5b model's [32000, 1536] head took 5.1 / 9.5 / 14.3 ms for
  1 / 2 / 3 rows, the absorbed attention's W_UK bmm 0.43 / 0.82 / 1.28 ms, so a k=1 step
  cost 2.7x a plain step and MTP was slower than none;
* a prompt's rows: [8192, 1536] at 200 rows 237 ms, where converting the weight to float32
  once and running a float32 GEMM takes 62 ms ([1536, 3072]: 87 against 13 ms).

So ``HalfCpuProducts`` (a model's products, kernels/products.py), in the graphs of the
compiled step (``window``, by the kind of window; ``HalfCpuWindow``):

* ``"lone"`` (a lone sequence's window, 1..MAX_ROWS rows) and ``"batch"`` (two sequences
  or more, their number symbolic): each ``F.linear`` calls half_avx2.c as an operator
  (``batch_linear``), and the routed experts are one operator from the router's choice to
  the weighted sum (``half_gathered``: each chosen expert read once for all its tokens).
  The lone window took Inductor's fused float32 reductions (``rows_linear``, the experts
  as reductions too) before: on the 0.5b model (2-core Zen 3) a batch-1 step ran 39 tok/s
  against 43 through the kernel, and greedy tokens of k=1 and MTP off parted (position
  38 of 64); through the kernel they agree.  Without the kernel: lone, ``rows_linear``;
  batch, one float32 reduction per output column and row, the rows inner (the 0.5b
  model's batch-16 step: 810 ms with oneDNN's rows, 251 with the reductions, 140 with the
  kernel).
* ``"lone"`` and ``"batch"``: with mla_avx2.c (operators of ops.cpp), W_UK / W_UV as each
  head's weight through the window's rows (``head_rows``) and the attention over the
  latent cache read in place (``paged_latent_attention``); without it, W_UK / W_UV as
  reductions over a head's cached weights (``latent_query``, ``latent_value``: 0.07
  against oneDNN's 0.82 ms at 2 rows) and the attention's two products over the gathered
  context in float32 (``latent_attention``); the router's scores as one reduction per
  token and expert (``router_logits``: a row's, alone or in a window).
* ``"prompt"`` (a lone prompt, any length): linears and those bmms in float32.

Outside graphs, a product of a 16-bit weight (the routed experts of batch windows, the
heads, prompts) runs through ``half_avx2.c`` (``kernel_linear``; float16 weights up to
KERNEL_ROWS rows): it converts each weight vector in registers once for all rows, so the
weight is read once (the 0.5b model's [6144, 1536] at 4 / 16 rows: 0.56 / 2.1 ms against
3.2 / 4.3 for a converted float32 GEMM and 3.6 / 14.3 for oneDNN's), and each row's sums
do not depend on the others, so MTP's windows stay lossless against plain steps and a
prompt's position gets the numbers a decode step gives it, whatever part of the prompt
was cached (bf16 at a prompt's rows: 57-61 GMAC/s on 2 Zen 3 cores, MKL's float32 GEMM over
a converted copy 55-70).  Float16 past KERNEL_ROWS rows, or without the kernel (backend
"float32": no C compiler, no AVX2 / FMA / F16C, ``MTP_SERVE_HALF_KERNEL=0``, or forced),
FLOAT32_ROWS rows or more run in float32 (``float32_linear``), fewer through oneDNN.
Float32 models never take any of it, so the lossless float32 checks are untouched; bf16
outputs are bf16 rounding apart from oneDNN's (float32 sums in another order).
"""
from __future__ import annotations

import ctypes
import itertools

import torch
import torch.nn.functional as F

from server.model.kernels.gemm import converted_mm, kernel_operator, materialized
from server.model.kernels.native import half_kernel, kernel_library, native_ops, ops_ready
from server.model.kernels.products import Products, native_paged_attention, window_router_logits

MAX_ROWS = 8        # a lone window's rows unrolled in the graph (MTP k <= 7)
# Outside graphs, from here float32 GEMMs (float32_linear) beat oneDNN's bf16 rows, which
# read the weight once per row (4 rows, the 0.5b model's shapes: [512, 1536] 0.22 against
# 0.30 ms, [6144, 1536] 2.5 against 3.6, the head 14 against 19; at 3 rows oneDNN's).
FLOAT32_ROWS = 4
KERNEL_ROWS = 64    # eager float16: up to here half_avx2.c (kernel_linear); past it MKL's GEMMs
_HALF = (torch.bfloat16, torch.float16)


class HalfCpuProducts(Products):
    """16-bit weights on a CPU: half_avx2.c where ``kernel`` (backend "avx2"), float32
    GEMMs and fused reductions without it ("float32").  Weights of other dtypes take
    torch's own products."""

    takes_prompts = False          # a prompt graph would convert every weight on each call

    def __init__(self, kernel: ctypes.CDLL | None) -> None:
        super().__init__(native_half=False)
        # A flag, not the library: a compiled graph saves the objects it was traced with.
        self.uses_kernel = kernel is not None
        # MLA's head products and paged attention through mla_avx2.c's operators.
        self.mla = self.uses_kernel and mla_ops()
        self.name = "avx2" if self.uses_kernel else "float32"

    @property
    def kernel(self) -> ctypes.CDLL | None:
        return half_kernel() if self.uses_kernel else None

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.dtype not in _HALF or weight.device.type != "cpu" or weight.dim() != 2 or x.dim() < 2:
            return F.linear(x, weight, bias)
        rows = x.numel() // max(1, x.shape[-1])
        if torch.compiler.is_compiling():
            # Traced outside a window form (a layer compiled on its own): the kernel as the
            # graph's operator; ``self.kernel`` would trace into the library's loading.
            return batch_linear(x, weight, bias, self.uses_kernel)
        if kernel_takes(weight.dtype, rows) and (out := kernel_linear(self.kernel, x, weight, bias)) is not None:
            return out
        if rows >= FLOAT32_ROWS:
            return float32_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def columns_exact(self, weight: torch.Tensor, rows: int) -> bool:
        # half_avx2.c's half_mm_bf16: pair_rows' two chains an output at any M (weight_block
        # says so); float16 takes block_f16, not screened.
        return (self.uses_kernel and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                and weight.dim() == 2 and weight.is_contiguous() and rows > 0
                and self.kernel is not None)

    def experts(self, xs: torch.Tensor, counts: list[int], gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor | None:
        if torch.compiler.is_compiling():
            return None
        return kernel_experts(self.kernel, xs, counts, gate_up, down)

    def gathered_experts(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                         gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor | None:
        """With the kernel, ``half_gathered`` (an operator of a traced graph): the eager
        MoE's numbers, each chosen expert read once for all its tokens."""
        if not self.groups_experts(gate_up.dtype):
            return None
        wts, ids = weights.float().contiguous(), idx.to(torch.int64).contiguous()
        if not torch.compiler.is_compiling():
            return half_gathered(x, wts, ids, gate_up, down).to(x.dtype)
        if ops_ready() and gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous() and down.is_contiguous():
            # The C++ operator: the Python one cost ~30 us a layer in its own dispatch.
            return torch.ops.mtp_native.half_moe(x.float().contiguous(), wts, ids, gate_up, down).to(x.dtype)
        return torch.ops.mtp_serve.half_gathered(x, wts, ids, gate_up, down).to(x.dtype)

    def groups_experts(self, dtype: torch.dtype) -> bool:
        return self.uses_kernel and dtype in _HALF

    def takes_head_rows(self, weight: torch.Tensor) -> bool:
        return self.mla and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"

    def head_rows(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The absorbed attention's W_UK / W_UV: each (token, head) a row through its head's
        weight, every head's weight read once for all the rows (mla_avx2.c ``half_heads``).
        In a window before, Inductor's reductions with the gathered context: ~150 us a layer
        on the 0.5b model at batch 1 for W_UK, ~60 for W_UV, where the 2.4 MB read takes ~70."""
        return torch.ops.mtp_native.half_heads(x.to(torch.bfloat16).contiguous(), w).to(x.dtype)

    def window(self, window: str) -> Products:
        super().window(window)
        return HalfCpuWindow(self.kernel, window)


class HalfCpuWindow(HalfCpuProducts):
    """The forms a compiled graph of one window takes (module docstring).  Called outside a
    trace (another thread serving the model while a graph of it is traced) it computes as
    ``HalfCpuProducts`` does: the forms are for Inductor, slow uncompiled."""

    def __init__(self, kernel: ctypes.CDLL | None, window: str) -> None:
        super().__init__(kernel)
        self.kind = window
        self.name = f"{self.name}:{window}"

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return super().linear(x, weight, bias)
        if weight.dtype not in _HALF or weight.device.type != "cpu" or weight.dim() != 2:
            return F.linear(x, weight, bias)
        if self.kind == "prompt":
            return float32_linear(x, weight, bias)
        if self.kind == "lone" and x.dim() == 2 and self.uses_kernel:
            return batch_linear(x, weight, bias)
        if self.kind == "lone" and x.dim() == 2 and x.shape[0] <= MAX_ROWS:
            return rows_linear(x, weight, bias)
        if self.kind == "batch" and x.dim() == 2:
            return batch_linear(x, weight, bias, self.uses_kernel)
        return F.linear(x, weight, bias)

    def experts(self, xs, counts, gate_up, down):
        return None if torch.compiler.is_compiling() else super().experts(xs, counts, gate_up, down)

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """In a window, ``window_router_logits`` (a token's scores alike alone and in a
        window: on the 0.5b model MTP k=1's greedy tokens had parted from MTP off's)."""
        if not torch.compiler.is_compiling() or self.kind == "prompt":
            return super().router_logits(x, weight)
        return window_router_logits(x, weight)

    def latent_query(self, q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """In a window, a reduction over dn: a head's W_UK (the 0.5b model: 12 x 128 x 384,
        1.2 MB) stays in cache across rows, so any row count takes it; in a prompt, a
        float32 bmm."""
        if not torch.compiler.is_compiling():
            return super().latent_query(q_nope, w_uk)
        if self.kind == "prompt":
            return torch.bmm(q_nope.transpose(0, 1).float(), w_uk.float()).transpose(0, 1).to(q_nope.dtype)
        return (materialized(q_nope.float())[..., None] * w_uk.float()).sum(2).to(q_nope.dtype)

    def latent_value(self, o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """A reduction over kvr (a window) or a float32 bmm (a prompt)."""
        if not torch.compiler.is_compiling():
            return super().latent_value(o, w_uv)
        if self.kind == "prompt":
            return torch.bmm(o.transpose(0, 1).float(), w_uv.transpose(1, 2).float()).transpose(0, 1).to(o.dtype)
        return (materialized(o.float())[:, :, None, :] * w_uv.float()).sum(-1).to(o.dtype)

    def latent_attention(self, q, ctx, bias, scale, kvr):
        """In float32: oneDNN's bf16 bmm took 355 us a layer for the 0.5b model's 12 heads
        over 272 rows (the two products, 14% of a decode step), a float32 one a few; the
        scores and the softmax keep float32's precision too."""
        if not torch.compiler.is_compiling():
            return super().latent_attention(q, ctx, bias, scale, kvr)
        return super().latent_attention(q.float(), ctx.float(), bias, scale, kvr).to(q.dtype)

    def paged_latent_attention(self, q, cache, block_tables, positions, scale, kvr):
        """Traced, mla_avx2.c's ``half_attend_paged`` (``_i8`` on an int8 cache): the context
        read in place through the block tables, each row's scores, softmax and weighted sum
        its own.  The gathered form took ~130 us a layer on the 0.5b model at batch 1 with
        ~100 positions (the copy, its mask, and MKL's threading for 12 query rows)."""
        if not torch.compiler.is_compiling() or not self.mla:
            return None
        return native_paged_attention("half", q, cache, block_tables, positions, scale, kvr)

    def window(self, window: str) -> Products:
        return HalfCpuProducts(self.kernel).window(window)


def mla_ops() -> bool:
    """Whether mla_avx2.c is loaded and reachable as torch.ops.mtp_native's operators."""
    return native_ops() and kernel_library("mla_avx2") is not None


def kernel_takes(dtype: torch.dtype, rows: int) -> bool:
    """Whether eager products of ``rows`` rows go to half_avx2.c: bf16 at any count (past
    16 rows in tiles, a decode step's arithmetic), float16 up to KERNEL_ROWS (then MKL)."""
    return dtype == torch.bfloat16 or rows <= KERNEL_ROWS


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-d ``x`` of a few rows, as one float32 reduction
    per row over the converted weight (for Inductor to fuse; slow uncompiled)."""
    w = weight.float()
    xf = materialized(x.float())        # not recomputed for every output column
    out = torch.stack([(w * xf[i]).sum(-1) for i in range(x.shape[0])]).to(x.dtype)
    return out if bias is None else out + bias


def batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel: bool = True) -> torch.Tensor:
    """``F.linear`` for a batch window's rows (their number symbolic): half_avx2.c as an
    operator of the graph (``half_mm``: [6144, 1536] at 16 rows 2.1 ms); without the
    kernel, one float32 reduction per output column and row, the rows inner, so that each
    weight row is read from memory once for all of them ([8192, 1536] at 16 rows: 10.3 ms
    against oneDNN's 19.1)."""
    if kernel and weight.is_contiguous():
        op = torch.ops.mtp_native.half_mm if ops_ready() else torch.ops.mtp_serve.half_mm
        out = op(x.reshape(-1, x.shape[-1]).float(), weight)
        out = out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
    else:
        out = (weight.float()[:, None, :] * materialized(x.float())[None, :, :]).sum(-1).t().to(x.dtype)
    return out if bias is None else out + bias


def float32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through float32 GEMMs over the converted weight, for many rows; eager,
    by blocks of the weight (``gemm.converted_mm``)."""
    b = None if bias is None else bias.float()
    if torch.compiler.is_compiling():
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    n, k = weight.shape
    out = converted_mm(x.reshape(-1, k).float(), weight)
    return (out if b is None else out + b).to(x.dtype).view(*x.shape[:-1], n)


def kernel_linear(lib: ctypes.CDLL | None, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear`` through half_avx2.c (module docstring), eager; None where it does not
    apply (no kernel, a weight that is not a row-major 16-bit CPU matrix)."""
    if (lib is None or weight.dtype not in _HALF or weight.device.type != "cpu"
            or weight.dim() != 2 or not weight.is_contiguous()):
        return None
    n, k = weight.shape
    out = _kernel_mm(lib, x.reshape(-1, k).float(), weight)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], n)


def kernel_experts(lib: ctypes.CDLL | None, xs: torch.Tensor, counts: list[int],
                   gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor | None:
    """A routed MoE's experts over their rows in one half_avx2.c call (``experts`` there):
    xs [A, H], expert e's rows the e-th ``counts[e]`` of them; gate_up [E, 2I, H], down
    [E, H, I] (MoE.expert_stacks) -> float32 [A, H].  None where it does not apply (no
    kernel; float16 weights with an expert of more than KERNEL_ROWS rows: a prompt's, for
    MKL's GEMMs)."""
    if (lib is None or torch.compiler.is_compiling()
            or gate_up.dtype not in _HALF or gate_up.device.type != "cpu"
            or not (gate_up.is_contiguous() and down.is_contiguous())
            or not kernel_takes(gate_up.dtype, max(counts, default=0))):
        return None
    e, i2, h = gate_up.shape
    xf = xs.float().contiguous()
    offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
    gu = torch.empty(xf.shape[0], i2, dtype=torch.float32)
    out = torch.empty(xf.shape[0], h, dtype=torch.float32)
    fn = lib.half_experts_bf16 if gate_up.dtype == torch.bfloat16 else lib.half_experts_f16
    if fn(xf.data_ptr(), h, i2 // 2, offsets.data_ptr(), e, gate_up.data_ptr(), down.data_ptr(),
          gu.data_ptr(), out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("half_avx2.c: no memory for the split rows")
    return out


def half_gathered(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """Each token of x [T, H] through its top-k experts (weights / idx [T, k]; gate_up
    [E, 2I, H], down [E, H, I] 16-bit) -> float32 [T, H], as one operator a compiled graph
    calls (bf16: one call of half_avx2.c's ``half_moe_bf16``): the pairs sorted by expert
    through ``half_experts_*`` (each chosen expert read once for all its tokens), then
    each token's weighted outputs added from zero in the order of their experts: the eager
    MoE's numbers (layers/moe.py: its experts through the same kernel, its float32
    ``index_add_``), so a token's output does not depend on the window it is in.  Where a
    graph built with it is loaded without the kernel, float32 products expert by expert."""
    t, k = idx.shape
    lib = half_kernel()
    if lib is not None and gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous() and down.is_contiguous():
        xf = x.float().contiguous()
        ids, wts = idx.to(torch.int64).contiguous(), weights.float().contiguous()
        out = torch.empty(t, down.shape[1], dtype=torch.float32)
        status = lib.half_moe_bf16(xf.data_ptr(), t, xf.shape[1], down.shape[2], k, ids.data_ptr(),
                                   wts.data_ptr(), gate_up.shape[0], gate_up.data_ptr(), down.data_ptr(),
                                   out.data_ptr(), torch.get_num_threads())
        if status == 0:
            return out
        if status == 1:
            raise MemoryError("half_avx2.c: no memory for the MoE's scratch")
    if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < gate_up.shape[0]):
        raise IndexError(f"an expert id outside [0, {gate_up.shape[0]})")
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    xs = x.float().index_select(0, order // k)
    ys = kernel_experts(half_kernel(), xs, counts, gate_up, down)
    if ys is None:
        parts, start = [], 0
        for e, n in enumerate(counts):
            if n:
                g, u = F.linear(xs[start:start + n], gate_up[e].float()).chunk(2, dim=-1)
                parts.append(F.linear(F.silu(g) * u, down[e].float()))
                start += n
        ys = torch.cat(parts) if parts else xs.new_zeros(0, down.shape[1])
    pairs = torch.empty_like(ys)
    pairs[order] = ys
    pairs = pairs.view(t, k, -1) * weights.float()[:, :, None]
    ranked = pairs.gather(1, idx.argsort(dim=1, stable=True)[:, :, None].expand_as(pairs))
    out = torch.zeros(t, ys.shape[1], dtype=torch.float32)
    for j in range(k):
        out += ranked[:, j]
    return out


kernel_operator("half_gathered(Tensor x, Tensor weights, Tensor idx, Tensor gate_up, Tensor down) -> Tensor",
                half_gathered,
                lambda x, weights, idx, gate_up, down: x.new_empty(x.shape[0], down.shape[1],
                                                                   dtype=torch.float32))


def half_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x float32 [M, K] . weight [N, K]^T -> float32 [M, N] through half_avx2.c, as one
    operator a compiled graph calls (Inductor cannot trace ctypes; gemm.py's fragment
    says why not ``custom_op``).  Where a graph built with it is loaded without the
    kernel, the converted float32 product."""
    lib = half_kernel()
    if lib is None or not weight.is_contiguous():
        return converted_mm(x, weight)
    return _kernel_mm(lib, x, weight)


kernel_operator("half_mm(Tensor x, Tensor weight) -> Tensor", half_mm,
                lambda x, weight: x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32))


def _kernel_mm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's call itself (eager callers skip the operator's dispatch: the routed
    experts make hundreds of these a step)."""
    n, k = weight.shape
    xf = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(xf.shape[0], n, dtype=torch.float32)
    fn = lib.half_mm_bf16 if weight.dtype == torch.bfloat16 else lib.half_mm_f16
    if fn(xf.data_ptr(), xf.shape[0], k, xf.stride(0), weight.data_ptr(), n, out.data_ptr(), n,
          torch.get_num_threads()):
        raise MemoryError("half_avx2.c: no memory for the split rows")
    return out
