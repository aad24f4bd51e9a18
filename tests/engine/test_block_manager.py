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
