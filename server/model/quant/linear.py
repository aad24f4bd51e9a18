"""QuantLinear: a linear layer whose weight is int8, and the schemes it computes."""
from __future__ import annotations

import torch
from torch import nn

from server.distributed import collectives
from server.model.quant.int8 import dynamic_product, int8_matmul, quantize_rows

SCHEMES = ("w8a8_dynamic", "w8a8_static")


class QuantLinear(nn.Module):
    """A linear layer whose weight is int8 [out, in]; see the module docstring for the maths.

    ``row_parallel``: this rank holds a slice of the input features (tensor parallel,
    model/parallel.py) and every rank of the group runs the layer on the same tokens.  The
    result is then the one process's, bit for bit: a dynamic scheme's per-token scale is
    the maximum over all ranks' slices (one MAX all-reduce of [M, 1]), and the ranks' exact
    integer sums are added as integers (one int32 all-reduce) before anything is scaled;
    the bias (static: ``quant_bias``) is added once, after.  Summing per-rank float
    outputs instead would quantize each slice on its own scale and round each partial."""

    def __init__(self, in_features: int, out_features: int, scheme: str, *,
                 backend: str = "float", bias: bool = False, row_parallel: bool = False) -> None:
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"quantization scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.backend = scheme, backend
        self.row_parallel = row_parallel

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)

        self.weight = param(out_features, in_features, dtype=torch.int8)
        if scheme == "w8a8_dynamic":
            self.weight_scale = param(out_features, dtype=torch.float32)
        else:
            self.input_scale = param(1, dtype=torch.float32)
            self.input_offset = param(1, dtype=torch.float32)
            self.deq_scale = param(out_features, dtype=torch.float32)
            self.quant_bias = param(out_features, dtype=torch.int32)
        self.bias = param(out_features, dtype=torch.float32) if bias else None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"scheme={self.scheme}, backend={self.backend}"
                + (", row_parallel" if self.row_parallel else ""))

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out, in] (dynamic scheme): for layers the model reads as a raw matrix."""
        return self.weight.float() * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()                              # [M, K]
        if self.scheme == "w8a8_dynamic" and not self.row_parallel:
            y = dynamic_product(x2, self.weight, self.weight_scale, self.backend)
        elif self.scheme == "w8a8_dynamic":
            amax = x2.abs().amax(dim=-1, keepdim=True)                      # [M, 1]
            amax = collectives.all_reduce(amax, "max")
            s = amax.clamp(min=1e-10) / 127.0
            x_q = quantize_rows(x2, s).to(torch.int8)
            y = self._integer_sums(x_q).float() * (s * self.weight_scale)
        else:
            x_q = torch.round(x2 / self.input_scale + self.input_offset).clamp_(-128, 127).to(torch.int8)
            acc = self._integer_sums(x_q) + self.quant_bias
            y = acc.float() * self.deq_scale
        if self.bias is not None and self.scheme == "w8a8_dynamic":
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _integer_sums(self, x_q: torch.Tensor) -> torch.Tensor:
        """x_q . W^T, summed over the group's input slices when row parallel (as int32:
        exact, and converting the exact sum to float32 rounds it as one process does)."""
        if not self.row_parallel:
            return int8_matmul(x_q, self.weight, self.backend)
        acc = int8_matmul(x_q, self.weight, "float" if self.backend == "int8pack" else self.backend)
        return collectives.all_reduce(acc.to(torch.int32))


def stackable(linears: list[nn.Module]) -> bool:
    """Int8 layers of the dynamic scheme over one input that one product can compute
    together: QuantLinear, one backend, no bias, not row parallel, same input width."""
    return (all(type(m) is QuantLinear and m.scheme == "w8a8_dynamic" and m.bias is None
                and not m.row_parallel for m in linears)
            and len({(m.backend, m.in_features, m.weight.device) for m in linears}) == 1
            and not any(m.weight.is_meta for m in linears))


def stacked_int8(linears: list[nn.Module], weight: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """layers/linear.stacked for int8 layers (``stackable``): their weights as one [sum of
    outputs, in] int8 tensor and their weight scales as one [sum of outputs], each layer's
    a view of its rows (``weight`` / ``scale``, a stack held from before: kept where the
    layers are still its views, nothing copied); (None, None) where they cannot be stacked.  One product (``stacked_forward``) gives
    each layer's outputs exactly as its own call does: a row's activation scale depends on
    the row only, each output is its own exact integer sum times its own scales.  Why: on 2
    Zen 3 cores the W8A8 0.5b model's q_a and kv_a (1.2 and 0.7 MB) took 50 and 34 us as two
    products, and a shared expert's gate and up 42 and 33; a product's fixed costs (the
    call, its threads' start, the streams' ramp) are much of a small weight's time."""
    if not stackable(linears):
        return None, None
    if weight is not None and scale is not None and _views_of(linears, (weight, scale)):
        return weight, scale
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears])
        scale = torch.cat([m.weight_scale.detach().float() for m in linears])
    start = 0
    for m in linears:
        rows = m.out_features
        m.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
        m.weight_scale = nn.Parameter(scale[start:start + rows], requires_grad=False)
        start += rows
    return weight, scale


def _views_of(linears: list[nn.Module], stack: tuple[torch.Tensor, torch.Tensor]) -> bool:
    start = 0
    for m in linears:
        for mine, whole, size in ((m.weight, stack[0], stack[0].shape[1]), (m.weight_scale, stack[1], 1)):
            if mine.data_ptr() != whole.data_ptr() + start * size * whole.element_size() \
                    or mine.dtype != whole.dtype or not mine.is_contiguous():
                return False
        start += m.out_features
    return start == stack[0].shape[0]


def stacked_forward(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    backend: str) -> torch.Tensor:
    """QuantLinear.forward of the dynamic scheme (no bias, not row parallel) through a
    ``stacked_int8`` stack: the stacked layers' outputs side by side, each as its own."""
    shape = x.shape
    y = dynamic_product(x.reshape(-1, shape[-1]).float(), weight, weight_scale, backend)
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])
