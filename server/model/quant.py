"""Int8 linear layers for quantized DeepSeek checkpoints (msModelSlim and compressed-tensors).

Schemes (formulas from msModelSlim's weight-format documentation; W is int8 [out, in]):
  w8a8_dynamic  weights per-channel symmetric (weight_scale [out]); activations per token,
                symmetric: s_t = max|x_t| / 127, x_q = round(x / s_t);
                y = (x_q . W^T) * s_t * weight_scale.  msModelSlim W8A8_DYNAMIC, W4A8_DYNAMIC
                (its int4 weights unpacked to int8 at load) and compressed-tensors int8 with
                channel weights and dynamic token activations all compute this way.
  w8a8_static   activations per tensor, asymmetric, calibrated: x_q = round(x / input_scale
                + input_offset); y = (x_q . W^T + quant_bias) * deq_scale, where the saver
                folded the offset's contribution (and any bias) into quant_bias.

The integer products x_q . W^T are exact with two backends, so between them the choice
changes speed only: ``torch._int_mm`` computes them as int8 x int8 -> int32 (oneDNN with
VNNI/AMX on x86, the path on CUDA); the "float" backend runs them through a float32 GEMM,
exact while every partial sum stays below 2**24 (in-features up to 1024 per chunk; wider
inputs are split into such chunks and summed in float64).  With torch 2.4 on this
project's first CPUs ``_int_mm`` measured 20-40x slower than a float GEMM; with torch 2.13
on an AVX512-VNNI / AMX Xeon a [1, 1536] x [1536, 8192] product took 1.7 ms against 7.9 ms
for bf16 and 32 ms for the float path.  Weights stay resident as int8 either way; the
float copy of a chunk lives only for the call.

A third backend, "int8pack", is for 16-bit models on CPUs where neither is fast (AVX2
without VNNI: ``_int_mm`` streams 3 GB/s, the float path converts the weight every call):
``torch._weight_int8pack_mm`` (weight-only int8, bf16 activations) takes the quantized
activations as bf16, which holds every int8 value exactly, and unit scales, so it returns
the same integer sums rounded once to bf16; the scales are applied in float32 after, as
with the exact backends.  Its outputs are within a bf16 rounding of theirs, which a
16-bit model's outputs are rounded to anyway, and still a function of each row alone (its
float32 sums of integers are exact below 2**24 in any order), so MTP stays lossless.  At
[1, 1536] x [1536, 8192] on the 2-core AVX2 EPYC: 0.56 ms against 1.30 ms for bf16 and
31 ms for the float path.  Float32 models never take it (their outputs keep the exact
sums), nor do row-parallel layers (their ranks add exact int32 partial sums).

A fourth, "avx2", is our own kernel (half_avx2.c, built at first use: bf16_cpu.half_kernel)
for CPUs with AVX2 and no VNNI: it reads the int8 weight a byte a value, widens it to int16
in registers and sums the products in int32 (vpmaddwd), so its sums are ``_int_mm``'s, for
any model dtype, and each row's are its own.  At
[1, 1536] x [1536, 6144] on the 2-core AVX2 EPYC it streams the weight at the memory's
rate, about twice the rate of bf16 weights in values a second.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from server.model import collectives
from server.model.kernels import choice, cpu_caps, int8pack

EXACT_FLOAT_K = 1024          # 1024 * 127 * 128 < 2**24: float32 sums of int8 products are exact
# From here, eager, an "int8pack" product takes the exact float path instead: the kernel is
# compute-bound on AVX2 ([6144, 1536] at 203 rows: 44.6 against 30.0 ms; at 32 rows 7.2
# against 8.5, but the experts' [1536, 512] 0.60 against 0.52, [2304, 768] 1.31 / 1.11).
INT8PACK_MAX_ROWS = 32
BLOCK_BYTES = 4 << 20   # converted_mm: float32 weight converted per block
FLIP_ROWS = 128         # converted_mm: up to here the weight is the GEMM's left operand
SCHEMES = ("w8a8_dynamic", "w8a8_static")
EXACT_BACKENDS = ("int_mm", "float", "avx2")
_FASTEST: dict[tuple[str, bool], str] = {}


def fastest_int8_backend(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """The backend that computes a decode-sized and a batch-sized int8 product fastest on
    this device (measured once per process and kind of model; CUDA always takes int_mm):
    "int_mm" or "float" (the same exact integers), or for a 16-bit model on a CPU also
    "int8pack" (module docstring)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "int_mm"
    half = dtype in (torch.bfloat16, torch.float16)
    if (kind, half) not in _FASTEST:
        candidates = choice.int8_candidates(cpu_caps(), half, _int8_kernel() is not None)
        _FASTEST[(kind, half)] = _measure_int8_backends(candidates)
    return _FASTEST[(kind, half)]


