"""Shared helpers for model tests: a tiny paged-cache driver that builds BatchMetadata."""
from __future__ import annotations

import random

import pytest
import torch

from server.model.batch import BatchMetadata


class PagedDriver:
    """Owns block tables and caches for a few sequences, like a minimal engine runner.

    Blocks are handed out in shuffled order so tables are non-contiguous, and caches start
    as NaN so any read of a slot that was never written poisons the result.
    """

    def __init__(self, model, num_blocks: int = 96, block_size: int = 4, seed: int = 0) -> None:
        self.block_size = block_size
        self.caches = [torch.full((num_blocks, block_size, model.kv_cache_dim), float("nan"))
                       for _ in range(model.num_kv_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def meta(self, seqs: list[int], starts: list[int], query_lens: list[int]) -> BatchMetadata:
        """Step where seq s gets query_lens[i] new tokens at positions starts[i]... ."""
        bs = self.block_size
        positions, slots = [], []
        for s, start, n in zip(seqs, starts, query_lens):
            table = self.tables.setdefault(s, [])
            while len(table) * bs < start + n:
                table.append(self.free.pop())
            for p in range(start, start + n):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
        width = max(len(self.tables[s]) for s in seqs)
        tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        seq_lens = [start + n for start, n in zip(starts, query_lens)]
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        return BatchMetadata(
            positions=torch.tensor(positions, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_size=bs,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=seq_lens,
        )


@pytest.fixture
def driver_cls():
    return PagedDriver
