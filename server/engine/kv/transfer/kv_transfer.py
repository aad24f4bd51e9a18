"""The one door through which KV blocks leave and enter a worker's device pool.

Whatever moves blocks, the worker calls this object only: before a step's forward,
``apply`` runs the copies the step message carries (host tier saves and loads, disk
writes of saved blocks, whole rows read from disk or pulled from a PD prefill
instance); after a PD prefill, ``export`` hands out a prompt's full blocks as rows.  So
the tiers (kv/transfer/host_pool.py) and the PD transfer (server/pd) are composed here, the way
vLLM's KV connector carries offload and disaggregation alike, and the worker knows
neither.  Order in a step: the host tier's copies (their own order, kv/transfer/host_pool.py),
then the rows, which are written last.  With a pool striped over ranks (sp, cp, dp) the
rows are read and written by global id through kv/transfer/striped.py.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from server.engine.kv.transfer.block_rows import BlockRows
from server.engine.kv.transfer.host_pool import HostKVPool
from server.engine.kv.transfer.striped import StripedRows, StripePlace
from server.engine.messages import SchedulerOutput

log = logging.getLogger("server.engine")


class KVTransfer:
    def __init__(self, caches: Sequence, device: torch.device, host_slots: int = 0,
                 async_write: bool = False, stripes: StripePlace | None = None) -> None:
        """``stripes``: this rank's place in a striped pool (None: it holds every block)."""
        self.rows = BlockRows(caches, device) if stripes is None \
            else StripedRows(caches, device, stripes)
        self.host: HostKVPool | None = None
        if host_slots > 0:
            self.host = HostKVPool(self.rows, host_slots, device, async_write)
            log.info("host KV tier: %d blocks (%.1f MiB%s)", host_slots,
                     host_slots * self.rows.bytes_per_block / (1 << 20),
                     ", pinned" if self.host.cuda else "")

    @staticmethod
    def host_slots_for(bytes_per_block: int, host_blocks: int | None, host_gb: float) -> int:
        """The host tier's size in blocks: given, or what ``host_gb`` holds (0: no tier)."""
        if host_blocks is not None:
            return max(0, host_blocks)
        return HostKVPool.slots_for(bytes_per_block, host_gb) if host_gb > 0 else 0

    @property
    def bytes_per_block(self) -> int:
        return self.rows.bytes_per_block

    @property
    def host_slots(self) -> int:
        return self.host.num_slots if self.host is not None else 0

    def apply(self, so: SchedulerOutput) -> None:
        """The step's copies, before its forward reads or reuses the blocks."""
        if not so.has_kv_transfers:
            return
        if self.host is not None:
            self.host.apply(so.kv_saves, so.kv_loads, so.kv_disk_writes)
        self.rows.scatter(so.kv_row_loads)

    def export(self, block_ids: Sequence[int]) -> bytes:
        """The rows of ``block_ids``, end to end, on the host (a PD prefill's export)."""
        return self.rows.gather(block_ids)
