"""Int8 checkpoints: their formats (formats.py: msModelSlim, compressed-tensors), the int8
linear layer (linear.py), int8 products on each backend (int8.py), int8 experts
(experts.py), W4A8's int4 packing (int4.py), and FP8 blocks dequantized at load (fp8.py)."""
from server.model.quant.experts import (
                                     gatherable,
                                     gathered_int8_experts,
                                     int8_expert,
                                     int8pack_experts,
)
from server.model.quant.int4 import pack_int4_rows, unpack_int4_rows
from server.model.quant.int8 import (
                                     EXACT_BACKENDS,
                                     INT8PACK_MAX_ROWS,
                                     fastest_int8_backend,
                                     int8_kernel_mm,
                                     int8_matmul,
                                     int8_rows,
                                     packs,
                                     quantize_rows,
                                     row_scales,
)
from server.model.quant.linear import SCHEMES, QuantLinear

__all__ = ["EXACT_BACKENDS", "INT8PACK_MAX_ROWS", "SCHEMES", "QuantLinear", "fastest_int8_backend",
           "gatherable", "gathered_int8_experts", "int8_expert", "int8_kernel_mm", "int8_matmul",
           "int8_rows", "int8pack_experts", "pack_int4_rows", "packs", "quantize_rows", "row_scales",
           "unpack_int4_rows"]
