"""Which product backend a model's layers take: forced by the operator, or chosen from what
the CPU can run (``cpu.CpuCaps``) and, for int8, what measures fastest.

Kept pure (the capabilities and the kernel's availability are arguments) so the choice
every CPU class makes is tested on any machine: tests/model/test_backend_choice.py.
"""
from __future__ import annotations

from server.model.kernels.cpu import CpuCaps
from server.model.kernels.native import KERNELS
from server.model.kernels.settings import (
    HALF_BACKENDS,
    HALF_ENV,
    INT8_BACKENDS,
    INT8_ENV,
)


class BackendUnavailable(ValueError):
    """A forced backend this CPU, build or model cannot run; the message says why."""


# The backends that are our own C kernels, and the kernel (native.KERNELS) each needs.
KERNEL_OF = {"avx2": "half_avx2", "avx512": "avx512_bf16", "vnni": "avx512_vnni"}
# Each kernel's CPU flags, as native.KERNELS builds it (one table: a kernel added there and
# missing here was a KeyError).
_NEEDS = {name: kernel.needs for name, kernel in KERNELS.items()}


def runs(caps: CpuCaps, kernel: str) -> bool:
    """Whether the CPU reports every instruction set ``kernel`` is built for."""
    return all(getattr(caps, f) for f in _NEEDS[kernel])


def half_backend(caps: CpuCaps, built: frozenset[str], forced: str = "auto") -> str:
    """The 16-bit product backend.  Automatic, by capability: our AVX-512 BF16 kernel where
    it runs ("avx512": a decode window's bf16 rows at the memory's rate, where oneDNN read
    at 60-70% of it), else oneDNN where it multiplies 16-bit floats natively (AMX without
    AVX512_BF16 has no such CPU today), else our AVX2 kernel ("avx2"), else float32 GEMMs
    and fused reductions ("float32").  ``built``: the kernels (native.KERNELS) built and
    loaded here."""
    if forced == "auto":
        if runs(caps, "avx512_bf16") and "avx512_bf16" in built:
            return "avx512"
        if caps.native_bf16:
            return "onednn"
        return "avx2" if runs(caps, "half_avx2") and "half_avx2" in built else "float32"
    if forced not in HALF_BACKENDS:
        raise BackendUnavailable(f"${HALF_ENV}={forced!r}; allowed: auto, {', '.join(HALF_BACKENDS)}")
    _check_kernel(HALF_ENV, forced, caps, built)
    return forced


def int8_candidates(caps: CpuCaps, half: bool, built: frozenset[str]) -> tuple[str, ...]:
    """The int8 backends worth measuring on this CPU for a model of 16-bit (``half``) or
    float32 activations.  int_mm and float run everywhere (oneDNN picks its own ISA);
    avx2 and vnni need their kernels; int8pack rounds its sums to bf16, so 16-bit models
    only."""
    out = ["int_mm", "float"]
    for backend in ("avx2", "vnni"):
        if runs(caps, KERNEL_OF[backend]) and KERNEL_OF[backend] in built:
            out.append(backend)
    if half:
        out.append("int8pack")
    return tuple(out)


def forced_int8_backend(forced: str, caps: CpuCaps, half: bool, built: frozenset[str]) -> str:
    """A forced int8 backend, checked against what this CPU and model can run."""
    if forced not in INT8_BACKENDS:
        raise BackendUnavailable(f"${INT8_ENV}={forced!r}; allowed: auto, {', '.join(INT8_BACKENDS)}")
    _check_kernel(INT8_ENV, forced, caps, built)
    if forced == "int8pack" and not half:
        raise BackendUnavailable("int8 backend int8pack rounds the integer sums to bf16: for "
                                 "16-bit models only (float32 ones keep the exact sums)")
    return forced


def _check_kernel(variable: str, backend: str, caps: CpuCaps, built: frozenset[str]) -> None:
    kernel = KERNEL_OF.get(backend)
    if kernel is None or (runs(caps, kernel) and kernel in built):
        return
    if not runs(caps, kernel):
        why = "the CPU lacks " + ", ".join(f.upper() for f in _NEEDS[kernel] if not getattr(caps, f))
    else:
        why = "no C compiler, a failed build, or $MTP_SERVE_HALF_KERNEL=0: see the log"
    raise BackendUnavailable(f"${variable}={backend} needs {kernel}.c, which cannot run here ({why})")
