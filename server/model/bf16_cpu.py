"""16-bit float products on a CPU without 16-bit float instructions (AVX2 only: no
AVX512_BF16, no AMX).

Why: there oneDNN's bf16 product converts the weight to float32 for every row it
multiplies, so it costs a single-row product per row (2 threads, AMD EPYC):

* a decode window's rows: the 0.5b model's [32000, 1536] head took 5.1 / 9.5 / 14.3 ms for
  1 / 2 / 3 rows, the absorbed attention's W_UK bmm 0.43 / 0.82 / 1.28 ms, so a k=1 step
  cost 2.7x a plain step and MTP was slower than none;
* a prompt's rows: [8192, 1536] at 200 rows 237 ms, where converting the weight to float32
  once and running a float32 GEMM takes 62 ms ([1536, 3072]: 87 against 13 ms).

So, in the graphs of the compiled step (``traced``, by the kind of window):

* ``"lone"`` (a lone sequence's window, a constant 1..MAX_ROWS rows): each ``F.linear`` is
  one float32 reduction per row over the weight converted once (``rows_linear``); Inductor
  fuses the rows into one kernel that loads each weight vector once for all of them.  The
  head at 2 / 3 rows: 6.9 / 9.8 ms; a [1536 -> 3072 -> 1536] MLP at 2 rows 1.1 ms against
  2.8.  One row takes the same form (as fast as oneDNN's), so a window of k+1 rows
  computes each row exactly as a plain step does and MTP stays lossless in bf16 too.
* ``"batch"`` (two sequences or more, their number symbolic): each ``F.linear`` calls
  half_avx2.c as an operator (``batch_linear``), or without it is one float32 reduction
  per output column and row, the rows inner: the 0.5b model's batch-16 step took 810 ms
  with oneDNN's rows, 251 ms with the reductions, 140 with the kernel.
* ``"lone"`` and ``"batch"``: W_UK / W_UV as reductions over a head's cached weights
  (``latent_query``, ``latent_value``): 0.07 against 0.82 ms at 2 rows; the attention's
  two products over the context in float32 (``latent_attention``).
* ``"prompt"`` (a lone prompt, any length): linears and those bmms in float32.

Outside graphs, once a 16-bit model is loaded on such a CPU (``install``), an ``F.linear``
(the routed experts of batch windows, the heads, prompts) runs through ``half_avx2.c`` up
to KERNEL_ROWS rows (``kernel_linear``): it converts each weight vector in registers once
for all rows, so the weight is read once (the 0.5b model's [6144, 1536] at 4 / 16 rows:
0.56 / 2.1 ms against 3.2 / 4.3 for a converted float32 GEMM and 3.6 / 14.3 for oneDNN's),
and each row's sums do not depend on the others, so MTP's windows stay lossless against
plain steps.  Past KERNEL_ROWS rows, or without the kernel (no C compiler, no AVX2 / FMA /
F16C, ``MTP_SERVE_HALF_KERNEL=0``), FLOAT32_ROWS rows or more run in float32
(``float32_linear``).
Float32 models never take any of it, so the lossless float32 checks are untouched; bf16
outputs are bf16 rounding apart from oneDNN's (float32 sums in another order).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from server.model import kernels
from server.model.quant import converted_mm, kernel_operator, materialized

log = logging.getLogger("server.model")

MAX_ROWS = 8        # a lone window's rows unrolled in the graph (MTP k <= 7)
# Outside graphs, from here float32 GEMMs (float32_linear) beat oneDNN's bf16 rows, which
# read the weight once per row (4 rows, the 0.5b model's shapes: [512, 1536] 0.22 against
# 0.30 ms, [6144, 1536] 2.5 against 3.6, the head 14 against 19; at 3 rows oneDNN's).
FLOAT32_ROWS = 4
KERNEL_ROWS = 64    # eager, up to here half_avx2.c (kernel_linear); past it MKL's GEMMs
KERNEL_ENV = kernels.KERNEL_ENV            # 0: never build or use half_avx2.c
_KERNEL_SOURCE = Path(__file__).with_name("half_avx2.c")
_KERNEL_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-lm")
_HALF = (torch.bfloat16, torch.float16)
WINDOWS = ("lone", "batch", "prompt")


@functools.lru_cache(maxsize=None)
def pays(dtype: torch.dtype, device_type: str) -> bool:
    """Whether a model of ``dtype`` weights on ``device_type`` takes this module's forms
    (the 16-bit backend is "avx2" or "float32", not oneDNN's own: ``chosen_backend``)."""
    return device_type == "cpu" and dtype in _HALF and chosen_backend() != "onednn"


@functools.lru_cache(maxsize=None)
def chosen_backend() -> str:
    """This process's 16-bit product backend on a CPU (kernels/choice.py): forced by
    $MTP_SERVE_HALF_BACKEND, else "onednn" where the CPU multiplies 16-bit floats
    natively, else "avx2" where half_avx2.c built, else "float32".  The kernel is built
    only where the choice may need it."""
    forced, caps = kernels.kernel_settings().half_backend, kernels.cpu_caps()
    needs_kernel = forced == "avx2" or (forced == "auto" and not caps.native_bf16)
    return kernels.half_backend(caps, needs_kernel and half_kernel() is not None, forced)


def _half_kernel() -> ctypes.CDLL | None:
    """The kernel for 16-bit products: only where the chosen backend is "avx2"."""
    return half_kernel() if chosen_backend() == "avx2" else None


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-d ``x`` of a few rows, as one float32 reduction
    per row over the converted weight (for Inductor to fuse; slow uncompiled)."""
    w = weight.float()
    xf = materialized(x.float())        # not recomputed for every output column
    out = torch.stack([(w * xf[i]).sum(-1) for i in range(x.shape[0])]).to(x.dtype)
    return out if bias is None else out + bias


def batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a batch window's rows (their number symbolic): half_avx2.c as an
    operator of the graph (``half_mm``: [6144, 1536] at 16 rows 2.1 ms); without the
    kernel, one float32 reduction per output column and row, the rows inner, so that each
    weight row is read from memory once for all of them ([8192, 1536] at 16 rows: 10.3 ms
    against oneDNN's 19.1)."""
    if _kernel_ready() and weight.is_contiguous():
        out = torch.ops.mtp_serve.half_mm(x.reshape(-1, x.shape[-1]).float(), weight)
        out = out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
    else:
        out = (weight.float()[:, None, :] * materialized(x.float())[None, :, :]).sum(-1).t().to(x.dtype)
    return out if bias is None else out + bias


def float32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through float32 GEMMs over the converted weight, for many rows; eager,
    by blocks of the weight (``quant.converted_mm``)."""
    b = None if bias is None else bias.float()
    if torch.compiler.is_compiling():
        return _F_LINEAR(x.float(), weight.float(), b).to(x.dtype)
    n, k = weight.shape
    out = converted_mm(x.reshape(-1, k).float(), weight)
    return (out if b is None else out + b).to(x.dtype).view(*x.shape[:-1], n)


def kernel_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear`` through half_avx2.c (module docstring), eager; None where it does not
    apply (no kernel, a weight that is not a row-major 16-bit CPU matrix)."""
    lib = _half_kernel()
    if (lib is None or weight.dtype not in _HALF or weight.device.type != "cpu"
            or weight.dim() != 2 or not weight.is_contiguous()):
        return None
    n, k = weight.shape
    out = _kernel_mm(lib, x.reshape(-1, k).float(), weight)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], n)


