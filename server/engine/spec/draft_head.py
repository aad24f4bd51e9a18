"""An int8 copy of the MTP layer's vocabulary head, for its drafts only.

Why: on the 0.5b benchmark model the bf16 head is 98 MB, a fifth of a batch-1 step's
weights, and a step with MTP reads it twice (the verify window's logits and the draft
pass's).  The drafts only propose: verification takes the main model's own head, so the
tokens stay what the model computes (greedy: equal to MTP off; sampled: the speculative
acceptance rule holds for any draft distribution).  Int8 per output channel with dynamic
per-token activations (the W8A8_DYNAMIC arithmetic, quant/linear.py) reads half the bytes:
a draft pass's head 2.5 against 4.0 ms on the 2-core Zen 4 (VNNI), and a batch-1 k=1 step
~5% faster, alternating in one process, with the same number of steps (acceptance kept).

``MTP_SERVE_DRAFT_HEAD`` (server/config/kernel_env.py): "auto" takes the copy where the
head is a plain 16-bit layer and the int8 products are one of our kernels ("vnni",
"avx2": streamed a byte a weight); "int8" wherever a head is a plain float layer; "model"
never.  It costs half the head's bytes in memory (0.9 GB for DeepSeek-V3's 129280 x 7168).
"""
from __future__ import annotations

import logging

from torch import nn

from server.model.kernels import settings as kernel_env
from server.model.layers.linear import Linear
from server.model.quant.int8_copy import int8_backend, int8_copy, takes_int8_copy
from server.model.quant.linear import QuantLinear

log = logging.getLogger("server.model")


def wants_int8(head: nn.Module, setting: str) -> bool:
    """Whether the drafts take an int8 copy of ``head`` under ``setting`` (auto, model,
    int8): a plain float layer on the CPU, as ``takes_int8_copy`` rules."""
    return (type(head) is Linear and head.weight.device.type == "cpu"
            and head.weight.is_floating_point()
            and takes_int8_copy(setting, {head.weight.dtype}))


def draft_head(model) -> QuantLinear | None:
    """The int8 copy the first MTP layer's drafts take under ``MTP_SERVE_DRAFT_HEAD``, or
    None (the layer's own head)."""
    if not getattr(model, "num_mtp_layers", 0):
        return None
    head = model._mtp(0).shared_head.head
    if not wants_int8(head, kernel_env.kernel_settings().draft_head):
        return None
    backend = int8_backend(head.weight.dtype)
    log.info("MTP drafts take an int8 copy of the vocabulary head (%s, %.0f MB; verification "
             "keeps the model's own)", backend, head.weight.numel() / 1e6)
    return int8_copy(head, backend)
