"""Bookkeeping of the host-memory KV tier: which host slot holds which block.  No torch.

The tier is a second level behind the device pool (kv/block_manager.py), sized in blocks by
``cpuMemSize`` or the ``kvPoolConfig`` pool settings (kv/transfer/host_pool.py turns GB
into blocks).  It holds two kinds of slots:

  * cached slots: a full prefix block that left the device pool (evicted from the prefix
    cache), keyed by the same MTP-aware block key the device prefix cache uses
    (kvblock/key.py: a lookup compares the block's tokens, not only its digest); evicted
    least recently used first when the tier needs room;
  * swap slots: the blocks of a request preempted while the tier had room (swap-based
    preemption); owned by that request until it resumes or finishes, never evicted.

The engine decides every move here ("save device block B into host slot S", "load host
slot S into device block B"); the worker executes the copies it is sent in the step
message (kv/transfer/host_pool.py) in step order, before the step's forward.  Because the worker
applies one step's copies in a fixed order (gather what is saved and what is loaded,
then write both), a slot handed to a new owner in the same step that reads its old
contents is still read correctly.

The other order cannot be: a slot written in a step holds its new rows only after the
step's copies, so within one step it is never handed out again (two saves into one slot
would leave one block's rows under the other's hash, and the disk tier would file them
with a valid digest) and never read (a load would get the rows it held before).  Such a
slot is "written this step" until ``end_step``; the block manager calls that when the
step message takes the copies.  With every slot written this step, a save is skipped:
the block is recomputed if it is needed again, which is always right.
"""
from __future__ import annotations

from collections import OrderedDict

from server.kvblock.key import BlockKey


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))   # pop() gives slot 0 first
        self._cached: OrderedDict[BlockKey, int] = OrderedDict()      # key -> slot, LRU first
        self.num_swap_slots = 0
        self.num_evicted = 0                 # cached slots handed to another block
        self.num_skipped = 0                 # blocks not kept: every slot written this step
        self._written: set[int] = set()      # slots saved into by the step being planned

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
    def lookup(self, block_hash: BlockKey) -> int | None:
        """The slot holding ``block_hash``; None also while its save is in this step."""
        slot = self._cached.get(block_hash)
        return None if slot in self._written else slot

    def touch(self, block_hash: BlockKey) -> None:
        """Mark a hit as most recently used."""
        if block_hash in self._cached:
            self._cached.move_to_end(block_hash)

    def holds(self, block_hash: BlockKey) -> bool:
        return block_hash in self._cached

    def drop(self, block_hash: BlockKey) -> None:
        """Forget a cached block (a PD role change purged it: kv/peer_blocks.py); its slot
        is free again.  Called between steps, when no slot is being written."""
        slot = self._cached.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def store(self, block_hash: BlockKey) -> int | None:
        """The slot to save a block with ``block_hash`` into; None when the tier already
        holds that block (no copy needed) or every slot is swapped out."""
        if block_hash in self._cached:
            self._cached.move_to_end(block_hash)
            return None
        slot = self._take()
        if slot is None:
            self.num_skipped += 1
        else:
            self._cached[block_hash] = slot
        return slot

    def _take(self) -> int | None:
        """A slot to write this step: a free one, else the least recently used cached one
        not already written this step."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._cached.items() if s not in self._written), None)
            if victim is None:
                return None
            slot = self._cached.pop(victim)
            self.num_evicted += 1
        self._written.add(slot)
        return slot

    def end_step(self) -> None:
        """The step's copies are planned: its slots may be read and reused from the next."""
        self._written.clear()

    # ---- swap slots -----------------------------------------------------------------
    def can_swap(self, num_blocks: int) -> bool:
        evictable = sum(1 for s in self._cached.values() if s not in self._written)
        return num_blocks <= len(self._free) + evictable

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