def kernel_experts(xs: torch.Tensor, counts: list[int], gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor | None:
    """A routed MoE's experts over their rows in one half_avx2.c call (``experts`` there):
    xs [A, H], expert e's rows the e-th ``counts[e]`` of them; gate_up [E, 2I, H], down
    [E, H, I] (MoE.expert_stacks) -> float32 [A, H].  None where it does not apply (not
    installed, no kernel, an expert with more than KERNEL_ROWS rows: a prompt's, for
    MKL's GEMMs)."""
    lib = _half_kernel()
    if (not _installed or lib is None or torch.compiler.is_compiling()
            or gate_up.dtype not in _HALF or gate_up.device.type != "cpu"
            or not (gate_up.is_contiguous() and down.is_contiguous())
            or max(counts, default=0) > KERNEL_ROWS):
        return None
    e, i2, h = gate_up.shape
    xf = xs.float().contiguous()
    offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)
    gu = torch.empty(xf.shape[0], i2, dtype=torch.float32)
    out = torch.empty(xf.shape[0], h, dtype=torch.float32)
    fn = lib.half_experts_bf16 if gate_up.dtype == torch.bfloat16 else lib.half_experts_f16
    fn(xf.data_ptr(), h, i2 // 2, offsets.data_ptr(), e, gate_up.data_ptr(), down.data_ptr(),
       gu.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def half_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x float32 [M, K] . weight [N, K]^T -> float32 [M, N] through half_avx2.c, as one
    operator a compiled graph calls (Inductor cannot trace ctypes; quant.py's fragment
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
    fn(xf.data_ptr(), xf.shape[0], k, xf.stride(0), weight.data_ptr(), n, out.data_ptr(), n,
       torch.get_num_threads())
    return out


@functools.lru_cache(maxsize=None)
def half_kernel() -> ctypes.CDLL | None:
    """half_avx2.c, built at first use into the kernel cache (a file per source and
    compiler, written whole by rename, so processes building at once do not collide);
    None where it cannot be, logged once."""
    config = kernels.kernel_settings()
    if not config.half_kernel:
        return None
    if not kernels.cpu_caps().avx2_kernel:
        log.info("no AVX2 / FMA / F16C: 16-bit products take oneDNN and float32 GEMMs")
        return None
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        log.warning("no C compiler (cc): 16-bit products take oneDNN and float32 GEMMs, "
                    "slower at 2 rows and more")
        return None
    tag = hashlib.sha256(_KERNEL_SOURCE.read_bytes() + cc.encode()
                         + " ".join(_KERNEL_FLAGS).encode()).hexdigest()[:16]
    root = config.kernel_cache
    built = root / f"half_avx2-{tag}.so"
    try:
        if not built.exists():
            root.mkdir(parents=True, exist_ok=True)
            part = built.with_name(f"{built.name}.{os.getpid()}.part")
            done = subprocess.run([cc, *_KERNEL_FLAGS, "-o", str(part), str(_KERNEL_SOURCE)],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise OSError(done.stderr.strip()[-500:] or f"{cc} exited {done.returncode}")
            os.replace(part, built)
        lib = ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("half_avx2.c could not be built (%s): 16-bit products take oneDNN and "
                    "float32 GEMMs", exc)
        return None
    args = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
            ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    for fn in (lib.half_mm_bf16, lib.half_mm_f16):
        fn.argtypes, fn.restype = args, None
    moe = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    for fn in (lib.half_experts_bf16, lib.half_experts_f16):
        fn.argtypes, fn.restype = moe, None
    lib.int8_mm.argtypes, lib.int8_mm.restype = args, None
    lib.int8_rows.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    lib.int8_rows.restype = None
    return lib


@torch.compiler.assume_constant_result
def _kernel_ready() -> bool:
    """``_half_kernel`` as a constant of a traced graph (Dynamo does not trace the build)."""
    return _half_kernel() is not None


def latent_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The absorbed attention's W_UK product (attention.py): [T, nH, dn] x [nH, dn, kvr] ->
    [T, nH, kvr], a bmm.  In a window's graph traced here, a reduction over dn instead: a
    head's W_UK (the 0.5b model: 12 x 128 x 384, 1.2 MB) stays in cache across rows, so
    any row count takes it; in a prompt's, a float32 bmm."""
    if not reducing():
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    if _mode == "prompt":
        return torch.bmm(q_nope.transpose(0, 1).float(), w_uk.float()).transpose(0, 1).to(q_nope.dtype)
    return (materialized(q_nope.float())[..., None] * w_uk.float()).sum(2).to(q_nope.dtype)


def latent_value(o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The W_UV product: [T, nH, kvr] x [nH, dv, kvr] -> [T, nH, dv], a bmm; traced here, a
    reduction over kvr (a window) or a float32 bmm (a prompt)."""
    if not reducing():
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    if _mode == "prompt":
        return torch.bmm(o.transpose(0, 1).float(), w_uv.transpose(1, 2).float()).transpose(0, 1).to(o.dtype)
    return (materialized(o.float())[:, :, None, :] * w_uv.float()).sum(-1).to(o.dtype)


def latent_attention(q: torch.Tensor, ctx: torch.Tensor, bias: torch.Tensor, scale: float,
                     kvr: int) -> torch.Tensor:
    """softmax(q . ctx^T * scale + bias) . ctx[..., :kvr]: the absorbed attention over a
    context of latent rows (q [B, R, D], ctx [B, S, D], bias [B, R, S]) -> [B, R, kvr] in
    q's dtype.  In a graph traced here, in float32: oneDNN's bf16 bmm took 355 us a layer
    for the 0.5b model's 12 heads over 272 rows (the two products, 14% of a decode step),
    a float32 one a few; the scores and the softmax keep float32's precision too."""
    dtype = q.dtype
    if reducing():
        q, ctx = q.float(), ctx.float()
    scores = torch.baddbmm(bias.to(q.dtype), q, ctx.transpose(1, 2), alpha=scale)
    return torch.bmm(scores.softmax(-1), ctx[:, :, :kvr]).to(dtype)


def reducing() -> bool:
    """Whether a graph is being traced under ``traced`` (and so takes this module's forms)."""
    return _mode is not None and torch.compiler.is_compiling()


@contextlib.contextmanager
def traced(window: str) -> Iterator[None]:
    """Trace a graph for ``window`` (``WINDOWS``, module docstring) in this context.

    ``F.linear`` is swapped for the context (what ``nn.Linear.forward`` looks up when
    traced; a TorchFunctionMode would route every tensor method too, and Dynamo cannot
    trace some of them through one).  Calls outside a trace, from any thread, are not
    affected: the forms ask ``torch.compiler.is_compiling()``.  One traced graph at a time
    (the lock).  The caller says the window: under Dynamo a symbolic row count would pass
    an ``isinstance(rows, int)`` test and be specialised."""
    global _mode
    if window not in WINDOWS:
        raise ValueError(f"window {window!r}; allowed: {', '.join(WINDOWS)}")
    with _lock:
        before = F.linear
        _mode, F.linear = window, _linear
        try:
            yield
        finally:
            _mode, F.linear = None, before


def install() -> None:
    """From now on, in this process, an ``F.linear`` through a 16-bit CPU weight runs through
    ``kernel_linear`` up to KERNEL_ROWS rows, ``float32_linear`` from FLOAT32_ROWS rows past
    that or without the kernel (called where a 16-bit model is loaded on a CPU that ``pays``)."""
    global _installed
    with _lock:
        if not _installed:
            _installed = True
            F.linear = _linear
            kernel = _half_kernel() is not None
            log.info("bf16 on a CPU without bf16 instructions: products of %s run as float32 "
                     "GEMMs", f"1-{KERNEL_ROWS} rows through half_avx2.c, more" if kernel
                     else f"{FLOAT32_ROWS} rows or more")


_F_LINEAR = F.linear
_lock = threading.Lock()
_mode: str | None = None
_installed = False


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.dtype not in _HALF or weight.device.type != "cpu" or weight.dim() != 2:
        return _F_LINEAR(x, weight, bias)
    if reducing():
        if _mode == "lone" and x.dim() == 2 and x.shape[0] <= MAX_ROWS:
            return rows_linear(x, weight, bias)
        if _mode == "prompt":
            return float32_linear(x, weight, bias)
        if _mode == "batch" and x.dim() == 2:
            return batch_linear(x, weight, bias)
        return _F_LINEAR(x, weight, bias)
    if torch.compiler.is_compiling():                # another graph: F.linear's own
        return _F_LINEAR(x, weight, bias)
    if _installed and x.dim() >= 2 and chosen_backend() != "onednn":
        rows = x.numel() // max(1, x.shape[-1])
        if rows <= KERNEL_ROWS and (out := kernel_linear(x, weight, bias)) is not None:
            return out
        if rows >= FLOAT32_ROWS:
            return float32_linear(x, weight, bias)
    return _F_LINEAR(x, weight, bias)
