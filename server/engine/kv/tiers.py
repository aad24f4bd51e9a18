"""The engine side of the KV tiers: building them for one engine, and their figures.

The host tier's bookkeeping (kv/host_tier.py) is sized by the worker's host pool; the
disk tier (kv/disk_tier.py) lives in a folder named after what makes a block's bytes mean
something (the model's config and files, block size, MTP-aware hashing, cache layout, the
file format), so files written for another checkpoint, layout or format are never read.
No torch.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from server.config.checkpoint.fingerprint import weights_fingerprint
from server.engine.config import EngineConfig
from server.engine.kv.block_manager import BlockManager
from server.engine.kv.disk_tier import DiskTier
from server.engine.kv.dp_blocks import DataParallelBlocks
from server.engine.kv.host_tier import HostTier
from server.engine.runtime import RuntimeInfo
from server.engine.stats import EngineStats
from server.kvblock.file import MAGIC
from server.kvblock.size import disk_tier_blocks

log = logging.getLogger("server.engine")


def make_block_manager(model_config: Any, cfg: EngineConfig,
                       rt: RuntimeInfo) -> BlockManager | DataParallelBlocks:
    """The engine's block manager with the tiers its worker's host pool allows; one pool
    per dp group with attention data parallel (kv/dp_blocks.py: no tiers)."""
    if rt.dp > 1:
        return DataParallelBlocks(rt.num_kv_blocks, cfg.block_size, rt.dp,
                                  enable_prefix_cache=cfg.enable_prefix_cache,
                                  hash_next_token=rt.mtp_enabled)
    host = HostTier(rt.host_kv_blocks) if rt.host_kv_blocks else None
    return BlockManager(rt.num_kv_blocks, cfg.block_size,
                        enable_prefix_cache=cfg.enable_prefix_cache,
                        hash_next_token=rt.mtp_enabled, host=host,
                        host_prefix=cfg.host_cache_prefix,
                        disk=_disk_tier(model_config, cfg, rt))


def _disk_tier(model_config: Any, cfg: EngineConfig, rt: RuntimeInfo) -> DiskTier | None:
    if not (cfg.disk_cache_dir and rt.host_cache_prefix):
        return None
    # The file format (MAGIC) is part of it: files of an older format live in another
    # folder and are never opened.  So are the weights' content (the fingerprint PD's
    # layout carries too): new weights copied over old ones at the same path read none of
    # the old ones' blocks.
    weights = weights_fingerprint(cfg.tokenizer_dir) if cfg.tokenizer_dir else None
    ident = repr((model_config, cfg.tokenizer_dir, weights, cfg.block_size, rt.mtp_enabled,
                  rt.num_kv_layers, rt.num_int8_kv_layers, rt.kv_block_bytes, MAGIC))
    fingerprint = hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()
    capacity = disk_tier_blocks(cfg.disk_cache_gb, rt.kv_block_bytes, cfg.block_size)  # as --check
    disk = DiskTier(Path(cfg.disk_cache_dir) / fingerprint, capacity, rt.kv_block_bytes,
                    cfg.block_size)
    log.info("disk KV tier: %s, %d blocks (%d found)", disk.dir, capacity, disk.num_blocks)
    return disk


def fill_tier_stats(st: EngineStats, blocks: BlockManager, block_bytes: int) -> None:
    """The host and disk tiers' figures, and hits pulled from a PD peer (0 without them)."""
    host, disk = blocks.host, blocks.disk
    st.host_cache_hits = blocks.num_host_hits
    st.host_blocks_total = host.num_blocks if host else 0
    st.host_blocks_used = host.num_used_blocks if host else 0
    st.host_blocks_cached = host.num_cached_blocks if host else 0
    st.host_usage = host.usage() if host else 0.0
    st.host_saves_skipped = host.num_skipped if host else 0
    st.kv_blocks_saved = blocks.num_blocks_saved
    st.kv_blocks_loaded = blocks.num_blocks_loaded
    st.kv_bytes_saved = blocks.num_blocks_saved * block_bytes
    st.kv_bytes_loaded = blocks.num_blocks_loaded * block_bytes
    st.disk_cache_hits = blocks.num_disk_hits
    st.remote_cache_hits = blocks.num_remote_hits
    st.disk_blocks_total = disk.capacity_blocks if disk else 0
    st.disk_blocks_used = disk.num_blocks if disk else 0
    st.disk_bytes_written = disk.num_written * block_bytes if disk else 0
    st.disk_bytes_read = disk.num_read * block_bytes if disk else 0
    st.disk_corrupt_files = disk.num_corrupt if disk else 0
