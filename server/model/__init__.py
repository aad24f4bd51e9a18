"""The DeepSeek-V3 model and what it is made of (docs/interfaces.md has the contract).

  deepseek_v3.py   the model and its MTP layer; static_decode.py its static step
  config.py        DeepseekConfig (read torch-free in server/config/checkpoint) and the
                   torch dtypes; batch.py a step's metadata; meta.py building on meta
  layers/          norms, rotary, linear, MLP, MoE, MLA attention, the latent cache
  quant/           int8 formats and layers (QuantLinear), int8 products, FP8 at load
  kernels/         CPU capability, product backends, our native kernels, alignment
  parallel/        one rank's shard: tp/ep/dp/sp/cp layouts (their rules:
                   server/config/parallel_layout.py), quantized shards
  loading/         checkpoint loading (plan, read, install)

The public names below stay importable from ``server.model`` itself; they are loaded on
first use (PEP 562), so importing ``server.model`` alone does not pull torch in (a
torch-free module reads a checkpoint's settings from server/config/checkpoint instead).
"""
from __future__ import annotations

import importlib

_PUBLIC = {
    "DeepseekV3ForCausalLM": "server.model.deepseek_v3",
    "DeepseekConfig": "server.model.config",
    "BatchMetadata": "server.model.batch",
    "DecodeMetadata": "server.model.batch",
    "load_checkpoint": "server.model.loading",
    "inspect_checkpoint": "server.model.loading",
    "read_config": "server.model.loading",
    "CheckpointError": "server.model.loading",
    "ModelInfo": "server.model.loading",
    "CheckpointSummary": "server.model.loading",
    "ParallelPlan": "server.model.parallel",
    "QuantLinear": "server.model.quant",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'server.model' has no attribute {name!r}")
