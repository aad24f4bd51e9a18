"""KV bookkeeping for attention data parallel (dp > 1): one block pool per dp group.  No torch.

The engine's pool of ``num_blocks`` global blocks is striped over the dp groups as the
worker holds it (model/data_parallel.py): global block b belongs to group b % dp.  Each
group is an ordinary ``BlockManager`` over its own ids (b = g, g + dp, g + 2 dp, ...), so
a sequence's blocks, its prefix-cache hits and their reference counts all stay in the one
group the scheduler placed it in (``Sequence.dp_group``); a prefix is only matched within
a group, because another group's ranks do not hold its rows.

Worked example, dp 2, 8 blocks: group 0 owns 0, 2, 4, 6 and group 1 owns 1, 3, 5, 7; a
sequence placed in group 1 gets a table such as [1, 3, 7], held by group 1's ranks at
local blocks 0, 1 and 3.

The scheduler places a sequence when it admits it (scheduler.py ``_place``: the group
with the longest prefix hit that has room, then the one with the most room); a sequence
preempted and recomputed may be placed again elsewhere.  The host/disk KV tiers and swap
preemption move whole blocks of one device pool: not with dp (refused at start:
executor/base.py, config/parallel.py).  PD transfer is served: a decode request's pulled
rows (``seq.remote_kv``) match in whichever group it is placed, the group's manager queues
their loads at its own block ids, and ``take_transfers`` hands them all to the step, where
each rank writes the ones of its group (kv/transfer/striped.py).
"""
from __future__ import annotations

from server.engine.kv.block_manager import BlockManager, PrefixMatch, Transfers
from server.engine.sequence import Sequence


class DataParallelBlocks:
    """The block manager's interface (as the scheduler and engine use it) over dp groups."""

    host = None                       # no KV tiers with dp
    disk = None

    def __init__(self, num_blocks: int, block_size: int, dp: int, *,
                 enable_prefix_cache: bool = False, hash_next_token: bool = True) -> None:
        if dp < 2 or num_blocks % dp:
            raise ValueError(f"a pool of {num_blocks} blocks does not split into {dp} dp groups")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_cache = enable_prefix_cache
        self.groups = [BlockManager(num_blocks // dp, block_size,
                                    enable_prefix_cache=enable_prefix_cache,
                                    hash_next_token=hash_next_token,
                                    block_ids=range(g, num_blocks, dp)) for g in range(dp)]

    # ---- placement --------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_blocks_per_group(self) -> int:
        return self.num_blocks // len(self.groups)

    def num_free(self, group: int = 0) -> int:
        return self.groups[group].num_free_blocks

    def group_of_block(self, block_id: int) -> int:
        return block_id % len(self.groups)

    # ---- figures (all groups) ---------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return sum(g.num_free_blocks for g in self.groups)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(g.num_cached_blocks for g in self.groups)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def _total(self, name: str) -> int:
        return sum(getattr(g, name) for g in self.groups)

    num_prefix_queries = property(lambda self: self._total("num_prefix_queries"))
    num_prefix_hits = property(lambda self: self._total("num_prefix_hits"))
    num_remote_hits = property(lambda self: self._total("num_remote_hits"))
    num_host_hits = num_disk_hits = property(lambda self: 0)
    num_blocks_saved = num_blocks_loaded = property(lambda self: 0)

    # ---- a sequence's blocks, in its group ---------------------------------------------
    def match_prefix(self, seq: Sequence, group: int = 0) -> PrefixMatch:
        return self.groups[group].match_prefix(seq)

    def allocate(self, seq: Sequence, match: PrefixMatch, num_slots: int) -> None:
        self.groups[seq.dp_group].allocate(seq, match, num_slots)

    def append_slots(self, seq: Sequence, num_slots: int) -> None:
        self.groups[seq.dp_group].append_slots(seq, num_slots)

    def register_computed(self, seq: Sequence) -> None:
        self.groups[seq.dp_group].register_computed(seq)

    def free(self, seq: Sequence) -> None:
        self.groups[seq.dp_group].free(seq)

    def can_allocate(self, num_blocks: int, group: int = 0) -> bool:
        return num_blocks <= self.num_free(group)

    def can_swap_out(self, seq: Sequence) -> bool:
        return False

    def purge_peer_blocks(self, epoch: int) -> None:
        for g in self.groups:
            g.purge_peer_blocks(epoch)

    def take_transfers(self) -> Transfers:
        """The groups' queued loads of PD rows (by global block id; no tier copies)."""
        out = Transfers()
        for g in self.groups:
            out.row_loads += g.take_transfers().row_loads
        return out
