"""The paged MLA latent cache of one layer: a float variant and an int8 variant.

A token's row is ``[latent (kv_lora_rank) | roped k_pe (rope_dim)]``.  The attention code
only writes rows at slots and gathers the rows of block tables; how they are stored is the
cache's business, so prefix caching, preemption and the MTP layer work on either variant.

Int8 (``Int8LatentCache``): the latent is stored as int8 with one float32 scale per token
(symmetric, dynamic: scale = max|latent| / 127), and the RoPE part stays in the model
dtype, as MindIE's FA3 scheme keeps it ("quantize the non-rope part of K to 8 bit, not the
rope part").  Rows dequantize on read.  Per token that is kv_lora_rank bytes + rope_dim
model-dtype values + 4 bytes instead of (kv_lora_rank + rope_dim) model-dtype values:
DeepSeek-V3 in bf16 644 vs 1152 bytes (1.79x the blocks for the same memory), the demo
model in float32 132 vs 320 bytes (2.42x).
"""
from __future__ import annotations

import torch


class LatentCache:
    """Rows stored as they are, in one [num_blocks, block_size, dim] tensor."""

    exact = True

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    def write(self, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [T, dim] go to ``slot_mapping`` [T] (block * block_size + offset)."""
        self.data.view(-1, self.data.shape[-1]).index_copy_(0, slot_mapping, rows.to(self.data.dtype))

    def gather(self, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
        """[B, max_len, dim]: the rows of each sequence's first ``max_len`` positions."""
        return self.data[block_tables].flatten(1, 2)[:, :max_len]

    def read_slots(self, slots: list[int]) -> torch.Tensor:
        return self.data.view(-1, self.data.shape[-1])[slots].float()

    def block_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every stored tensor, block id first (a block moves whole:
        engine/kv/transfer/host_pool.py)."""
        return (self.data,)


class Int8LatentCache:
    """int8 latent + a per-token scale; RoPE part in the model dtype (module docstring)."""

    exact = False

    def __init__(self, num_blocks: int, block_size: int, latent_dim: int, rope_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.latent_dim = latent_dim
        self.latent = torch.zeros(num_blocks, block_size, latent_dim, dtype=torch.int8, device=device)
        self.rope = torch.zeros(num_blocks, block_size, rope_dim, dtype=dtype, device=device)
        self.scale = torch.zeros(num_blocks, block_size, 1, dtype=torch.float32, device=device)

    @property
    def num_blocks(self) -> int:
        return self.latent.shape[0]

    @staticmethod
    def bytes_per_token(latent_dim: int, rope_dim: int, dtype: torch.dtype) -> int:
        return latent_dim + rope_dim * torch.empty((), dtype=dtype).element_size() + 4

    def write(self, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        int8_write(self.block_tensors(), slot_mapping, rows)

    def gather(self, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
        return int8_gather(self.block_tensors(), block_tables)[:, :max_len]

    def read_slots(self, slots: list[int]) -> torch.Tensor:
        lat = self.latent.view(-1, self.latent_dim)[slots].float() * self.scale.view(-1, 1)[slots]
        return torch.cat([lat, self.rope.view(-1, self.rope.shape[-1])[slots].float()], dim=-1)

    def block_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every stored tensor, block id first (a block moves whole:
        engine/kv/transfer/host_pool.py): (latent int8, scale float32, rope), also what the
        static step's graphs take for this cache (static_decode.attend)."""
        return (self.latent, self.scale, self.rope)


def int8_write(cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
               rows: torch.Tensor) -> None:
    """rows [T, latent + rope] to ``slot_mapping`` of an int8 cache's tensors
    (``Int8LatentCache.block_tensors``; free functions so that a graph takes them): the latent
    quantized per token (scale = max|latent| / 127), the RoPE part as it is."""
    latent_q, scale_t, rope = cache
    dim = latent_q.shape[-1]
    latent, k_pe = rows.split([dim, rows.shape[-1] - dim], dim=-1)
    lat = latent.float()
    scale = lat.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    q = torch.round(lat / scale).clamp(-127, 127).to(torch.int8)
    latent_q.view(-1, dim).index_copy_(0, slot_mapping, q)
    scale_t.view(-1, 1).index_copy_(0, slot_mapping, scale)
    rope.view(-1, rope.shape[-1]).index_copy_(0, slot_mapping, k_pe.to(rope.dtype))


def int8_gather(cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                block_tables: torch.Tensor) -> torch.Tensor:
    """[B, blocks * block_size, latent + rope] in the RoPE part's dtype: each sequence's
    rows dequantized."""
    latent_q, scale, rope = cache
    q = latent_q[block_tables].flatten(1, 2)
    s = scale[block_tables].flatten(1, 2)
    pe = rope[block_tables].flatten(1, 2)
    return torch.cat([(q.float() * s).to(pe.dtype), pe], dim=-1)


CacheLike = torch.Tensor | LatentCache | Int8LatentCache


def as_cache(cache: CacheLike) -> LatentCache | Int8LatentCache:
    """A raw [num_blocks, block_size, dim] tensor (tests, references) is a float cache."""
    return LatentCache(cache) if isinstance(cache, torch.Tensor) else cache
