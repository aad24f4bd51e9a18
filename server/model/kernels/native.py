"""half_avx2.c built at first use and loaded with ctypes (kernels/half_avx2.c says what
it computes); None, logged once, where it cannot be."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from server.model import kernels

log = logging.getLogger("server.model")


_KERNEL_SOURCE = Path(__file__).with_name("half_avx2.c")


_KERNEL_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-lm")


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
