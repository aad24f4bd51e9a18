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