def _measure_int8_backends(backends: tuple[str, ...]) -> str:
    import time
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (2048, 1024), dtype=torch.int8, generator=g)
    times = {}
    for backend in backends:
        total = 0.0
        for m in (1, 16):
            x = torch.randint(-127, 128, (m, 1024), dtype=torch.int8, generator=g)
            try:
                int8_matmul(x, w, backend)               # warm (first-call set-up)
                runs = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    int8_matmul(x, w, backend)
                    runs.append(time.perf_counter() - t0)
            except RuntimeError:                         # not built for this device
                runs = [float("inf")]
            total += sorted(runs)[len(runs) // 2]
        times[backend] = total
    return min(times, key=times.get)


def packs(backend: str, in_features: int) -> bool:
    """Whether a product of ``in_features`` inputs on ``backend`` runs through the int8pack
    kernel (its rules: kernels/int8pack.py); otherwise it takes the exact float path."""
    return backend == "int8pack" and int8pack.takes(in_features)


def int8_matmul(x_q: torch.Tensor, w: torch.Tensor, backend: str) -> torch.Tensor:
    """x_q int8 [M, K] . w int8 [N, K]^T -> [M, N] holding the exact integer sums (float32/64
    or int32 by backend), or with "int8pack" those sums rounded to bf16 (as float32) for
    fewer than INT8PACK_MAX_ROWS rows (from there, eager, the exact float path)."""
    if backend == "int_mm":
        return torch._int_mm(x_q, w.t())
    if backend == "avx2":
        if torch.compiler.is_compiling():
            return torch.ops.mtp_serve.int8_mm(x_q, w)
        return int8_kernel_mm(x_q, w)
    if (packs(backend, x_q.shape[1]) and int8pack.weight_fits(w)
            and (x_q.shape[0] < INT8PACK_MAX_ROWS or torch.compiler.is_compiling())):
        return int8pack.int8pack_mm(x_q.to(torch.bfloat16), w, _unit_scales(w)).float()
    if not torch.compiler.is_compiling():
        return converted_mm(x_q.float(), w, EXACT_FLOAT_K)     # exact: the sums below, eager
    K = x_q.shape[1]
    if K <= EXACT_FLOAT_K:
        return F.linear(x_q.float(), w.float())
    acc = None
    for k0 in range(0, K, EXACT_FLOAT_K):
        part = F.linear(x_q[:, k0:k0 + EXACT_FLOAT_K].float(), w[:, k0:k0 + EXACT_FLOAT_K].float()).double()
        acc = part if acc is None else acc + part
    return acc


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
        wf = w[r0:r0 + step].float()
        acc = None
        for k0 in range(0, k, split):
            a, b = wf[:, k0:k0 + split], xf[:, k0:k0 + split]
            part = torch.mm(a, b.t()).t() if flip else torch.mm(b, a.t())
            acc = part if acc is None else acc.double() + part
        out[:, r0:r0 + step] = acc
    return out


def _int8_kernel():
    from server.model.bf16_cpu import half_kernel     # bf16_cpu imports this module
    return half_kernel()


def int8_kernel_mm(x_q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x_q int8 [M, K] . w int8 [N, K]^T -> int32 [M, N], the exact sums, through
    half_avx2.c's ``int8_mm`` (backend "avx2"); where the kernel is missing (a graph
    compiled with it, loaded without), the exact float path."""
    lib = _int8_kernel()
    if lib is None or not w.is_contiguous():
        return converted_mm(x_q.float(), w, EXACT_FLOAT_K).to(torch.int32)
    n, k = w.shape
    x16 = x_q.to(torch.int16).contiguous()
    out = torch.empty(x16.shape[0], n, dtype=torch.int32)
    lib.int8_mm(x16.data_ptr(), x16.shape[0], k, k, w.data_ptr(), n, out.data_ptr(), n,
                torch.get_num_threads())
    return out


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


kernel_operator("int8_mm(Tensor x_q, Tensor w) -> Tensor", int8_kernel_mm,
                lambda x_q, w: x_q.new_empty(x_q.shape[0], w.shape[0], dtype=torch.int32))


def int8_rows(rows: torch.Tensor, expert: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """rows [A, K] (quantized activations, as floats), expert int64 [A], w int8 [E, N, K]
    -> int32 [A, N]: row a through expert expert[a], exact, on the "avx2" backend, each
    chosen expert's rows read in place (half_avx2.c ``int8_rows``)."""
    lib = _int8_kernel()
    if lib is None:
        return torch.stack([converted_mm(r[None].float(), w[e], EXACT_FLOAT_K)[0]
                            for r, e in zip(rows, expert.tolist())]).to(torch.int32)
    a, k = rows.shape
    x16 = rows.to(torch.int16).contiguous()
    ids = expert.to(torch.int64).contiguous()
    out = torch.empty(a, w.shape[1], dtype=torch.int32)
    lib.int8_rows(x16.data_ptr(), a, k, ids.data_ptr(), w.data_ptr(), w.shape[1], out.data_ptr(),
                  torch.get_num_threads())
    return out


kernel_operator("int8_rows(Tensor rows, Tensor expert, Tensor w) -> Tensor", int8_rows,
                lambda rows, expert, w: rows.new_empty(rows.shape[0], w.shape[1], dtype=torch.int32))


def _unit_scales(w: torch.Tensor) -> torch.Tensor:
    """bf16 ones, one per output row of ``w`` [..., N, K]: the int8pack kernel's scales (the
    real ones are applied in float32 after).  In a traced graph a buffer of its own:
    Inductor's lowering of the kernel takes no computed scales."""
    ones = torch.ones(w.shape[-2], dtype=torch.bfloat16, device=w.device)
    return materialized(ones) if torch.compiler.is_compiling() else ones


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """The dynamic scheme's per-token activation scale: max|x| / 127 over the last dim."""
    return x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 127.0


def quantize_rows(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """round(x / s) clamped to [-127, 127], still in x's (float) dtype."""
    return torch.round(x / s).clamp(-127, 127)


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
    model's 4 experts of [1536 x 512] took 6.7 ms a token, compiled, 2 threads."""
    xf = x.float()
    s = row_scales(xf)                                                   # [T, 1]
    if backend == "avx2":
        x_q = quantize_rows(xf, s)
        flat = idx.reshape(-1)
        acc = torch.ops.mtp_serve.int8_rows(x_q[:, None, :].expand(*idx.shape, -1).reshape(
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
    if backend == "avx2":
        acc2 = torch.ops.mtp_serve.int8_rows(quantize_rows(act, s2).reshape(idx.numel(), -1),
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


def materialized(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, made a buffer of its own in a compiled graph.  Inductor inlines a
    pointwise producer into its consumer; inlined into the reduction above, the
    activation's quantization (divide, round, clamp) would run again for every output
    row: measured at [1, 1536] x 4 experts of [1536, 1536], one thread, 3.2 ms against
    1.0 ms stored.  A concatenation is a kernel of its own, so its result is."""
    pad = t.new_zeros(*t.shape[:-1], 1)
    return torch.cat([t, pad], dim=-1)[..., :-1]


def int8_expert(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                down: torch.Tensor, down_scale: torch.Tensor, backend: str) -> torch.Tensor:
    """One int8 SwiGLU expert (dynamic scheme) on its rows x [n, H]: gate and up as one
    product over their stacked rows (gate_up [2I, H]), so the rows are quantized once and
    one GEMM runs where two QuantLinears run two of each; the integer sums and every
    scaling step are QuantLinear's, so the output is the same bit for bit."""
    xf = x.float()
    s = row_scales(xf)
    g, u = (int8_matmul(quantize_rows(xf, s).to(torch.int8), gate_up, backend).float()
            * (s * gate_up_scale)).to(x.dtype).chunk(2, dim=-1)
    act = (F.silu(g) * u).float()
    s2 = row_scales(act)
    acc = int8_matmul(quantize_rows(act, s2).to(torch.int8), down, backend)
    return (acc.float() * (s2 * down_scale)).to(x.dtype)


def gatherable(linear: nn.Module) -> bool:
    """An int8 layer the gathered experts can read by index: dynamic scheme, no bias,
    whole on this rank."""
    return isinstance(linear, QuantLinear) and linear.scheme == "w8a8_dynamic" \
        and linear.bias is None and not linear.row_parallel


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


class QuantLinear(nn.Module):
    """A linear layer whose weight is int8 [out, in]; see the module docstring for the maths.

    ``row_parallel``: this rank holds a slice of the input features (tensor parallel,
    model/parallel.py) and every rank of the group runs the layer on the same tokens.  The
    result is then the one process's, bit for bit: a dynamic scheme's per-token scale is
    the maximum over all ranks' slices (one MAX all-reduce of [M, 1]), and the ranks' exact
    integer sums are added as integers (one int32 all-reduce) before anything is scaled;
    the bias (static: ``quant_bias``) is added once, after.  Summing per-rank float
    outputs instead would quantize each slice on its own scale and round each partial."""

    def __init__(self, in_features: int, out_features: int, scheme: str, *,
                 backend: str = "float", bias: bool = False, row_parallel: bool = False) -> None:
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"quantization scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.backend = scheme, backend
        self.row_parallel = row_parallel

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.weight = param(out_features, in_features, dtype=torch.int8)
        if scheme == "w8a8_dynamic":
            self.weight_scale = param(out_features, dtype=torch.float32)
        else:
            self.input_scale = param(1, dtype=torch.float32)
            self.input_offset = param(1, dtype=torch.float32)
            self.deq_scale = param(out_features, dtype=torch.float32)
            self.quant_bias = param(out_features, dtype=torch.int32)
        self.bias = param(out_features, dtype=torch.float32) if bias else None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"scheme={self.scheme}, backend={self.backend}"
                + (", row_parallel" if self.row_parallel else ""))

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out, in] (dynamic scheme): for layers the model reads as a raw matrix."""
        return self.weight.float() * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()                              # [M, K]
        if self.scheme == "w8a8_dynamic":
            amax = x2.abs().amax(dim=-1, keepdim=True)                      # [M, 1]
            if self.row_parallel:
                amax = collectives.all_reduce(amax, "max")
            s = amax.clamp(min=1e-10) / 127.0
            x_q = quantize_rows(x2, s).to(torch.int8)
            y = self._integer_sums(x_q).float() * (s * self.weight_scale)
        else:
            x_q = torch.round(x2 / self.input_scale + self.input_offset).clamp_(-128, 127).to(torch.int8)
            acc = self._integer_sums(x_q) + self.quant_bias
            y = acc.float() * self.deq_scale
        if self.bias is not None and self.scheme == "w8a8_dynamic":
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _integer_sums(self, x_q: torch.Tensor) -> torch.Tensor:
        """x_q . W^T, summed over the group's input slices when row parallel (as int32:
        exact, and converting the exact sum to float32 rounds it as one process does)."""
        if not self.row_parallel:
            return int8_matmul(x_q, self.weight, self.backend)
        acc = int8_matmul(x_q, self.weight, "float" if self.backend == "int8pack" else self.backend)
        return collectives.all_reduce(acc.to(torch.int32))
