"""The products a model is loaded with: the 16-bit backend chosen for this process
(choice.py's rules over this CPU, this build and $MTP_SERVE_HALF_BACKEND), made into the
object the model's layers hold (products.py)."""
from __future__ import annotations

import functools

import torch

from server.model.kernels.choice import BackendUnavailable, half_backend
from server.model.kernels.cpu import cpu_caps
from server.model.kernels.half_cpu import HalfCpuProducts
from server.model.kernels.native import half_kernel
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
    needs_kernel = forced == "avx2" or (forced == "auto" and not caps.native_bf16)
    return half_backend(caps, needs_kernel and half_kernel() is not None, forced)


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
    raise BackendUnavailable(f"16-bit backend {name!r}; allowed: torch, onednn, avx2, float32")


def model_products(dtype: torch.dtype, device: torch.device | str) -> Products:
    """The products a model of ``dtype`` weights on ``device`` is loaded with."""
    if torch.device(device).type != "cpu" or dtype not in _HALF:
        return products_named("torch", device)
    return products_named(half_backend_name(), device)
