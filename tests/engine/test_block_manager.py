"""Block pool bookkeeping: allocation, freeing, prefix cache keyed with the next token."""
from server.engine.kv.block_manager import BlockManager
from server.engine.protocol import SamplingParams
from server.engine.sequence import Sequence


def seq(tokens: list[int], rid: str = "s") -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(), max_output_tokens=16, seed=0)


def computed(bm: BlockManager, s: Sequence) -> None:
    """Pretend the sequence ran: allocate, mark all but the last token computed, register."""
    bm.allocate(s, bm.match_prefix(s), s.num_tokens)
    s.num_computed_tokens = s.num_tokens - 1
    bm.register_computed(s)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(10, 4)
    a, b = seq(range(9), "a"), seq(range(5), "b")
    bm.allocate(a, bm.match_prefix(a), 9)
    bm.allocate(b, bm.match_prefix(b), 5)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_free_blocks == 5 and not set(a.block_table) & set(b.block_table)
    bm.append_slots(a, 13)
    assert len(a.block_table) == 4
    bm.free(a), bm.free(b)
    assert bm.num_free_blocks == 10 and bm.usage() == 0.0


def test_prefix_hit_requires_the_token_after_the_block():
    """With MTP the last slot of a block depends on the next token: it is part of the key."""
    bm = BlockManager(16, 4, enable_prefix_cache=True, hash_next_token=True)
    first = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "a")
    computed(bm, first)                       # blocks 0 and 1 full and computed (9 computed)
    bm.free(first)
    same_next = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 99], "b")
    m = bm.match_prefix(same_next)
    assert m.num_blocks == 2                  # token 8 (after block 1) is 9 in both
    other_next = seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 99], "c")
    assert bm.match_prefix(other_next).num_blocks == 1   # block 1 would have stale MTP KV
    bm.allocate(same_next, m, same_next.num_tokens)
    assert same_next.num_computed_tokens == 8
    assert same_next.block_table[:2] == [first_id for first_id in m.block_ids]


def test_prefix_hit_without_next_token_when_mtp_off():
    bm = BlockManager(16, 4, enable_prefix_cache=True, hash_next_token=False)
    computed(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    assert bm.match_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 42], "b")).num_blocks == 2


def test_match_always_leaves_one_token_to_compute():
    bm = BlockManager(16, 4, enable_prefix_cache=True, hash_next_token=False)
    computed(bm, seq(list(range(13)), "a"))
    assert bm.match_prefix(seq(list(range(8)), "b")).num_blocks == 1   # not 2: token 7 must run


def test_shared_blocks_are_ref_counted_and_evicted_lru():
    bm = BlockManager(4, 2, enable_prefix_cache=True, hash_next_token=False)
    a = seq([1, 2, 3, 4, 5], "a")
    computed(bm, a)                           # 3 blocks, 2 hashed
    b = seq([1, 2, 3, 4, 7], "b")
    m = bm.match_prefix(b)
    assert m.num_blocks == 2 and m.num_free_hits == 0
    bm.allocate(b, m, 5)
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.num_free_blocks == 0
    bm.free(a)
    assert bm.num_free_blocks == 1            # a's private tail block only
    bm.free(b)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    # Fresh allocations take plain free blocks before evicting cached ones.
    c = seq([9, 9, 9], "c")
    bm.allocate(c, bm.match_prefix(c), 4)
    assert bm.num_cached_blocks == 2
    d = seq([8, 8, 8, 8, 8], "d")
    bm.allocate(d, bm.match_prefix(d), 2)     # needs one more block: evicts a cached one
    assert bm.num_cached_blocks == 1


# ---- keys: SHA-256 chains, and a hit compares the tokens (issue 58) ------------------

def test_block_keys_are_sha256_over_parent_next_token_and_tokens():
    import hashlib
    import struct
    bm = BlockManager(16, 4, enable_prefix_cache=True, hash_next_token=True)
    s = seq(range(1, 11))
    computed(bm, s)
    k0, k1 = s.block_hashes
    tag = b"mtp-serve prefix block key v1\0"
    c0 = bytes(32) + struct.pack("<q4q", 5, 1, 2, 3, 4)            # root parent, next token 5
    c1 = k0.digest + struct.pack("<q4q", 9, 5, 6, 7, 8)
    assert (k0.content, k1.content) == (c0, c1)
    assert k0.digest == hashlib.sha256(tag + c0).digest()
    assert k1.digest == hashlib.sha256(tag + c1).digest()


def test_a_digest_collision_is_no_hit_anywhere_the_tokens_are_compared(monkeypatch, tmp_path):
    """Every block's digest made equal (what a forged or colliding key would be): a
    different prompt gets no block from the device cache, the host tier or the disk tier,
    while the same prompt still hits.  Before, a hit was taken on the 64-bit hash alone."""
    import server.kvblock.key as block_key
    from server.kvblock.file import write_block
    from server.engine.kv.disk_tier import DiskTier
    from server.engine.kv.host_tier import HostTier
    monkeypatch.setattr(block_key, "digest_of", lambda content: bytes(32))
    bm = BlockManager(4, 4, enable_prefix_cache=True, host=HostTier(8), host_prefix=True)
    a = seq(range(1, 11), "a")
    computed(bm, a)                                  # 2 full blocks cached on the device
    bm.free(a)
    other = seq(range(101, 111), "o")
    assert bm.match_prefix(other).num_blocks == 0    # same digests, other tokens: a miss
    assert bm.match_prefix(seq(range(1, 11), "a2")).num_device_blocks == 2
    filler = seq(range(50, 66), "f")                 # takes every block: a's go to the host tier
    bm.allocate(filler, bm.match_prefix(filler), 16)
    assert len(bm.take_transfers().saves) == 2
    bm.free(filler)
    assert bm.match_prefix(seq(range(101, 111), "o2")).num_blocks == 0
    assert bm.match_prefix(seq(range(1, 11), "a3")).num_blocks == 2    # from the host tier
    disk = DiskTier(tmp_path, 8, 64, 4)
    key, forged = (block_key.block_key(None, t, 5) for t in ([1, 2, 3, 4], [101, 102, 103, 104]))
    write_block(disk.plan_write(key), key, b"x" * 64)
    disk.end_step()
    assert forged.digest == key.digest and disk.read(forged) is None and disk.num_corrupt == 1
