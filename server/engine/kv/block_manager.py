"""Paged KV bookkeeping: block allocation, reference counts and the prefix cache.

No torch: the scheduler calls it, the tensors live in kv/cache.py.  A sequence's block
table maps position ``j`` to slot ``table[j // block_size] * block_size + j % block_size``
in every cache layer (main layers and the MTP layer share the table).

Prefix cache.  A block is registered once all its positions are computed.  Its key chains
the parent block's hash with the block's tokens; with MTP on it also includes the token
*after* the block, because the MTP layer's KV at position j is computed from the main
hidden state at j and the embedding of token j+1: the last slot of a block depends on the
first token of the next block.  A cached block is therefore only reused when that token
matches too, and then both its main and MTP KV are exact (never dropped, never stale).
Free blocks that carry a hash stay findable until evicted, least recently freed first;
free blocks without one are handed out before any cached block is evicted.

Host tier (kv/host_tier.py, optional).  With ``host_prefix`` an evicted cached block is saved
to the tier under its hash, and ``match_prefix`` continues past the device run into the
tier: those blocks get fresh device blocks and are loaded back instead of recomputed.
With ``swap`` the scheduler may swap a preempted sequence's blocks out (``swap_out``) and
back in on resume (``swap_in``).  Every move is queued here as plain (source,
destination) pairs that the scheduler puts in the step message (``take_transfers``).
With a disk tier (kv/disk_tier.py) too, a block saved to the host tier is also written to
disk, and a match goes on from the host tier into files verified before they count.

Keys are SHA-256 chains over the blocks' tokens (kvblock/key.py), the same in every
process, so blocks a previous daemon wrote to disk are found again; a hit compares the
block's tokens, never the digest alone.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from server.kvblock.key import BlockKey, block_key
from server.engine.kv.disk_tier import DiskTier
from server.engine.kv.host_tier import HostTier
from server.engine.kv.peer_blocks import PeerBlocks
from server.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockKey | None = None


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    block_ids: list[int]             # matched device blocks
    hashes: list[BlockKey]           # every matched block: the device run, then the host run
    num_free_hits: int               # matched device blocks currently free (leave the free pool on use)
    # each block after the device run: its host tier slot (int), or its bytes read from
    # the disk tier and verified (bytes)
    tier_sources: tuple[int | bytes, ...] = ()

    @property
    def num_blocks(self) -> int:     # blocks whose KV need not be computed
        return len(self.hashes)

    @property
    def num_device_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(slots=True)
class Transfers:
    """Copies queued for the next step message: (device block, host slot) saves,
    (host slot, device block) loads, (host slot, key, path) disk writes of saved blocks
    and (row, device block) loads of rows read from disk or pulled from a PD peer."""
    saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    disk_writes: list[tuple[int, BlockKey, str]] = field(default_factory=list)
    row_loads: list[tuple[bytes, int]] = field(default_factory=list)


class RemoteRow(bytes):
    """One full prompt block's KV rows pulled from a PD prefill instance (server/pd):
    loaded like a verified disk-tier block, counted apart."""


class BlockManager:
    """One pool of blocks (``block_ids``: their ids, default 0..num_blocks-1; an attention
    data parallel group's stripe of the engine's pool otherwise: kv/dp_blocks.py)."""

    num_groups = 1                    # dp groups a sequence may be placed in (dp_blocks.py)

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_cache: bool = False,
                 hash_next_token: bool = True, host: HostTier | None = None,
                 host_prefix: bool = False, disk: DiskTier | None = None,
                 block_ids: range | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        ids = range(num_blocks) if block_ids is None else block_ids
        if len(ids) != num_blocks:
            raise ValueError(f"{num_blocks} blocks but {len(ids)} block ids")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_cache = enable_prefix_cache
        self.hash_next_token = hash_next_token
        self.blocks = {i: Block(i) for i in ids}
        self._free_plain: deque[int] = deque(ids)
        self._free_cached: OrderedDict[int, None] = OrderedDict()   # LRU: oldest first
        self._cached: dict[BlockKey, int] = {}                      # key -> block id
        # Metrics: prompt tokens looked up / found in the prefix cache.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0                                    # found on the device
        self.host = host
        self.host_prefix = host is not None and host_prefix and enable_prefix_cache
        self.num_host_hits = 0                                      # found in the host tier
        self.disk = disk if self.host_prefix else None
        self.num_disk_hits = 0                                      # found on disk
        self.num_remote_hits = 0                                    # pulled from a PD prefill instance
        self.num_blocks_saved = 0                                   # device -> host copies
        self.num_blocks_loaded = 0                                  # host -> device copies
        self._transfers = Transfers()
        # PD: blocks derived from a peer's rows, purged on a role change (peer_blocks.py)
        self.peers = PeerBlocks(num_blocks + (host.num_blocks if host is not None else 0))

    # ---- figures --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached free blocks count: they are evictable)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_blocks_per_group(self) -> int:
        """The most blocks one sequence can ever hold (its dp group's pool)."""
        return self.num_blocks

    def num_free(self, group: int = 0) -> int:
        """Free blocks of dp group ``group`` (one pool: all of them)."""
        return self.num_free_blocks

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------
    def _keys(self, seq: Sequence, num_blocks: int) -> list[BlockKey]:
        """The keys of ``seq``'s first ``num_blocks`` full blocks.  Each is computed once per
        sequence (a SHA-256 per block: kvblock/key.py): its tokens only grow, so a block's
        key never changes, and a request waiting for room is matched again every step."""
        keys, toks, bs = seq.prefix_keys, seq.token_ids, self.block_size
        for b in range(len(keys), num_blocks):
            nxt = toks[(b + 1) * bs] if self.hash_next_token else None
            keys.append(block_key(keys[-1] if keys else None, toks[b * bs:(b + 1) * bs], nxt))
        return keys[:num_blocks]

    def match_prefix(self, seq: Sequence, group: int = 0) -> PrefixMatch:
        """Longest run of cached blocks for ``seq.token_ids``, leaving >= 1 token to compute
        (``group``: the dp group to look in; one pool has only group 0).

        After the device run and the tiers, a PD decode request's rows pulled from the
        prefill instance (``seq.remote_kv``, block by block) count as well: with or
        without the prefix cache."""
        if not self.enable_prefix_cache and not seq.remote_kv:
            return PrefixMatch([], [], 0)
        # Blocks b with (b+1)*bs <= n-1: the token after each exists and one token remains.
        num_full = (seq.num_tokens - 1) // self.block_size
        ids: list[int] = []
        hashes: list[BlockKey] = []
        free_hits = 0
        sources: list[int | bytes] = []
        for b, h in enumerate(self._keys(seq, num_full)):
            bid = self._cached.get(h) if not sources else None    # equal keys: equal tokens
            if bid is not None:
                ids.append(bid)
                free_hits += self.blocks[bid].ref_count == 0
            else:                          # the device run ended: the tiers may go on
                src = self.host.lookup(h) if self.host_prefix else None
                if src is None and self.disk is not None:
                    src = self.disk.read(h)            # verified, or None (a miss)
                if src is None and b < len(seq.remote_kv) and self.peers.rows_usable(seq):
                    src = seq.remote_kv[b]
                if src is None:
                    break
                sources.append(src)
            hashes.append(h)
        return PrefixMatch(ids, hashes, free_hits, tuple(sources))

    def register_computed(self, seq: Sequence) -> None:
        """Hash the blocks that became fully computed (call after each step)."""
        if not self.enable_prefix_cache:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens - 1) // self.block_size
        num_full = min(num_full, len(seq.block_table))
        if num_full <= seq.num_hashed_blocks:
            return
        new = self._keys(seq, num_full)[seq.num_hashed_blocks:]
        for b, h in enumerate(new, start=seq.num_hashed_blocks):
            block = self.blocks[seq.block_table[b]]
            if block.block_hash is None and h not in self._cached and \
                    self.peers.may_register(seq):
                block.block_hash = h
                self._cached[h] = block.block_id
                self.peers.tag(h, seq, self._holds)
        seq.block_hashes.extend(new)
        seq.num_hashed_blocks = num_full

    # ---- allocation -----------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def _take_free(self) -> int:
        if self._free_plain:
            bid = self._free_plain.popleft()
        else:
            bid, _ = self._free_cached.popitem(last=False)      # evict least recently freed
            block = self.blocks[bid]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.host_prefix:       # leaves the device pool: keep it in the host tier
                    slot = self.host.store(block.block_hash)
                    if slot is not None:   # (None: the tier holds it already, or is all swap)
                        self._save(bid, slot)
                        path = self.disk.plan_write(block.block_hash) \
                            if self.disk and block.block_hash not in self.peers else None
                        if path is not None:
                            self._transfers.disk_writes.append((slot, block.block_hash, path))
                else:
                    self.peers.forget(block.block_hash)
                block.block_hash = None
        self.blocks[bid].ref_count = 1
        return bid

    def _save(self, bid: int, slot: int) -> None:
        self._transfers.saves.append((bid, slot))
        self.num_blocks_saved += 1

    def _load(self, slot: int, bid: int) -> None:
        self._transfers.loads.append((slot, bid))
        self.num_blocks_loaded += 1

    def take_transfers(self) -> Transfers:
        """The copies queued since the last call (they go into this step's message)."""
        out, self._transfers = self._transfers, Transfers()
        if self.host is not None:
            self.host.end_step()
        if self.disk is not None:
            self.disk.end_step()
        return out

    def allocate(self, seq: Sequence, match: PrefixMatch, num_slots: int) -> None:
        """Give a waiting ``seq`` the matched prefix blocks plus fresh ones for ``num_slots``."""
        assert not seq.block_table, "allocate() is for sequences without blocks"
        for bid in match.block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self._free_cached[bid]
            block.ref_count += 1
        seq.block_table = list(match.block_ids)
        tier_hashes = match.hashes[match.num_device_blocks:]
        for h in tier_hashes if self.host is not None else ():
            self.host.touch(h)             # most recently used before any slot is taken
        num_disk = 0
        num_remote = 0
        for h, src in zip(tier_hashes, match.tier_sources):
            bid = self._take_free()
            block = self.blocks[bid]
            if self.enable_prefix_cache:
                block.block_hash = h       # findable at once: the load runs before any read
                self._cached[h] = bid
            if isinstance(src, bytes):
                self._transfers.row_loads.append((src, bid))
                num_remote += isinstance(src, RemoteRow)
                num_disk += not isinstance(src, RemoteRow)
            else:
                self._load(src, bid)
            seq.block_table.append(bid)
        self.peers.inherit(seq, match.hashes)         # PD: the peer rows its KV derives from
        if self.enable_prefix_cache:
            for h, src in zip(tier_hashes, match.tier_sources):
                if isinstance(src, RemoteRow):
                    self.peers.tag(h, seq, self._holds)
        seq.block_hashes = list(match.hashes)
        seq.num_hashed_blocks = match.num_blocks
        seq.num_computed_tokens = match.num_blocks * self.block_size
        if self.enable_prefix_cache:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += match.num_device_blocks * self.block_size
            self.num_host_hits += (len(tier_hashes) - num_disk - num_remote) * self.block_size
            self.num_disk_hits += num_disk * self.block_size
        self.num_remote_hits += num_remote * self.block_size
        self.append_slots(seq, num_slots)

    # ---- PD: blocks derived from a peer's rows ----------------------------------------
    def _holds(self, key: BlockKey) -> bool:
        return key in self._cached or (self.host is not None and self.host.holds(key))

    def purge_peer_blocks(self, epoch: int) -> None:
        """The PD role is now version ``epoch``: forget every cached block derived from rows
        a peer sent under an earlier one, on the device and in the host tier (never on
        disk: peer_blocks.py).  A block in use stays with its request, unfindable, and
        is freed with it."""
        for key in self.peers.purge(epoch):
            bid = self._cached.pop(key, None)
            if bid is not None:
                block = self.blocks[bid]
                block.block_hash = None
                if block.ref_count == 0:
                    del self._free_cached[bid]
                    self._free_plain.append(bid)
            if self.host is not None:
                self.host.drop(key)

    # ---- swap (preemption through the host tier) ----------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return self.host is not None and bool(seq.block_table) and \
            self.host.can_swap(len(seq.block_table))

    def swap_out(self, seq: Sequence) -> None:
        """Save every block of ``seq`` to swap slots and free them (caller checked room).

        Every block, not only the computed ones: with a step of ``seq`` in flight
        (asynchronous scheduling) that step writes past ``num_computed_tokens``, and the
        worker runs these saves after it."""
        slots = self.host.take_swap(len(seq.block_table))
        for bid, slot in zip(seq.block_table, slots):
            self._save(bid, slot)
        self.free(seq)
        seq.swap_slots = slots

    def swap_in(self, seq: Sequence, num_slots: int) -> None:
        """Give a swapped-out ``seq`` fresh blocks, load its saved ones into them and make
        its computed positions what they were (caller checked room)."""
        assert not seq.block_table and seq.swap_slots, "swap_in() is for swapped-out sequences"
        slots, seq.swap_slots = seq.swap_slots, []
        self.append_slots(seq, max(num_slots, len(slots) * self.block_size))
        for slot, bid in zip(slots, seq.block_table):
            self._load(slot, bid)
        self.host.release_swap(slots)      # read by this step's loads before any reuse
        seq.num_computed_tokens = seq.swap_num_computed
        self.register_computed(seq)

    def append_slots(self, seq: Sequence, num_slots: int) -> None:
        """Grow ``seq.block_table`` to cover positions ``0..num_slots-1``; caller checked room."""
        need = self.blocks_for(num_slots) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (and swap slots); hashed ones stay findable until evicted."""
        if seq.swap_slots:
            self.host.release_swap(seq.swap_slots)
            seq.swap_slots = []
        for bid in reversed(seq.block_table):       # tail first: evicted before the prefix
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._free_cached[bid] = None
                else:
                    self._free_plain.append(bid)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
