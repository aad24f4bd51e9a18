"""The products a model is loaded with: the 16-bit backend chosen for this process
(choice.py's rules over this CPU, this build and $MTP_SERVE_HALF_BACKEND), made into the
object the model's layers hold (products.py)."""
from __future__ import annotations

import functools

import torch

from server.model.kernels.avx512 import Avx512Products
from server.model.kernels.choice import (
    KERNEL_OF,
    BackendUnavailable,
    half_backend,
    runs,
)
from server.model.kernels.cpu import cpu_caps
from server.model.kernels.half_cpu import HalfCpuProducts
from server.model.kernels.native import half_kernel, kernel_library
from server.model.kernels.products import Products
from server.model.kernels.settings import kernel_settings

_HALF = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def half_backend_name() -> str:
    """This process's 16-bit product backend on a CPU: forced by $MTP_SERVE_HALF_BACKEND,
    else "onednn" where the CPU multiplies 16-bit floats natively, else "avx2" where
    half_avx2.c built, else "float32".  The kernel is built only where the choice may need
    it."""
    forced, caps = kernel_settings().half_backend, cpu_caps()
    wanted = [KERNEL_OF[forced]] if forced in KERNEL_OF else \
        ["avx512_bf16" if caps.native_bf16 else "half_avx2"] if forced == "auto" else []
    return half_backend(caps, built_kernels(wanted), forced)


def built_kernels(names) -> frozenset[str]:
    """Those of the kernels ``names`` this CPU runs that build and load here (building
    them now, once)."""
    return frozenset(n for n in names if runs(cpu_caps(), n) and kernel_library(n) is not None)


def products_named(name: str, device: torch.device | str = "cpu") -> Products:
    """The products of backend ``name`` ("onednn" or "torch", "avx2", "float32"): what a
    compile child rebuilds from the serving model's ``products.name``."""
    if name in ("torch", "onednn"):
        return Products(native_half=torch.device(device).type != "cpu" or cpu_caps().native_bf16)
    if name == "avx2":
        kernel = half_kernel()
        if kernel is None:
            raise BackendUnavailable("16-bit backend avx2: half_avx2.c cannot run here")
        return HalfCpuProducts(kernel)
    if name == "float32":
        return HalfCpuProducts(None)
    if name == "avx512":
        if kernel_library("avx512_bf16") is None:
            raise BackendUnavailable("16-bit backend avx512: avx512_bf16.c cannot run here")
        return Avx512Products()
    raise BackendUnavailable(f"16-bit backend {name!r}; allowed: torch, onednn, avx512, avx2, float32")


def model_products(dtype: torch.dtype, device: torch.device | str) -> Products:
    """The products a model of ``dtype`` weights on ``device`` is loaded with."""
    if torch.device(device).type != "cpu" or dtype not in _HALF:
        return products_named("torch", device)
    return products_named(half_backend_name(), device)
