"""The host tier's memory and the block copies between it and the device pool (worker side).

A slot is one byte row holding a whole block: for every cache layer (main layers and the
MTP layer) every tensor the layer's cache stores per block (float rows; or int8 latent,
float32 scale and RoPE rows), laid end to end.  So a block moves whole whatever its dtype,
and one copy per direction crosses the host/device boundary per step.  The same row is
what a disk tier file holds (kvblock/file.py).

The engine decides the moves (kv/host_tier.py, kv/block_manager.py); the step message carries
them as ``kv_saves`` (device block, host slot) and ``kv_loads`` (host slot, device block),
and ``apply`` runs them before the step's forward (kv/transfer/kv_transfer.py calls it).  Order
inside one step: gather the device blocks being saved, gather the host slots being
loaded, then write both.  That makes a device block that is saved and then reused as a
load's destination in the same step, or a host slot read by a load and reused by a save,
come out right.  Disk writes (``kv_disk_writes``: a slot saved this step, to a file)
follow the host writes.  The device side of every copy is kv/transfer/block_rows.py's.

On CUDA the host rows are pinned.  Saves go device -> pinned staging -> host rows; with
``async_write`` (kvPoolConfig.asyncWrite) the last step of that waits until the next
``apply`` (or ``flush``), so the host does not wait for the copy behind the forward; the
copy itself is ordered on the compute stream, before the forward reuses the blocks.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from server.engine.kv.transfer.block_rows import BlockRows
from server.kvblock.file import write_block
from server.kvblock.key import BlockKey

log = logging.getLogger("server.engine")
GIB = 1 << 30


class HostKVPool:
    def __init__(self, caches: Sequence | BlockRows, num_slots: int, device: torch.device,
                 async_write: bool = False) -> None:
        self.device = torch.device(device)
        self.rows = caches if isinstance(caches, BlockRows) else BlockRows(caches, device)
        self.bytes_per_block = self.rows.bytes_per_block
        self.num_slots = num_slots
        self.cuda = self.device.type == "cuda"
        self.async_write = async_write and self.cuda
        # torch.empty: on a CPU the pages are only touched when a slot is first written.
        self.data = torch.empty(num_slots, self.bytes_per_block, dtype=torch.uint8,
                                pin_memory=self.cuda)                      # [num_slots, bytes]
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event] | None = None
        self._load_staging: torch.Tensor | None = None
        self._load_event: torch.cuda.Event | None = None

    @staticmethod
    def slots_for(bytes_per_block: int, mem_gb: float) -> int:
        return int(mem_gb * GIB) // bytes_per_block

    # ---- the step's copies ----------------------------------------------------------
    def apply(self, saves: Sequence[tuple[int, int]], loads: Sequence[tuple[int, int]],
              disk_writes: Sequence[tuple[int, BlockKey, str]] = ()) -> None:
        self.flush()
        _check_unique_slots(saves, disk_writes)
        saved = None
        if saves:
            bids = torch.tensor([b for b, _ in saves], dtype=torch.long, device=self.device)
            save_slots = torch.tensor([s for _, s in saves], dtype=torch.long)
            saved = self.rows.gather_tensor(bids)
        loaded = None
        if loads:
            load_slots = torch.tensor([s for s, _ in loads], dtype=torch.long)
            load_bids = torch.tensor([b for _, b in loads], dtype=torch.long, device=self.device)
            loaded = self._read_host(load_slots)
        if saved is not None:
            self._write_host(save_slots, saved)
        if disk_writes:                       # the rows just saved, now final on the host
            self.flush()
            for slot, key, path in disk_writes:
                try:
                    write_block(path, key, self.data[slot].numpy().data)
                except OSError as exc:        # e.g. a full disk: a missing file is a miss later
                    log.warning("disk KV tier: writing %s failed: %s", path, exc)
        if loaded is not None:
            self.rows.scatter_tensor(load_bids, loaded)

    def _read_host(self, slots: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return self.data.index_select(0, slots)
        n = slots.numel()
        if self._load_event is not None:          # the previous H2D copy still reads it
            self._load_event.synchronize()
        if self._load_staging is None or self._load_staging.shape[0] < n:
            self._load_staging = torch.empty(n, self.bytes_per_block, dtype=torch.uint8,
                                             pin_memory=True)
        staging = self._load_staging[:n]
        torch.index_select(self.data, 0, slots, out=staging)
        rows = staging.to(self.device, non_blocking=True)
        self._load_event = torch.cuda.Event()
        self._load_event.record()
        return rows

    def _write_host(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        if not self.cuda:
            self.data.index_copy_(0, slots, rows)
            return
        staging = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
        staging.copy_(rows, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (slots, staging, event)
        if not self.async_write:
            self.flush()

    def flush(self) -> None:
        """Finish a deferred save (asyncWrite): wait for its copy, then file the rows."""
        if self._pending is None:
            return
        slots, staging, event = self._pending
        self._pending = None
        event.synchronize()
        self.data.index_copy_(0, slots, staging)


def _check_unique_slots(saves: Sequence[tuple[int, int]],
                        disk_writes: Sequence[tuple[int, BlockKey, str]]) -> None:
    """Refuse a step whose copies would file one block's rows under another's hash.

    The engine never plans one (kv/host_tier.py); this keeps a planning fault from turning
    into wrong answers served later from the disk tier: the step fails instead."""
    slots = [s for _, s in saves]
    if len(set(slots)) != len(slots):
        raise RuntimeError(f"KV tier: one step saves two blocks into one host slot ({slots})")
    stray = [s for s, _, _ in disk_writes if s not in set(slots)]
    if stray:
        raise RuntimeError(f"KV tier: disk writes of host slots not saved this step ({stray})")
