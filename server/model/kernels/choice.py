"""Which product backend a model's layers take: forced by the operator, or chosen from what
the CPU can run (``cpu.CpuCaps``) and, for int8, what measures fastest.

Kept pure (the capabilities and the kernel's availability are arguments) so the choice
every CPU class makes is tested on any machine: tests/model/test_backend_choice.py.
"""
from __future__ import annotations

from server.model.kernels.cpu import CpuCaps
from server.model.kernels.settings import (
    HALF_BACKENDS,
    HALF_ENV,
    INT8_BACKENDS,
    INT8_ENV,
)


class BackendUnavailable(ValueError):
    """A forced backend this CPU, build or model cannot run; the message says why."""


def half_backend(caps: CpuCaps, kernel: bool, forced: str = "auto") -> str:
    """The 16-bit product backend: "onednn" where oneDNN multiplies 16-bit floats natively
    (AVX512_BF16, AMX), else our AVX2 kernel where it built ("avx2"), else float32 GEMMs
    and fused reductions ("float32").  ``kernel``: half_avx2.c is built and loaded."""
    if forced == "auto":
        if caps.native_bf16:
            return "onednn"
        return "avx2" if kernel else "float32"
    if forced not in HALF_BACKENDS:
        raise BackendUnavailable(f"${HALF_ENV}={forced!r}; allowed: auto, {', '.join(HALF_BACKENDS)}")
    if forced == "avx2" and not kernel:
        raise BackendUnavailable(f"${HALF_ENV}=avx2 needs half_avx2.c, which cannot run here "
                                 f"({_kernel_missing(caps)})")
    return forced


def int8_candidates(caps: CpuCaps, half: bool, kernel: bool) -> tuple[str, ...]:
    """The int8 backends worth measuring on this CPU for a model of 16-bit (``half``) or
    float32 activations.  int_mm and float run everywhere (oneDNN picks its own ISA);
    avx2 needs the kernel; int8pack rounds its sums to bf16, so 16-bit models only."""
    out = ["int_mm", "float"]
    if kernel and caps.avx2_kernel:
        out.append("avx2")
    if half:
        out.append("int8pack")
    return tuple(out)


def forced_int8_backend(forced: str, caps: CpuCaps, half: bool, kernel: bool) -> str:
    """A forced int8 backend, checked against what this CPU and model can run."""
    if forced not in INT8_BACKENDS:
        raise BackendUnavailable(f"${INT8_ENV}={forced!r}; allowed: auto, {', '.join(INT8_BACKENDS)}")
    if forced == "avx2" and not (kernel and caps.avx2_kernel):
        raise BackendUnavailable(f"${INT8_ENV}=avx2 needs half_avx2.c, which cannot run here "
                                 f"({_kernel_missing(caps)})")
    if forced == "int8pack" and not half:
        raise BackendUnavailable("int8 backend int8pack rounds the integer sums to bf16: for "
                                 "16-bit models only (float32 ones keep the exact sums)")
    return forced


def _kernel_missing(caps: CpuCaps) -> str:
    if not caps.avx2_kernel:
        return "the CPU lacks " + ", ".join(f for f, ok in (("AVX2", caps.avx2), ("FMA", caps.fma),
                                                            ("F16C", caps.f16c)) if not ok)
    return "no C compiler, a failed build, or $MTP_SERVE_HALF_KERNEL=0: see the log"
