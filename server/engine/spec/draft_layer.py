"""The MTP layer's products in int8: its outputs only ever feed drafts.

Why: what an MTP layer computes is a proposal (and the layer's own KV, which only later
drafts read); verification runs the main model and its head, so greedy tokens stay those
of MTP off and sampled ones keep the speculative acceptance rule whatever the drafts are.
A draft pass of the bf16 0.5b benchmark model streams its layer's eh_proj, attention and
MoE (~47 MB besides the int8 draft head, engine/spec/draft_head.py) once a drafted token,
and the first pass of a window runs the layer on every verified row, whose experts' union
is larger: int8 per output channel (the W8A8_DYNAMIC arithmetic, quant/linear.py) reads
half of it.  The layer is changed in place, not copied: nothing else reads its weights.
kv_b_proj stays as loaded: the attention reads it as raw per-head matrices (as a
W8A8_DYNAMIC checkpoint keeps it float).

``MTP_SERVE_DRAFT_LAYER`` (server/config/kernel_env.py): "auto" where the layer's linears
are plain 16-bit ones and the int8 products are one of our kernels ("vnni", "avx2"); "int8"
wherever they are plain float layers; "model" never.  One process only: a rank group's
layers are shards the group sums (model/parallel.py), left as loaded.
"""
from __future__ import annotations

import logging

from torch import nn

from server.model.kernels import settings as kernel_env
from server.model.layers.linear import Linear
from server.model.quant.int8_copy import int8_backend, int8_copy, takes_int8_copy

log = logging.getLogger("server.model")

KEPT_FLOAT = ("self_attn.kv_b_proj",)     # read as raw matrices (module docstring)


def int8_linears(layer: nn.Module) -> list[str]:
    """The names (in ``layer``) of the plain float linears an int8 draft layer converts."""
    return [name for name, m in layer.named_modules()
            if type(m) is Linear and m.weight.is_floating_point() and not m.weight.is_meta
            and m.weight.device.type == "cpu" and m.bias is None and not name.endswith(KEPT_FLOAT)
            and not name.startswith("shared_head.")]


def int8_draft_layers(model, grouped: bool = False) -> int:
    """Convert every MTP layer's plain float linears (``int8_linears``) to W8A8_DYNAMIC in
    place under ``MTP_SERVE_DRAFT_LAYER``; the number converted.  ``grouped``: this process
    is one rank of a group (left as loaded).  Before anything stacks or packs the weights
    (the worker calls it first)."""
    layers = [model._mtp(j) for j in range(getattr(model, "num_mtp_layers", 0))]
    if grouped or not layers:
        return 0
    setting = kernel_env.kernel_settings().draft_layer
    done, backend = 0, ""
    for layer in layers:
        names = int8_linears(layer)
        dtypes = {layer.get_submodule(n).weight.dtype for n in names}
        if not takes_int8_copy(setting, dtypes):
            continue
        backend = int8_backend(min(dtypes, key=str))
        for name in names:
            parent, _, attr = name.rpartition(".")
            owner = layer.get_submodule(parent) if parent else layer
            setattr(owner, attr, int8_copy(getattr(owner, attr), backend))
        done += len(names)
    if done:
        log.info("MTP layers' %d linears run int8 (%s) for the drafts; verification keeps "
                 "the model's own weights", done, backend)
    return done
