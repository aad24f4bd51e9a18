"""The kernels' environment variables, read once, checked once.

An operator forces a product backend the same way a test does: ``MTP_SERVE_INT8_BACKEND``
for int8 weights, ``MTP_SERVE_HALF_BACKEND`` for 16-bit ones (docs/config.md).  A value
outside the allowed set stops the load with a message naming the variable, never a silent
fallback; "auto" leaves the choice to capability and measurement (``choice.py``).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

INT8_ENV = "MTP_SERVE_INT8_BACKEND"
HALF_ENV = "MTP_SERVE_HALF_BACKEND"
KERNEL_ENV = "MTP_SERVE_HALF_KERNEL"            # 0: never build or use half_avx2.c
KERNEL_CACHE_ENV = "MTP_SERVE_KERNEL_CACHE"     # where it is built (~/.cache/mtp-serve/kernels)

# int_mm: torch._int_mm (oneDNN, VNNI/AMX); int8pack: torch._weight_int8pack_mm (16-bit
# models); avx2: half_avx2.c's int8 product; float: the exact float32 path.
INT8_BACKENDS = ("int_mm", "int8pack", "avx2", "float")
# onednn: torch's own F.linear; avx2: half_avx2.c (and float32 GEMMs for many rows);
# float32: float32 GEMMs and fused reductions without the kernel.
HALF_BACKENDS = ("onednn", "avx2", "float32")


class KernelSettingError(ValueError):
    """An environment variable of the kernels holds a value outside its allowed set."""


@dataclass(frozen=True)
class KernelSettings:
    int8_backend: str = "auto"
    half_backend: str = "auto"
    half_kernel: bool = True
    kernel_cache: Path = Path.home() / ".cache" / "mtp-serve" / "kernels"


def parse(env: Mapping[str, str]) -> KernelSettings:
    """``KernelSettings`` from an environment; KernelSettingError naming every bad one."""
    problems = []

    def choice(name: str, allowed: tuple[str, ...]) -> str:
        raw = env.get(name, "").strip().lower() or "auto"
        if raw not in ("auto",) + allowed:
            problems.append(f"${name}={raw!r}; allowed: auto, {', '.join(allowed)}")
            return "auto"
        return raw

    int8 = choice(INT8_ENV, INT8_BACKENDS)
    half = choice(HALF_ENV, HALF_BACKENDS)
    kernel = env.get(KERNEL_ENV, "1").strip()
    if kernel not in ("0", "1"):
        problems.append(f"${KERNEL_ENV}={kernel!r}; allowed: 1 (build half_avx2.c), 0 (never)")
    if kernel == "0" and "avx2" in (int8, half):
        problems.append(f"${KERNEL_ENV}=0 forbids the kernel that ${INT8_ENV if int8 == 'avx2' else HALF_ENV}"
                        "=avx2 asks for")
    if problems:
        raise KernelSettingError("; ".join(problems))
    cache = env.get(KERNEL_CACHE_ENV, "").strip()
    return KernelSettings(int8, half, kernel != "0",
                          Path(cache) if cache else KernelSettings.kernel_cache)


@functools.lru_cache(maxsize=None)
def kernel_settings() -> KernelSettings:
    """This process's settings (from os.environ, the first time they are asked for)."""
    return parse(os.environ)
