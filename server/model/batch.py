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

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))
