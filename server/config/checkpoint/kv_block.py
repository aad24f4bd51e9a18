"""What one KV block of a checkpoint weighs, read from its files without loading it.  No torch.

``python -m server --check`` refuses a disk tier that cannot hold one block
(config/kv_pool.py), and a block's size depends on the model: its cache layers (the main
decoder layers plus the MTP layers the weights hold), its latent and RoPE widths and its
dtype.  Those come from the checkpoint's ``config.json`` (read as the model reads it:
architecture.py) and its tensor names, so the check sizes a block exactly as start-up
will (server/kvblock/size.py does the arithmetic for both).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

from server.config.checkpoint.architecture import DeepseekConfig
from server.kvblock.size import DTYPE_BYTES, kv_block_bytes


def checkpoint_kv_block_bytes(weights: Path, block_size: int, kv_cache_dtype: str) -> int | None:
    """What start-up will compute for this checkpoint, read from its config.json and tensor
    names only; None when that cannot be told without loading it (no readable config or
    tensor list, or FA3 int8 layers that only the quantized loader reads)."""
    try:
        cfg = DeepseekConfig.from_hf(json.loads((weights / "config.json").read_text("utf-8")))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if kv_cache_dtype != "int8" and any(weights.glob("quant_model_description*.json")):
        return None
    names = _tensor_names(weights)
    if names is None:
        return None
    n, num_mtp = cfg.num_hidden_layers, 0
    # As the loader counts them: the MTP layers the config declares and the weights hold
    # (held and loaded whether or not MTP decoding is on, so their cache rows count too).
    while num_mtp < cfg.num_nextn_predict_layers and any(
            k.startswith(f"model.layers.{n + num_mtp}.") for k in names):
        num_mtp += 1
    layers = n + num_mtp
    return kv_block_bytes(layers, block_size, cfg.kv_cache_dim, cfg.qk_rope_head_dim,
                          DTYPE_BYTES[cfg.torch_dtype],
                          range(layers) if kv_cache_dtype == "int8" else ())


def _tensor_names(weights: Path) -> set[str] | None:
    """Tensor names from the sharded index, else from the safetensors headers."""
    index = weights / "model.safetensors.index.json"
    try:
        if index.is_file():
            return set(json.loads(index.read_text("utf-8"))["weight_map"])
        single = weights / "model.safetensors"
        files = [single] if single.is_file() else sorted(weights.glob("quant_model_weight*.safetensors"))
        if not files:
            return None
        names: set[str] = set()
        for file in files:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            if not isinstance(header, dict):
                return None
            names.update(k for k in header if k != "__metadata__")
        return names
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
