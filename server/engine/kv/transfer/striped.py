"""PD transfer of whole KV blocks for a pool striped over ranks (sp, also under cp; dp).

Why: a PD prefill instance exports a prompt's blocks as rows by global block id, and a
decode instance writes pulled rows into the blocks its scheduler allocated, by global id
(kv_transfer.py, block_rows.py).  With a striped pool (model/parallel/sequence.py:
global block b lives on the ranks of stripe b % n, at local block b // n; the sp ranks
under sequence/context parallel, the dp groups under attention data parallel, kv/cache.py)
no rank holds every block, so rows cannot be read or written by id on one rank alone.

The design, chosen because it needs no new messages and is exact bit for bit:

* Every rank already runs every step message (worker/rank_group.py broadcasts them), so
  every rank sees the same row loads and the same export requests in the same order.
* **Writing** (a decode instance, ``scatter``): each rank keeps the loads of the blocks
  its stripe owns and writes them at their local ids; the others' are dropped.  Every
  rank of a stripe (the tp ranks of a dp group, the cp copies of an sp stripe) writes its
  own copy, so all copies stay equal.  No collective.
* **Reading** (a prefill instance, ``gather``): each block's rows are read on one rank
  only, the lowest rank holding its stripe (the stripe's *primary*: rank s for sp stripe
  s, even with cp; rank g * tp for dp group g); every other rank contributes zeros, and
  one all-reduce (SUM over uint8) of the [blocks, bytes_per_block] tensor gives every
  rank the full rows: x + 0 + ... + 0 = x, exactly one non-zero contribution per byte.
  One collective per exported request, called by every rank in the same order (the
  export list follows from the step message alone).

What is checked is unchanged: the rows travel in the same format as from one process,
so the PD trust checks (server/pd/trust.py: signed params, digests bound to the prompt's
tokens) see no difference.  Worked example, sp 2 (ranks 0, 1; stripes 0, 1), export of
blocks [4, 7, 2]: rank 0 reads local blocks 2 and 1 (global 4 and 2) into rows 0 and 2,
rank 1 reads local block 3 (global 7) into row 1; the sum is all three.  A decode
instance with dp 2 writing [(r0, 6), (r1, 8)] (both of dp group 0): group 0's ranks write
local blocks 3 and 4, group 1's ranks nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from server.distributed import collectives
from server.engine.kv.transfer.block_rows import BlockRows


@dataclass(frozen=True, slots=True)
class StripePlace:
    """Where one rank sits in a striped pool."""
    stripe: int          # the stripe it holds (its local blocks are b // count of b % count == stripe)
    count: int           # stripes in the pool
    primary: bool        # the lowest rank holding its stripe: it reads that stripe's exports

    @classmethod
    def of(cls, par: Any, rank: int) -> "StripePlace":
        """Rank ``rank``'s place under ``par`` (engine.config.ParallelConfig)."""
        stripe = par.kv_stripe(rank)
        primary = all(par.kv_stripe(q) != stripe for q in range(rank))
        return cls(stripe, par.kv_stripes, primary)

    def owns(self, block_id: int) -> bool:
        return block_id % self.count == self.stripe


class StripedRows(BlockRows):
    """``BlockRows`` by global block id over this rank's stripe (see the module docstring).
    ``gather`` is a collective of the default process group: every rank calls it with the
    same ids."""

    def __init__(self, caches: Sequence, device: torch.device, place: StripePlace) -> None:
        super().__init__(caches, device)
        self.place = place

    def gather(self, block_ids: Sequence[int]) -> bytes:
        """The rows of global blocks ``block_ids``, end to end, on every rank."""
        if not block_ids:
            return b""
        p = self.place
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        rows = torch.zeros(len(ids), self.bytes_per_block, dtype=torch.uint8, device=self.device)
        mine = (ids % p.count == p.stripe).nonzero().flatten()
        if p.primary and mine.numel():
            local = (ids[mine] // p.count).to(self.device)
            rows[mine.to(self.device)] = self.gather_tensor(local)
        collectives.all_reduce(rows)
        return rows.cpu().numpy().tobytes()

    def scatter(self, loads: Sequence[tuple[bytes, int]]) -> None:
        """Write the (row, global block) pairs of this rank's stripe at their local ids."""
        p = self.place
        super().scatter([(row, b // p.count) for row, b in loads if p.owns(b)])
