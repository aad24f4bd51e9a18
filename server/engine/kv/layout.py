"""Bytes one KV block takes, and how many blocks a disk tier of a given size holds (no torch).

One block is, for every cache layer (the main decoder layers and the MTP layer(s) the
weights hold), ``block_size`` tokens of the MLA cache row: ``kv_cache_dim`` values
(latent + RoPE key) in the model dtype, or for an int8 layer the int8 latent, a float32
scale and the RoPE part in the model dtype (server/model/layers/latent_cache.py).  The worker's
pool (kv_cache.KVCacheSpec) and ``python -m server --check`` (server/config/kv_pool.py)
both size from here, so a disk tier the check accepts is one start-up accepts too.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable

from server.engine.kv.block_file import file_overhead

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
INT8_SCALE_BYTES = 4                # one float32 scale per token (Int8LatentCache.scale)
GIB = 1 << 30


def kv_bytes_per_token(kv_cache_dim: int, rope_dim: int, dtype_bytes: int, int8: bool) -> int:
    if int8:
        return (kv_cache_dim - rope_dim) + rope_dim * dtype_bytes + INT8_SCALE_BYTES
    return kv_cache_dim * dtype_bytes


def kv_block_bytes(num_layers: int, block_size: int, kv_cache_dim: int, rope_dim: int,
                   dtype_bytes: int, int8_layers: Iterable[int] = ()) -> int:
    int8 = frozenset(int8_layers)
    return block_size * sum(kv_bytes_per_token(kv_cache_dim, rope_dim, dtype_bytes, i in int8)
                            for i in range(num_layers))


def disk_tier_blocks(disk_gb: float, block_bytes: int, block_size: int) -> int:
    """Blocks a disk tier of ``disk_gb`` GiB holds (each file: a header, the block's tokens
    and its rows: kv/block_file.py)."""
    return int(disk_gb * GIB) // (block_bytes + file_overhead(block_size))


def min_disk_gb(block_bytes: int, block_size: int) -> float:
    """The least ``disk_size_gb`` that holds one block."""
    return (block_bytes + file_overhead(block_size)) / GIB


def checkpoint_kv_block_bytes(weights: Path, block_size: int, kv_cache_dtype: str) -> int | None:
    """What start-up will compute for this checkpoint, read from its config.json and tensor
    names only; None when that cannot be told without loading it (no readable config or
    tensor list, or FA3 int8 layers that only the quantized loader reads)."""
    from server.model.config import DeepseekConfig      # no torch either

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
