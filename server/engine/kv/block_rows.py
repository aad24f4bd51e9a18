"""Whole blocks as byte rows, for moving KV between instances (PD) without a host tier.

A row is what a host tier slot and a disk tier file hold (kv/host_pool.py): for every cache
layer, the main layers' and the MTP layer's, every tensor its cache stores per block, laid
end to end, so a block moves whole whatever its dtype.
"""
from __future__ import annotations

from typing import Sequence

import torch


class BlockRows:
    def __init__(self, caches: Sequence, device: torch.device) -> None:
        self.device = torch.device(device)
        self.tensors = [t for c in caches for t in c.block_tensors()]      # each [num_blocks, ...]
        self.row_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.bytes_per_block = sum(self.row_bytes)

    def gather(self, block_ids: Sequence[int]) -> bytes:
        """The rows of ``block_ids``, end to end, on the host."""
        if not block_ids:
            return b""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        n = ids.numel()
        rows = torch.cat([t.index_select(0, ids).reshape(n, -1).view(torch.uint8)
                          for t in self.tensors], dim=1)
        return rows.cpu().numpy().tobytes()

    def scatter(self, loads: Sequence[tuple[bytes, int]]) -> None:
        """Write each (row, device block) pair."""
        if not loads:
            return
        n = len(loads)
        rows = torch.frombuffer(bytearray(b"".join(r for r, _ in loads)), dtype=torch.uint8)
        rows = rows.view(n, self.bytes_per_block).to(self.device)
        ids = torch.tensor([b for _, b in loads], dtype=torch.long, device=self.device)
        for t, part in zip(self.tensors, rows.split(self.row_bytes, dim=1)):
            t.index_copy_(0, ids, part.contiguous().view(t.dtype).view(n, *t.shape[1:]))
