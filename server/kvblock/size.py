"""Bytes one KV block takes, and how many blocks a disk tier of a given size holds (no torch).

One block is, for every cache layer (the main decoder layers and the MTP layer(s) the
weights hold), ``block_size`` tokens of the MLA cache row: ``kv_cache_dim`` values
(latent + RoPE key) in the model dtype, or for an int8 layer the int8 latent, a float32
scale and the RoPE part in the model dtype (server/model/layers/latent_cache.py).  The worker's
pool (engine/kv/cache.py: KVCacheSpec) and ``python -m server --check``
(server/config/checkpoint/kv_block.py) both size from here, so a disk tier the check
accepts is one start-up accepts too.
"""
from __future__ import annotations

from typing import Iterable

from server.kvblock.file import file_overhead

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
    and its rows: kvblock/file.py)."""
    return int(disk_gb * GIB) // (block_bytes + file_overhead(block_size))


def min_disk_gb(block_bytes: int, block_size: int) -> float:
    """The least ``disk_size_gb`` that holds one block."""
    return (block_bytes + file_overhead(block_size)) / GIB
