"""Batch metadata from per-sequence host lists (the eager, varlen path)."""
from __future__ import annotations

import torch

from server.model.batch import BatchMetadata, expand_rows


def build_metadata(starts: list[int], query_lens: list[int], tables: list[list[int]],
                   block_size: int, device: torch.device,
                   logits_indices: torch.Tensor | None = None) -> BatchMetadata:
    """Metadata for sequences feeding ``query_lens[s]`` tokens from position ``starts[s]``.

    Slot of a token at position p: table[p // block_size] * block_size + p % block_size
    (worked example in server/model/batch.py).
    """
    n = len(starts)
    q = torch.tensor(query_lens, dtype=torch.int64)
    st = torch.tensor(starts, dtype=torch.int64)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(q, 0, out=cu[1:])
    seq_of, offset = expand_rows(q)
    positions = offset + st[seq_of]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    slots = bt[seq_of, positions // block_size] * block_size + positions % block_size
    seq_lens = [s + ql for s, ql in zip(starts, query_lens)]
    return BatchMetadata(
        positions=positions.to(device),
        query_start_loc=cu.to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=bt.to(torch.int32).to(device),
        slot_mapping=slots.to(device),
        block_size=block_size,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
        logits_indices=logits_indices.to(device) if logits_indices is not None else None,
        first_blocks_cpu=[t[0] if t else 0 for t in tables],
    )
