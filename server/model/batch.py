"""Per-step batch metadata: the one object the model reads besides token ids and caches.

Built once per step by the engine's runner (or by tests); the model never builds it.
Prefill, decode and k+1-token MTP verification are the same thing here: every sequence
contributes ``query_len`` new tokens that attend to ``seq_len`` tokens of context
(the cached ones plus the new ones).

Worked example, block_size 4, two sequences:
  seq A: 5 tokens cached, 2 new (verify t, d1)  -> query_len 2, seq_len 7
  seq B: prefill of 3 tokens                     -> query_len 3, seq_len 3
  query_start_loc = [0, 2, 5]; positions = [5, 6, 0, 1, 2]
  A's block table [7, 2]: position 5 -> block 2 (5 // 4 = 1 -> table[1] = 2), offset 1
  -> slot 2 * 4 + 1 = 9; position 6 -> slot 10.  B's table [4]: slots 16, 17, 18.
  slot_mapping = [9, 10, 16, 17, 18]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def expand_rows(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence counts -> (sequence of each row, offset of the row in its sequence).

    Example: counts [2, 1, 3] -> seq [0, 0, 1, 2, 2, 2], offset [0, 1, 0, 0, 1, 2].
    """
    n = int(counts.sum())
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts, output_size=n)
    starts = torch.cumsum(counts, 0) - counts
    return seq, torch.arange(n) - starts[seq]


@dataclass(slots=True)
class BatchMetadata:
    positions: torch.Tensor        # [num_tokens] int64, absolute position of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor         # [num_seqs] int32, context length after this step's tokens
    block_tables: torch.Tensor     # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor     # [num_tokens] int64, cache slot (block * block_size + offset) to write
    block_size: int
    # Host copies, so the model can loop over sequences without a device sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Token indices (into the flat token dimension) whose logits are wanted; None = all.
    logits_indices: torch.Tensor | None = None  # [num_logits] int64
    # Host copy of each sequence's first KV block: attention data parallel reads which dp
    # group holds a sequence from it without a device sync (model/data_parallel.py).
    first_blocks_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))


@dataclass(slots=True)
class DecodeMetadata:
    """A step where every sequence feeds ``query_len`` tokens (decode, k+1-token
    verification, a chained draft pass): fixed shapes, no host lists (static_decode.py).

    Tokens are sequence-major: token ``b * query_len + i`` is sequence b's i-th new token.
    Example, block_size 4, query_len 2: sequence 0 at positions [5, 6] with table [7, 2]
    -> slots [9, 10]; ``block_tables`` is [num_seqs, num_blocks] with num_blocks covering
    the longest sequence (shorter tables padded with block 0, never read unmasked).
    """
    positions: torch.Tensor        # [num_seqs * query_len] int64
    slot_mapping: torch.Tensor     # [num_seqs * query_len] int64
    block_tables: torch.Tensor     # [num_seqs, num_blocks] int64
    query_len: int

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @classmethod
    def build(cls, starts: list[int], query_len: int, tables: list[list[int]], block_size: int,
              device: torch.device) -> "DecodeMetadata":
        """Sequence s feeds positions ``starts[s] .. starts[s] + query_len - 1``.  Tables
        get at least two columns: a compiled step then never sees a size-1 context dim
        (which it would specialise on and recompile for)."""
        width = max(2, -(-(max(starts) + query_len) // block_size))
        bt = torch.tensor([t[:width] + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        positions = (torch.tensor(starts, dtype=torch.int64)[:, None]
                     + torch.arange(query_len)[None, :])
        slots = bt.gather(1, positions // block_size) * block_size + positions % block_size
        # Flat copies, not views: a compiled step would guard on a view's base shape.
        return cls(positions.flatten().clone().to(device), slots.flatten().clone().to(device),
                   bt.to(device), query_len)
