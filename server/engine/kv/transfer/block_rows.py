"""Whole blocks as byte rows, for moving KV between instances (PD) without a host tier.

A row is what a host tier slot and a disk tier file hold (host_pool.py): for every cache
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

    def gather_tensor(self, ids: torch.Tensor) -> torch.Tensor:
        """[n, bytes_per_block] uint8 on the device: the blocks ``ids``, every layer."""
        n = ids.numel()
        return torch.cat([t.index_select(0, ids).reshape(n, -1).view(torch.uint8)
                          for t in self.tensors], dim=1)

    def scatter_tensor(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` [n, bytes_per_block] (uint8, on the device) into blocks ``ids``."""
        n = ids.numel()
        for t, part in zip(self.tensors, rows.split(self.row_bytes, dim=1)):
            t.index_copy_(0, ids, part.contiguous().view(t.dtype).view(n, *t.shape[1:]))

    def gather(self, block_ids: Sequence[int]) -> bytes:
        """The rows of ``block_ids``, end to end, on the host."""
        if not block_ids:
            return b""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return self.gather_tensor(ids).cpu().numpy().tobytes()

    def scatter(self, loads: Sequence[tuple[bytes, int]]) -> None:
        """Write each (row, device block) pair."""
        if not loads:
            return
        rows = torch.frombuffer(bytearray(b"".join(r for r, _ in loads)), dtype=torch.uint8)
        rows = rows.view(len(loads), self.bytes_per_block).to(self.device)
        self.scatter_tensor(torch.tensor([b for _, b in loads], dtype=torch.long,
                                         device=self.device), rows)
