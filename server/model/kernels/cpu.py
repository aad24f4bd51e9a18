"""The one probe of what this CPU can do, and the class it belongs to.

Why one: every fast path was first proven on the CPU it was written on, and the project's
users run AVX2-only EPYCs, AVX-512 parts with BF16 and VNNI, and AMX Xeons.  Each backend's
rules ("needs AVX2, FMA and F16C", "oneDNN multiplies bf16 natively") are asked of one
``CpuCaps`` value, so a test can stub it and check the choice every class would make
without owning that CPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

CPU_CLASSES = ("avx2", "avx512", "avx512_bf16_vnni", "amx", "other")


@dataclass(frozen=True)
class CpuCaps:
    """The instruction-set extensions the kernels care about (from /proc/cpuinfo, with
    torch's own checks where /proc is not readable)."""

    avx2: bool = False
    fma: bool = False
    f16c: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512_bf16: bool = False
    avx512_vnni: bool = False
    amx_tile: bool = False
    amx_int8: bool = False
    amx_bf16: bool = False

    @property
    def native_bf16(self) -> bool:
        """oneDNN multiplies 16-bit floats natively (AVX512_BF16 or AMX); without it, it
        converts the weight to float32 for every row it multiplies (half_cpu.py)."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def avx2_kernel(self) -> bool:
        """half_avx2.c can run here (it is built with -mavx2 -mfma -mf16c)."""
        return self.avx2 and self.fma and self.f16c

    @property
    def cpu_class(self) -> str:
        """One of CPU_CLASSES: the classes this project tests its choices for."""
        if self.amx_tile and (self.amx_int8 or self.amx_bf16):
            return "amx"
        if self.avx512f and self.avx512_bf16 and self.avx512_vnni:
            return "avx512_bf16_vnni"
        if self.avx512f:
            return "avx512"
        if self.avx2:
            return "avx2"
        return "other"

    def flags(self) -> list[str]:
        """The flags present, in /proc/cpuinfo's spelling (for logs and benchmark rows)."""
        return [name for name in self.__dataclass_fields__ if getattr(self, name)]


# Typical members of each class, for tests and for documentation.
EXAMPLES = {
    "avx2": CpuCaps(avx2=True, fma=True, f16c=True),
    "avx512": CpuCaps(avx2=True, fma=True, f16c=True, avx512f=True, avx512bw=True),
    "avx512_bf16_vnni": CpuCaps(avx2=True, fma=True, f16c=True, avx512f=True, avx512bw=True,
                                avx512_bf16=True, avx512_vnni=True),
    "amx": CpuCaps(avx2=True, fma=True, f16c=True, avx512f=True, avx512bw=True,
                   avx512_bf16=True, avx512_vnni=True, amx_tile=True, amx_int8=True,
                   amx_bf16=True),
}


@functools.lru_cache(maxsize=None)
def cpu_caps() -> CpuCaps:
    """This machine's ``CpuCaps`` (read once)."""
    flags = _proc_flags()
    if not flags:                                   # no /proc: ask torch what it can
        import torch
        flags = {name for name, check in (
            ("avx2", torch.cpu._is_avx2_supported), ("avx512f", torch.cpu._is_avx512_supported),
            ("avx512_bf16", torch.cpu._is_avx512_bf16_supported),
            ("avx512_vnni", torch.cpu._is_vnni_supported),
            ("amx_tile", torch.cpu._is_amx_tile_supported)) if check()}
        flags |= {"fma", "f16c"} if "avx2" in flags else set()
    return CpuCaps(**{name: name in flags for name in CpuCaps.__dataclass_fields__})


def _proc_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()
