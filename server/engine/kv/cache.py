"""KV pool: one paged latent cache per cache layer (server/model/layers/latent_cache.py), float
([num_blocks, block_size, kv_cache_dim] in the model dtype) or int8 (``kv_cache_dtype``
"int8": int8 latent + per-token scale, RoPE part in the model dtype).

Cache layers are the main decoder layers followed by the MTP layer(s); all share one block
table per sequence (bookkeeping in kv/block_manager.py).  MLA caches the compressed latent
plus the RoPE key per token (``kv_cache_dim``), not full K/V.

Sizing (``num_blocks_for``), in order of precedence:
  * an explicit ``num_blocks`` (tests);
  * ``npuMemSize`` > 0: that many GiB for the whole pool;
  * ``npuMemSize`` == -1: on an accelerator, AUTO_MEMORY_FRACTION of the memory free after
    the model is loaded (MindIE's NPU_MEMORY_FRACTION default is 0.8); on CPU,
    CPU_MEMORY_FRACTION of MemAvailable, at most CPU_MAX_GIB, because the host also holds
    the model and everything else.
  In every case the count is capped at what maxBatchSize sequences of maxSeqLen (+ draft
  slots) can ever use, so a small model does not grab the whole device.

Sequence parallel (sp > 1, model/sequence_parallel.py): the budget is one rank's, and buys
that rank's stripe; the engine's pool is sp times the stripe (global block b on rank
b % sp), so the same npuMemSize holds ~sp times the tokens.  An explicit ``num_blocks``
is the engine's pool then.  Each rank keeps one sink block on top of its stripe.
Attention data parallel (dp > 1, model/data_parallel.py) stripes the pool the same way,
one stripe per dp group: the same npuMemSize holds ~dp times one group's tokens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from server.kvblock.size import kv_block_bytes, kv_bytes_per_token
from server.model.layers.latent_cache import Int8LatentCache, LatentCache
from server.model.parallel.sequence import StripedLatentCache, StripeIndex

log = logging.getLogger("server.engine")

AUTO_MEMORY_FRACTION = 0.8
CPU_MEMORY_FRACTION = 0.25
CPU_MAX_GIB = 4.0
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int          # main + MTP cache layers
    block_size: int
    kv_cache_dim: int        # latent + rope
    dtype: torch.dtype       # the model dtype
    rope_dim: int = 0        # the part an int8 cache keeps in the model dtype
    int8_layers: frozenset[int] = frozenset()   # cache layers with an int8 latent

    # Sized by kvblock/size.py, which ``--check`` uses too (the disk tier's minimum).
    def bytes_per_token(self, layer: int) -> int:
        return kv_bytes_per_token(self.kv_cache_dim, self.rope_dim, self._dtype_bytes,
                                  layer in self.int8_layers)

    @property
    def bytes_per_block(self) -> int:
        return kv_block_bytes(self.num_layers, self.block_size, self.kv_cache_dim, self.rope_dim,
                              self._dtype_bytes, self.int8_layers)

    @property
    def _dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def _cpu_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GIB


def num_blocks_for(spec: KVCacheSpec, *, mem_size_gb: float, device: torch.device | str,
                   max_useful_blocks: int, num_blocks: int | None = None) -> int:
    """How many blocks the pool gets (see the module docstring)."""
    if num_blocks is not None:
        return int(num_blocks)
    if mem_size_gb > 0:
        budget = int(mem_size_gb * GIB)
        how = f"npuMemSize={mem_size_gb:g} GiB"
    else:
        dev = torch.device(device)
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            budget = int(free * AUTO_MEMORY_FRACTION)
            how = f"{AUTO_MEMORY_FRACTION:g} of {free / GIB:.1f} GiB free on {dev}"
        else:
            avail = _cpu_available_bytes()
            budget = int(min(avail * CPU_MEMORY_FRACTION, CPU_MAX_GIB * GIB))
            how = f"min({CPU_MEMORY_FRACTION:g} of {avail / GIB:.1f} GiB available, {CPU_MAX_GIB:g} GiB)"
    blocks = min(budget // spec.bytes_per_block, max_useful_blocks)
    log.info("KV pool: %d blocks x %d tokens (%.1f MiB; budget %s)", blocks, spec.block_size,
             blocks * spec.bytes_per_block / (1 << 20), how)
    if blocks < 1:
        raise ValueError(f"KV pool budget ({how}) is smaller than one block "
                         f"({spec.bytes_per_block} bytes)")
    return int(blocks)


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int,
                       device: torch.device | str) -> list[LatentCache | Int8LatentCache]:
    """Zeroed pool caches, one per cache layer (zeros: padding slots never hold NaN)."""
    return [Int8LatentCache(num_blocks, spec.block_size, spec.kv_cache_dim - spec.rope_dim,
                            spec.rope_dim, spec.dtype, device) if i in spec.int8_layers
            else LatentCache(torch.zeros(num_blocks, spec.block_size, spec.kv_cache_dim,
                                         dtype=spec.dtype, device=device))
            for i in range(spec.num_layers)]


def rank_blocks(pool_blocks: int, sp: int) -> int:
    """Blocks one rank allocates for an engine pool of ``pool_blocks``: all of them, or
    with sp > 1 its stripe (ceil(pool_blocks / sp)) plus the sink block."""
    return pool_blocks if sp == 1 else -(-pool_blocks // sp) + 1


def stripe_kv_caches(caches: list, rank: int, sp: int, block_size: int) -> list:
    """Rank ``rank``'s caches of a pool striped over ``sp`` ranks (sp 1: as they are);
    each cache's ``num_blocks`` is then the engine's pool, sp x (allocated - 1)."""
    if sp == 1:
        return caches
    if caches[0].num_blocks < 2:
        raise ValueError("the KV budget holds one block per rank: a striped pool (sp or dp "
                         "> 1) needs a sink block besides the rank's stripe; give npuMemSize "
                         "more room")
    index = StripeIndex(rank, sp, block_size)        # one per pool: the layers share a step's
    return [StripedLatentCache(c, index) for c in caches]
