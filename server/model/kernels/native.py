"""Our C kernels, built at first use and loaded with ctypes; None, logged once, where one
cannot be (no compiler, a CPU without its instructions, $MTP_SERVE_HALF_KERNEL=0, a failed
build).

  half_avx2     16-bit and int8 products with AVX2, FMA and F16C (half_avx2.c)
  avx512_bf16   bf16 products with AVX-512 BF16 (avx512_bf16.c)
  avx512_vnni   int8 products with AVX-512 VNNI (avx512_vnni.c)
  mla_avx2      MLA's absorbed attention with AVX2 and FMA (mla_avx2.c; operators only)

Each is built into the kernel cache ($MTP_SERVE_KERNEL_CACHE) as a file per source, flags
and compiler, written whole by rename, so processes building at once do not collide.  Its
OpenMP is the libgomp torch already loaded, so the two share one thread pool.  A kernel is
loaded only where the CPU reports every instruction set it is built for: a native
operator never learns its rules by crashing.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from server.model.kernels.cpu import CpuCaps, cpu_caps
from server.model.kernels.settings import kernel_settings

log = logging.getLogger("server.model")
_HERE = Path(__file__).parent
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_MM = [_P, _L, _L, _L, _P, _L, _P, _L, _I]            # x, M, K, ldx, w, N, y, ldy, threads
_ROWS = [_P, _L, _L, _P, _P, _L, _P, _I]               # x, A, K, expert, w, N, y, threads


@dataclass(frozen=True)
class Kernel:
    source: str
    flags: tuple[str, ...]
    needs: tuple[str, ...]                 # CpuCaps fields that must all be true
    signatures: tuple[tuple[str, list, object], ...]

    def runs_on(self, caps: CpuCaps) -> bool:
        return all(getattr(caps, f) for f in self.needs)


KERNELS = {
    "half_avx2": Kernel(
        "half_avx2.c", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"),
        (("half_mm_bf16", _MM, ctypes.c_int), ("half_mm_f16", _MM, None),
         ("half_experts_bf16", [_P, _L, _L, _P, _L, _P, _P, _P, _P, _I], ctypes.c_int),
         ("half_experts_f16", [_P, _L, _L, _P, _L, _P, _P, _P, _P, _I], None),
         ("half_moe_bf16", [_P, _L, _L, _L, _L, _P, _P, _L, _P, _P, _P, _I], ctypes.c_int),
         ("int8_mm", _MM, None), ("int8_rows", _ROWS, None),
         ("int8_dynamic_mm", [_P, _L, _L, _P, _L, _P, _P, _I], ctypes.c_int),
         ("int8_moe", [_P, _L, _L, _L, _L, _P, _P, _L, _P, _P, _P, _P, _P, _I], ctypes.c_int))),
    "avx512_bf16": Kernel(
        "avx512_bf16.c", ("-mavx512f", "-mavx512bw", "-mavx512bf16"),
        ("avx512f", "avx512bw", "avx512_bf16"),
        (("bf16_mm", _MM, None), ("bf16_rows", _ROWS, None),
         ("bf16_experts", [_P, _L, _L, _P, _L, _P, _P, _P, _P, _P, _I], None),
         ("bf16_attend", [_P, _L, _L, _L, _P, _L, _P, ctypes.c_float, _L, _P, _P, _I], None))),
    "mla_avx2": Kernel(
        "mla_avx2.c", ("-mavx2", "-mfma"), ("avx2", "fma"),
        (("half_heads", [_P, _L, _L, _L, _P, _L, _P, _P, _I], None),
         ("half_attend_paged", [_P, _L, _L, _L, _P, _L, _P, _L, _P, _L, ctypes.c_float, _L, _P, _P, _I],
          None))),
    "avx512_vnni": Kernel(
        "avx512_vnni.c", ("-mavx512f", "-mavx512bw", "-mavx512vnni"),
        ("avx512f", "avx512bw", "avx512_vnni"),
        (("i8_mm", _MM, ctypes.c_int), ("i8_rows", _ROWS, ctypes.c_int),
         ("i8_moe", [_P, _L, _L, _L, _L, _P, _P, _L, _P, _P, _P, _P, _P, _I], ctypes.c_int))),
}
_COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")


@functools.lru_cache(maxsize=None)
def kernel_library(name: str) -> ctypes.CDLL | None:
    """Kernel ``name`` (KERNELS) built and loaded, or None (logged once) where it cannot be."""
    kernel = KERNELS[name]
    if not kernel_settings().half_kernel:
        return None
    if not kernel.runs_on(cpu_caps()):
        log.info("%s not built: the CPU lacks %s", kernel.source,
                 ", ".join(f for f in kernel.needs if not getattr(cpu_caps(), f)))
        return None
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        log.warning("no C compiler (cc): %s not built; products take torch's own and float32 GEMMs",
                    kernel.source)
        return None
    try:
        lib = ctypes.CDLL(str(_build(kernel, cc)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("%s could not be built (%s): products take torch's own and float32 GEMMs",
                    kernel.source, exc)
        return None
    for fn_name, args, result in kernel.signatures:
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = args, result
    return lib


def _build(kernel: Kernel, cc: str) -> Path:
    source = _HERE / kernel.source
    flags = _COMMON_FLAGS + kernel.flags
    # The headers beside the sources (expert_runs.h) are part of what a build is made of.
    headers = b"".join(h.read_bytes() for h in sorted(_HERE.glob("*.h")))
    tag = hashlib.sha256(source.read_bytes() + headers + cc.encode()
                         + " ".join(flags).encode()).hexdigest()[:16]
    root = kernel_settings().kernel_cache
    built = root / f"{source.stem}-{tag}.so"
    if not built.exists():
        root.mkdir(parents=True, exist_ok=True)
        part = built.with_name(f"{built.name}.{os.getpid()}.part")
        done = subprocess.run([cc, *flags, "-o", str(part), str(source), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(done.stderr.strip()[-500:] or f"{cc} exited {done.returncode}")
        os.replace(part, built)
    return built


def half_kernel() -> ctypes.CDLL | None:
    """half_avx2.c (16-bit products without native 16-bit instructions; the "avx2" int8
    backend)."""
    return kernel_library("half_avx2")


@functools.lru_cache(maxsize=None)
def native_ops() -> bool:
    """ops.cpp built and loaded, with the entry points of every kernel library that runs
    here handed to it: our kernels as C++ operators of torch's dispatcher (torch.ops.
    mtp_native.*; a graph calls them in 2 us, a Python-defined operator in 11).  False
    (logged once) where it cannot be built: then the Python-defined operators serve."""
    if not kernel_settings().half_kernel:
        return False
    libs = {name: lib for name in KERNELS if (lib := kernel_library(name)) is not None}
    if not libs:
        return False
    cxx = shutil.which(os.environ.get("CXX") or "c++")
    if cxx is None:
        log.warning("no C++ compiler (c++): our kernels are called through Python operators")
        return False
    global _SHIM
    try:
        built = _build_ops(cxx)
        torch.ops.load_library(str(built))
        shim = ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        log.warning("ops.cpp could not be built (%s): our kernels are called through Python "
                    "operators", exc)
        return False
    shim.mtp_set_kernel.argtypes, shim.mtp_set_kernel.restype = [ctypes.c_char_p, ctypes.c_void_p], ctypes.c_int
    _SHIM = shim
    for lib in libs.values():
        for fn_name in _ENTRY_POINTS:
            fn = getattr(lib, fn_name, None)
            if fn is not None:
                set_kernel(fn_name, fn)
    _register_fakes()
    return True


_SHIM: ctypes.CDLL | None = None


def set_kernel(name: str, fn) -> None:
    """The C++ operators' kernel ``name`` (one of ``_ENTRY_POINTS``) becomes ``fn`` (a ctypes
    function of the same signature): how ``native_ops`` hands them our kernels, and how a
    benchmark swaps one in place (benchmarks/besides_products.py)."""
    if _SHIM is None or _SHIM.mtp_set_kernel(name.encode(), ctypes.cast(fn, ctypes.c_void_p).value) != 0:
        raise RuntimeError(f"mtp_set_kernel: no operator kernel {name!r} to set (native_ops() first)")


@torch.compiler.assume_constant_result
def ops_ready() -> bool:
    """``native_ops()`` as a constant of a traced graph: which operators the graph calls,
    torch.ops.mtp_native's (C++) or mtp_serve's (Python), is fixed when it is traced."""
    return native_ops()


_ENTRY_POINTS = ("bf16_mm", "bf16_rows", "bf16_attend", "bf16_attend_paged", "bf16_attend_paged_i8",
                 "bf16_moe", "bf16_heads", "i8_mm", "i8_rows", "i8_moe", "half_mm_bf16", "half_mm_f16", "int8_mm",
                 "int8_rows", "int8_dynamic_mm", "half_moe_bf16", "int8_moe", "half_heads",
                 "half_attend_paged", "half_attend_paged_i8")


def _build_ops(cxx: str) -> Path:
    from torch.utils.cpp_extension import include_paths, library_paths
    # ops.cpp: the kernels as operators; layer_chain.cpp: a step's layer graphs called from C++.
    sources = [_HERE / "ops.cpp", _HERE / "layer_chain.cpp"]
    flags = ["-O2", "-shared", "-fPIC", "-std=c++17", "-w"]
    flags += [f"-I{p}" for p in include_paths()]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    links = [f"-L{p}" for p in library_paths()] + ["-ltorch_cpu", "-lc10"]
    tag = hashlib.sha256(b"".join(s.read_bytes() for s in sources) + cxx.encode() + " ".join(flags).encode()
                         + torch.__version__.encode()).hexdigest()[:16]
    root = kernel_settings().kernel_cache
    built = root / f"ops-{tag}.so"
    if not built.exists():
        root.mkdir(parents=True, exist_ok=True)
        part = built.with_name(f"{built.name}.{os.getpid()}.part")
        done = subprocess.run([cxx, *flags, "-o", str(part), *map(str, sources), *links],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise OSError(done.stderr.strip()[-500:] or f"{cxx} exited {done.returncode}")
        os.replace(part, built)
    return built


def _register_fakes() -> None:
    """Shapes and dtypes of the operators' outputs while a graph is traced."""
    def mm(out):
        return lambda x, w: x.new_empty(x.shape[0], w.shape[0], dtype=out)

    def rows(out):
        return lambda x, expert, w: x.new_empty(x.shape[0], w.shape[1], dtype=out)

    for name, fake in (("bf16_mm", mm(torch.float32)), ("half_mm", mm(torch.float32)),
                       ("i8_mm", mm(torch.int32)), ("int8_mm", mm(torch.int32)),
                       ("bf16_rows", rows(torch.float32)), ("i8_rows", rows(torch.int32)),
                       ("int8_rows", rows(torch.int32))):
        torch.library.register_fake(f"mtp_native::{name}")(fake)
    torch.library.register_fake("mtp_native::int8_dynamic_mm")(
        lambda x, w, w_scale: x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32))
    for name in ("bf16_moe", "half_moe"):
        torch.library.register_fake(f"mtp_native::{name}")(
            lambda x, weights, idx, gate_up, down: x.new_empty(x.shape[0], gate_up.shape[2],
                                                               dtype=torch.float32))
    for name in ("int8_moe", "i8_moe"):
        torch.library.register_fake(f"mtp_native::{name}")(
            lambda x, weights, idx, gate_up, gate_up_scale, down, down_scale: x.new_empty(
                x.shape[0], gate_up.shape[2], dtype=torch.float32))
    for name in ("bf16_heads", "bf16_heads_wide", "half_heads"):
        torch.library.register_fake(f"mtp_native::{name}")(
            lambda x, w: x.new_empty(x.shape[0], x.shape[1], w.shape[1], dtype=torch.float32))
    torch.library.register_fake("mtp_native::bf16_attend")(
        lambda q, ctx, bias, scale, kvr: q.new_empty(q.shape[0], q.shape[1], kvr, dtype=torch.float32))
    for isa in ("bf16", "half"):
        torch.library.register_fake(f"mtp_native::{isa}_attend_paged")(
            lambda q, cache, tables, pos, scale, kvr: q.new_empty(q.shape[0], q.shape[1], kvr,
                                                                  dtype=torch.float32))
        torch.library.register_fake(f"mtp_native::{isa}_attend_paged_i8")(
            lambda q, latent, scales, rope, tables, pos, scale, kvr: q.new_empty(q.shape[0], q.shape[1], kvr,
                                                                                 dtype=torch.float32))

