"""What a loaded model multiplies with, in words an operator reads in /v1/status and the
start-up log: the CPU class and flags the choice was made for, the 16-bit products, the
int8 backend, and whether our kernels are called as C++ operators."""
from __future__ import annotations

from torch import nn

from server.model.kernels.cpu import cpu_caps
from server.model.kernels.native import native_ops


def kernel_report(model: nn.Module) -> dict[str, str]:
    caps = cpu_caps()
    int8 = sorted({m.backend for m in model.modules() if hasattr(m, "backend") and hasattr(m, "scheme")})
    on_cpu = next(model.parameters()).device.type == "cpu"
    return {"cpu_class": caps.cpu_class, "cpu_flags": " ".join(caps.flags()),
            "products": getattr(model, "products").name, "int8_backend": ",".join(int8) or "none",
            "kernel_calls": ("c++ operators" if native_ops() else "python") if on_cpu else "none"}
