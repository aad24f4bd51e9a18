"""Bookkeeping of the host-memory KV tier: which host slot holds which block.  No torch.

The tier is a second level behind the device pool (block_manager.py), sized in blocks by
``cpuMemSize`` or the ``kvPoolConfig`` pool settings (host_pool.py turns GB into blocks).
It holds two kinds of slots:

  * cached slots: a full prefix block that left the device pool (evicted from the prefix
    cache), keyed by the same MTP-aware chain hash the device prefix cache uses; evicted
    least recently used first when the tier needs room;
  * swap slots: the blocks of a request preempted while the tier had room (swap-based
    preemption); owned by that request until it resumes or finishes, never evicted.

The engine decides every move here ("save device block B into host slot S", "load host
slot S into device block B"); the worker executes the copies it is sent in the step
message (kv_transfer.py) in step order, before the step's forward.  Because the worker
applies one step's copies in a fixed order (gather what is saved and what is loaded,
then write both), a slot handed to a new owner in the same step that reads its old
contents is still read correctly.
"""
from __future__ import annotations

from collections import OrderedDict


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))   # pop() gives slot 0 first
        self._cached: OrderedDict[int, int] = OrderedDict()           # hash -> slot, LRU first
        self.num_swap_slots = 0
        self.num_evicted = 0                 # cached slots handed to another block

    # ---- figures --------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    # ---- cached (prefix) slots --------------------------------------------------------
    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def touch(self, block_hash: int) -> None:
        """Mark a hit as most recently used."""
        if block_hash in self._cached:
            self._cached.move_to_end(block_hash)

    def store(self, block_hash: int) -> int | None:
        """The slot to save a block with ``block_hash`` into; None when the tier already
        holds that block (no copy needed) or every slot is swapped out."""
        if block_hash in self._cached:
            self._cached.move_to_end(block_hash)
            return None
        slot = self._take()
        if slot is not None:
            self._cached[block_hash] = slot
        return slot

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._cached:
            _, slot = self._cached.popitem(last=False)
            self.num_evicted += 1
            return slot
        return None

    # ---- swap slots -----------------------------------------------------------------
    def can_swap(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free) + len(self._cached)

    def take_swap(self, num_blocks: int) -> list[int]:
        """``num_blocks`` slots for a swapped-out request (caller checked ``can_swap``)."""
        slots = [self._take() for _ in range(num_blocks)]
        if None in slots:
            raise RuntimeError(f"host KV tier exhausted: {num_blocks} swap slots asked")
        self.num_swap_slots += num_blocks
        return slots  # type: ignore[return-value]

    def release_swap(self, slots: list[int]) -> None:
        """Slots of a request that resumed (their loads are already in its step) or ended."""
        self._free.extend(reversed(slots))
        self.num_swap_slots -= len(slots)
