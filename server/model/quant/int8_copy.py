"""Int8 copies of plain float linear layers, for products whose exact values nothing
depends on: the MTP drafts' head and layer (engine/spec/draft_head.py, draft_layer.py) and
the screen of the greedy head (engine/sample/screened_head.py)."""
from __future__ import annotations

import torch
from torch import nn

from server.model.kernels import settings as kernel_env
from server.model.quant.int8 import fastest_int8_backend, quantize_rows, row_scales
from server.model.quant.linear import QuantLinear

FAST_INT8 = ("vnni", "avx2")        # int8 backends that stream the weight a byte a value
HALF = (torch.bfloat16, torch.float16)


def int8_copy(linear: nn.Linear, backend: str) -> QuantLinear:
    """``linear`` [N, K] (a plain linear layer without a bias) as a W8A8_DYNAMIC layer:
    symmetric int8 per output row."""
    w = linear.weight.detach().float()
    scale = row_scales(w)                                            # [N, 1], as activations'
    q = QuantLinear(linear.in_features, linear.out_features, "w8a8_dynamic", backend=backend)
    q.weight.data = quantize_rows(w, scale).to(torch.int8).contiguous()
    q.weight_scale.data = scale.squeeze(1)
    return q.eval()


def fast_int8(dtype: torch.dtype) -> bool:
    """Whether this process's int8 backend for a model of ``dtype`` is one of our kernels,
    which stream an int8 weight at a byte a value (may measure, once a process)."""
    return int8_backend(dtype) in FAST_INT8


def takes_int8_copy(setting: str, dtypes: set[torch.dtype]) -> bool:
    """Whether float weights of ``dtypes`` take int8 copies under a draft-weights setting:
    "model" never, "int8" always, "auto" where they are 16-bit and ``fast_int8`` (asked only
    then: it may measure)."""
    if setting == "model" or not dtypes:
        return False
    return setting == "int8" or (dtypes <= set(HALF) and fast_int8(min(dtypes, key=str)))


def int8_backend(dtype: torch.dtype) -> str:
    """The int8 backend of such copies: the operator's where one is forced
    ($MTP_SERVE_INT8_BACKEND), else the fastest measured here for a model of ``dtype``
    (measured once a process, quant/int8.py; a W8A8 model's load measured it)."""
    forced = kernel_env.kernel_settings().int8_backend
    return forced if forced != "auto" else fastest_int8_backend("cpu", dtype)
