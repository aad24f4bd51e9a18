"""Putting read tensors into the model: parameters, ties, the MTP heads that are the main
one, the products the model multiplies with, the heads' layout, aligned storage."""
from __future__ import annotations

import logging

import torch
from torch import nn

from server.model import kernels
from server.model.deepseek_v3 import DeepseekV3ForCausalLM
from server.model.kernels.native import native_ops
from server.model.kernels.products import use_products
from server.model.kernels.select import model_products
from server.model.layers.linear import Linear, column_major
from server.model.loading.files import CheckpointError
from server.model.loading.plan import LoadPlan

logger = logging.getLogger("server.model.loading")


def install_weights(lp: LoadPlan, loaded: dict[str, torch.Tensor]) -> DeepseekV3ForCausalLM:
    """The planned model with ``loaded`` in place of its meta parameters, ready to serve."""
    model = lp.model
    for name, t in loaded.items():
        prefix, _, attr = name.rpartition(".")
        setattr(model.get_submodule(prefix), attr, nn.Parameter(t, requires_grad=False))
    if lp.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for name in lp.optional:
        # No own head in the checkpoint, or a copy equal to lm_head (DeepSeek's released MTP
        # layers carry one): the MTP head is the main lm_head, held once (1.85 GB in bf16
        # for DeepSeek-V3).
        head = model.get_submodule(name.rsplit(".", 1)[0])
        own = loaded.get(name)
        lm = model.lm_head.weight
        if own is None or (own.shape == lm.shape and own.dtype == lm.dtype and torch.equal(own, lm)):
            head.weight = lm
    if lp.spec is not None:
        n = lp.config.num_hidden_layers
        model.kv_cache_int8_layers = frozenset(i for i in lp.spec.fa_layers if i < n + lp.num_mtp_layers)
    leftover = [k for k, p in model.named_parameters() if p.is_meta]
    if leftover:  # cannot happen unless the name mapping above is wrong
        raise CheckpointError(f"checkpoint {lp.path}: parameters left unloaded: {', '.join(leftover)}")
    model.eval()
    try:
        use_products([model], model_products(lp.dtype, lp.device))
    except (kernels.BackendUnavailable, kernels.KernelSettingError) as e:
        raise CheckpointError(str(e)) from e
    heads_by_columns(model)
    if lp.device.type == "cpu":
        native_ops()                        # built now (once), not on a request's first step
    moved = kernels.align_module(model)     # kernels/alignment.py: a crash is no way to learn a rule
    if moved:
        logger.info("%d tensor(s) moved to 64-byte aligned storage", moved)
    return model


def heads_by_columns(model: DeepseekV3ForCausalLM) -> None:
    """Hold the vocabulary heads column-major (layers.column_major) where the model's
    products want it: a decode step multiplies 1 to 1 + k rows by them.  On the demo model
    the main logits of a step took 0.066 ms instead of 0.138 ms, and a k=1 step (two head
    products) 4.17 ms instead of 4.38.  Not a head tied to the embedding, whose row lookups
    want the row-major table; the MTP head that is the main one is changed once."""
    heads = {id(h.weight): h for h in [model.lm_head] + [
        model.model.layers[model.config.num_hidden_layers + j].shared_head.head
        for j in range(model.num_mtp_layers)]}
    for head in heads.values():
        if type(head) is Linear and head.weight is not model.model.embed_tokens.weight:
            with torch.no_grad():
                head.weight.data = column_major(head.weight.data, model.products)
