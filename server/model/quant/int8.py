"""Int8 products for quantized DeepSeek checkpoints (msModelSlim and compressed-tensors), on
each backend (quant/linear.py holds the layer).

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

A fourth, "avx2", is our own kernel (half_avx2.c, built at first use: native.half_kernel)
for CPUs with AVX2 and no VNNI: it reads the int8 weight a byte a value, widens it to int16
in registers and sums the products in int32 (vpmaddwd), so its sums are ``_int_mm``'s, for
any model dtype, and each row's are its own.  At
[1, 1536] x [1536, 6144] on the 2-core AVX2 EPYC it streams the weight at the memory's
rate, about twice the rate of bf16 weights in values a second.

A fifth, "vnni", is our kernel for CPUs with AVX-512 VNNI (kernels/avx512_vnni.c): 64
weight bytes per instruction and row, the same exact sums.  On the 2-core Zen 4 (memory
29-34 GB/s by a plain read) a decode row through the 0.5b model's shapes read its weights
at 12-23 GB/s where ``_int_mm`` read 3-5.  Where our C++ operators are built
(kernels/ops.cpp) avx2 and vnni products are called through them, eager and compiled.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from server.model.kernels import choice, cpu_caps, int8pack
from server.model.kernels.avx512 import vnni_mm
from server.model.kernels.gemm import (
    EXACT_FLOAT_K,
    converted_mm,
    kernel_operator,
    materialized,
)
from server.model.kernels.native import half_kernel, ops_ready
from server.model.kernels.select import built_kernels

# From here, eager, an "int8pack" product takes the exact float path instead: the kernel is
# compute-bound on AVX2 ([6144, 1536] at 203 rows: 44.6 against 30.0 ms; at 32 rows 7.2
# against 8.5, but the experts' [1536, 512] 0.60 against 0.52, [2304, 768] 1.31 / 1.11).
INT8PACK_MAX_ROWS = 32


EXACT_BACKENDS = ("int_mm", "float", "avx2", "vnni")


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
        candidates = choice.int8_candidates(cpu_caps(), half, _built_kernels())
        _FASTEST[(kind, half)] = _measure_int8_backends(candidates)
    return _FASTEST[(kind, half)]


def _measure_int8_backends(backends: tuple[str, ...]) -> str:
    """The backend whose products of a decode window's rows (1 and 8) through a weight
    larger than the caches (32 MiB: a decode step streams its weights from memory) took
    the least time, medians of 5 after a warm-up.  The float path converts every weight it
    reads and is measured on a slice, scaled: it is never close."""
    import time
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (8192, 4096), dtype=torch.int8, generator=g)
    times = {}
    for backend in backends:
        total = 0.0
        rows_of_w = 512 if backend == "float" else w.shape[0]
        for m in (1, 8):
            x = torch.randint(-127, 128, (m, w.shape[1]), dtype=torch.int8, generator=g)
            try:
                int8_matmul(x, w[:rows_of_w], backend)          # warm (first-call set-up)
                runs = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    int8_matmul(x, w[:rows_of_w], backend)
                    runs.append(time.perf_counter() - t0)
            except RuntimeError:                         # not built for this device
                runs = [float("inf")]
            total += sorted(runs)[len(runs) // 2] * (w.shape[0] / rows_of_w)
        times[backend] = total
    return min(times, key=times.get)


def packs(backend: str, in_features: int) -> bool:
    """Whether a product of ``in_features`` inputs on ``backend`` runs through the int8pack
    kernel (its rules: kernels/int8pack.py); otherwise it takes the exact float path."""
    return backend == "int8pack" and int8pack.takes(in_features)


def int_mm(x_q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x_q int8 [M, K] . w int8 [N, K]^T -> int32 [M, N] through ``torch._int_mm`` (backend
    "int_mm": oneDNN with VNNI/AMX on x86, cuBLAS on CUDA)."""
    return torch._int_mm(x_q, w.t())


def int8_matmul(x_q: torch.Tensor, w: torch.Tensor, backend: str) -> torch.Tensor:
    """x_q int8 [M, K] . w int8 [N, K]^T -> [M, N] holding the exact integer sums (float32/64
    or int32 by backend), or with "int8pack" those sums rounded to bf16 (as float32) for
    fewer than INT8PACK_MAX_ROWS rows (from there, eager, the exact float path)."""
    if backend == "int_mm":
        return int_mm(x_q, w)
    if backend == "avx2":
        if ops_ready() and w.is_contiguous():   # the C++ operators, eager too: 2 us a call, not 8
            return torch.ops.mtp_native.int8_mm(x_q.to(torch.int16), w)
        if torch.compiler.is_compiling():
            return torch.ops.mtp_serve.int8_mm(x_q, w)
        return int8_kernel_mm(x_q, w)
    if backend == "vnni":
        if ops_ready() and w.is_contiguous():
            return torch.ops.mtp_native.i8_mm(x_q.contiguous(), w)
        if torch.compiler.is_compiling():
            return torch.ops.mtp_serve.i8_mm(x_q, w)
        return vnni_mm(x_q, w)
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


def _int8_kernel():
    return half_kernel()


def _built_kernels() -> frozenset[str]:
    """Our int8 kernels that run here (built now, once)."""
    return built_kernels(("half_avx2", "avx512_vnni"))


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


def dynamic_product(xf: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, backend: str) -> torch.Tensor:
    """The dynamic scheme's product of float32 rows xf [M, K] with int8 w [N, K] (scales
    w_scale [N]) -> float32 [M, N]: each row quantized by its own scale s, the exact integer
    sums, times s x w_scale.  Eager on the "avx2" backend, one operator does all of it
    (half_avx2.c ``int8_dynamic_mm``, the same operations in the same order: the same
    numbers), where torch's ~10 small operations took ~14% of a 256-token W8A8 prompt."""
    if (backend == "avx2" and not torch.compiler.is_compiling() and xf.dtype == torch.float32
            and w.is_contiguous() and xf.device.type == "cpu" and ops_ready()):
        return torch.ops.mtp_native.int8_dynamic_mm(xf.contiguous(), w, w_scale.float().contiguous())
    s = row_scales(xf)
    return int8_matmul(quantize_rows(xf, s).to(torch.int8), w, backend).float() * (s * w_scale)
