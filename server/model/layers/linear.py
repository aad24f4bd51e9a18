"""Linear layers whose products are the model's backend, and the layout of their weights."""
from __future__ import annotations

import torch
from torch import nn

from server.model.kernels.products import Products, UsesProducts


class Linear(nn.Linear, UsesProducts):
    """``nn.Linear`` computed by the ``products`` the model was loaded with
    (kernels/products.py): torch's own, or a CPU backend chosen at load."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:                # built on meta: meta.py says why not
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.products.linear(x, self.weight, self.bias)


def weight_key(w: torch.Tensor) -> tuple[int, int]:
    """Where a weight's bytes are and how often it was edited in place: what a copy made
    from it (a stack, W_UK / W_UV) is checked against.  Inference tensors keep no version
    counter: -1, so only a new pointer counts there."""
    return w.data_ptr(), -1 if w.is_inference() else w._version


def restacked(linears: list[nn.Module], stack: torch.Tensor | None) -> torch.Tensor | None:
    """``stack`` where the layers' weights still are its rows in order (a second worker on
    the same model, or a routed expert's rows of its MoE's stack: nothing is copied, and
    weights packed into one arena stay there), else ``stacked(linears)``."""
    if stack is not None and all(type(m) is Linear for m in linears):
        at = stack.data_ptr()
        for m in linears:
            w = m.weight
            if w.data_ptr() != at or w.dtype != stack.dtype or not w.is_contiguous():
                break
            at += w.nbytes
        else:
            if at == stack.data_ptr() + stack.nbytes:
                return stack
    return stacked(linears)


def stacked(linears: list[nn.Module]) -> torch.Tensor | None:
    """The weights of ``linears`` (plain Linears over the same input, no bias) as one
    [sum of outputs, in] tensor, each layer's weight becoming a view of its rows, so one
    product reads them all (nothing held twice); None where they cannot be stacked
    (int8 layers, biases, other devices or dtypes).  Why: at a decode window's few rows a
    product's fixed costs (a call, its threads' start, the memory streams' ramp) are a
    large part of a small weight's time: the 0.5b model's q_a (2.4 MB) and kv_a (1.4 MB)
    read as one, and a shared expert's gate and up."""
    if not all(type(m) is Linear and m.bias is None for m in linears):
        return None
    weights = [m.weight for m in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1 or any(w.is_meta for w in weights):
        return None
    with torch.no_grad():
        stack = torch.cat([w.detach() for w in weights])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(stack[start:start + rows], requires_grad=m.weight.requires_grad)
        start += rows
    return stack


def column_major(weight: torch.Tensor, products: Products) -> torch.Tensor:
    """The same [out, in] matrix stored as [in, out] (strides (1, out)) on a CPU, where
    ``products`` multiply it faster so; unchanged otherwise.  Why: MKL's matmul for a
    decode window's few rows then streams contiguous output rows instead of taking one dot
    product per output.  For wide weights (the demo model's vocabulary head [2048, 128],
    stacked MoE gate/up [1280, 128]) the 1-row product went from 34 to 21 us and 21 to
    14 us, the 2-row one from 58 to 42 and 48 to 36 us.  Narrow ones (the MoE's
    [128, 640] down) are faster row-major: not for those.

    Float32 only, or 16-bit floats where the CPU multiplies them natively (AVX512_BF16 or
    AMX): without it (an AVX2 EPYC) a bf16 product with a column-major weight falls off
    oneDNN's fast path, 30x slower than row-major (the 0.5b model's [32000, 1536] head:
    180 ms against 10.9 ms for one row; row-major streams at the GEMV limit); our own
    kernels read row-major weights."""
    if weight.device.type != "cpu" or not products.column_major(weight.dtype):
        return weight
    return weight.t().contiguous().t()


class Embedding(nn.Embedding):
    """``nn.Embedding`` without its random init when built on the meta device (meta.py)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()
