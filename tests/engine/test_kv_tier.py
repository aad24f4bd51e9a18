"""The host KV tier: prefix blocks evicted from the device pool come back from host memory,
preempted requests swap out and back in; outputs are unchanged (MTP off, k=1, k=2)."""
from __future__ import annotations

import pytest
import torch

from server.kvblock.file import HEADER_BYTES, file_name, read_block, write_block
from server.kvblock.key import BlockKey, block_key, digest_of
from server.engine.kv.block_manager import BlockManager
from server.engine.kv.transfer.host_pool import HostKVPool
from server.engine.kv.host_tier import HostTier
from server.engine.protocol import SamplingParams
from server.engine.sequence import Sequence
from server.model.layers.latent_cache import Int8LatentCache, LatentCache
from tests.engine.helpers import make_engine, prompts, requests, run_tokens, tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


# ---- bookkeeping (no torch) ---------------------------------------------------------

def test_host_tier_is_lru_and_swap_slots_are_never_evicted():
    tier = HostTier(3)
    assert [tier.store(h) for h in (10, 11, 12)] == [0, 1, 2]
    assert tier.store(13) is None and not tier.can_swap(1)   # every slot written this step
    assert tier.lookup(10) is None                   # its rows land with this step's copies
    tier.end_step()
    assert tier.lookup(10) == 0
    assert tier.store(11) is None                    # held already: no copy, now most recent
    tier.touch(10)                                   # LRU order: 12, 11, 10
    slots = tier.take_swap(1)                        # evicts the least recently used: 12
    assert tier.lookup(12) is None and slots == [2] and tier.num_evicted == 1
    assert not tier.can_swap(3) and tier.can_swap(2)
    tier.end_step()
    assert tier.store(13) == 1 and tier.lookup(11) is None    # 11 was next in line
    tier.release_swap(slots)
    assert tier.usage() == 2 / 3 and tier.num_swap_slots == 0


def _seq(tokens: list[int], rid: str = "s") -> Sequence:
    return Sequence(rid, tokens, len(tokens), GREEDY, max_output_tokens=4, seed=0)


def test_evicted_block_is_saved_and_a_later_match_loads_it():
    bm = BlockManager(4, 4, enable_prefix_cache=True, host=HostTier(8), host_prefix=True)
    a = _seq(list(range(1, 11)))                      # 10 tokens: blocks 0, 1 full, 2 partial
    bm.allocate(a, bm.match_prefix(a), 10)
    a.num_computed_tokens = 10
    bm.register_computed(a)
    hashes, a_blocks = list(a.block_hashes), a.block_table[:2]
    bm.free(a)
    assert bm.take_transfers().saves == []           # nothing left the device yet
    b = _seq(list(range(50, 66)), "b")               # takes all 4 blocks: evicts a's two
    bm.allocate(b, bm.match_prefix(b), 16)
    saves = bm.take_transfers().saves
    assert sorted(s for _, s in saves) == [0, 1] and len(saves) == 2
    bm.free(b)
    again = _seq(list(range(1, 11)), "a2")
    match = bm.match_prefix(again)
    assert (match.num_device_blocks, match.num_blocks) == (0, 2)
    bm.allocate(again, match, 10)
    loads = bm.take_transfers().loads
    slot_of = dict(saves)                            # device block -> the slot it went to
    assert [s for s, _ in loads] == [slot_of[b] for b in a_blocks]
    assert [bid for _, bid in loads] == again.block_table[:2]
    assert again.num_computed_tokens == 8 and again.block_hashes == hashes
    assert bm.num_host_hits == 8 and bm.num_prefix_hits == 0


def test_a_block_saved_this_step_is_not_loaded_back_in_the_same_step():
    """The host slot a block is saved into holds its rows only after the step's copies,
    which read every loaded slot before writing saved ones: a match in the same step
    must not load it (it would get the slot's old rows)."""
    bm = BlockManager(4, 4, enable_prefix_cache=True, host=HostTier(8), host_prefix=True)
    a = _seq(list(range(1, 11)))                      # blocks 0, 1 hashed; 2 partial
    bm.allocate(a, bm.match_prefix(a), 10)
    a.num_computed_tokens = 10
    bm.register_computed(a)
    bm.free(a)
    bm.take_transfers()
    b = _seq(list(range(50, 61)), "b")               # 3 blocks: evicts a's block 1
    bm.allocate(b, bm.match_prefix(b), 11)
    again = _seq(list(range(1, 11)), "a2")
    assert bm.match_prefix(again).num_blocks == 1    # block 1's save is in this step
    assert len(bm.take_transfers().saves) == 1
    assert bm.match_prefix(again).num_blocks == 2    # the next step may load it


# ---- the copies (torch) -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["float", "int8"])
def test_blocks_move_whole_and_same_step_reuse_is_ordered(kind):
    g = torch.Generator().manual_seed(0)
    if kind == "float":
        caches = [LatentCache(torch.randn(6, 4, 8, generator=g)) for _ in range(3)]
    else:
        caches = [Int8LatentCache(6, 4, 6, 2, torch.bfloat16, "cpu") for _ in range(3)]
        for c in caches:
            c.write(torch.arange(24), torch.randn(24, 8, generator=g))
    pool = HostKVPool(caches, 4, torch.device("cpu"))
    before = [[t.clone() for t in c.block_tensors()] for c in caches]
    pool.apply([(1, 0), (2, 1)], [])                 # save blocks 1, 2
    # one step: save block 3 into slot 0 (reusing it) while loading slot 0 into block 3
    pool.apply([(3, 0)], [(0, 3), (1, 5)])
    for c, old in zip(caches, before):
        for t, o in zip(c.block_tensors(), old):
            assert torch.equal(t[3], o[1]) and torch.equal(t[5], o[2])
    pool.apply([], [(0, 4)])                         # slot 0 now holds the old block 3
    for c, old in zip(caches, before):
        for t, o in zip(c.block_tensors(), old):
            assert torch.equal(t[4], o[3])


# ---- the engine ---------------------------------------------------------------------

def _prefix_workload(n: int = 6, length: int = 40, rounds: int = 3):
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(2, 500, (length,), generator=g).tolist() for _ in range(n)]
    return [[(f"r{r}-{i}", p + [7, 8, r]) for i, p in enumerate(prefixes)] for r in range(rounds)]


def _run_prefix_workload(k: int, **tier):
    # 6 prefixes of 5 full blocks each = 30 blocks, the device pool has 24, so with LRU
    # every prefix is evicted before it comes round again.
    engine = make_engine(tiny_model(), k=k, num_blocks=24, block_size=8, max_batch_size=2,
                         enable_prefix_cache=True, **tier)
    outs, first = {}, None
    for r, batch in enumerate(_prefix_workload()):
        for rid, p in batch:
            outs.update(run_tokens(engine, requests([p], GREEDY, prefix=rid)))
        if r == 0:
            first = engine.stats()
    st = engine.stats()
    later_queries = st.prefix_cache_queries - first.prefix_cache_queries
    later_hits = (st.prefix_cache_hits + st.host_cache_hits
                  - first.prefix_cache_hits - first.host_cache_hits)
    return outs, later_hits / later_queries, st


@pytest.mark.parametrize("k", [0, 1, 2])
def test_host_tier_turns_evicted_prefixes_into_hits_with_identical_outputs(k):
    plain, rate_off, st_off = _run_prefix_workload(k)
    tiered, rate_on, st_on = _run_prefix_workload(k, host_cache_blocks=64, host_cache_prefix=True)
    assert tiered == plain
    assert rate_off < 0.2 and rate_on > 0.85, (rate_off, rate_on)
    assert st_off.host_cache_hits == 0 and st_on.host_cache_hits > 0
    assert st_on.kv_blocks_loaded * 8 == st_on.host_cache_hits
    assert st_on.kv_bytes_loaded == st_on.kv_blocks_loaded * (st_on.kv_bytes_saved // st_on.kv_blocks_saved)
    assert st_on.num_prompt_tokens < st_off.num_prompt_tokens


def test_host_tier_with_int8_kv_cache_is_exact_too():
    plain, _, _ = _run_prefix_workload(1, kv_cache_dtype="int8")
    tiered, rate, st = _run_prefix_workload(1, kv_cache_dtype="int8", host_cache_blocks=64,
                                            host_cache_prefix=True)
    assert tiered == plain and rate > 0.85 and st.host_cache_hits > 0


def test_full_host_tier_evicts_lru_and_stays_correct():
    plain, _, _ = _run_prefix_workload(1)
    tiered, rate, st = _run_prefix_workload(1, host_cache_blocks=12, host_cache_prefix=True)
    assert tiered == plain and st.host_blocks_used == 12 and st.host_usage == 1.0


# ---- swap-based preemption ----------------------------------------------------------

SEEDED = SamplingParams(max_tokens=40, temperature=0.8, ignore_eos=True, seed=3)


@pytest.mark.parametrize("k,async_on", [(0, False), (1, True), (2, False), (2, True)])
def test_preempted_requests_swap_and_resume_without_recompute(k, async_on):
    model, ps = tiny_model(), prompts(6, seed=2, lo=10, hi=30)
    kw = dict(async_scheduling=async_on, async_executor="thread")
    ref = run_tokens(make_engine(model, k=k, num_blocks=512, **kw), requests(ps, SEEDED))
    engine = make_engine(model, k=k, num_blocks=22, max_batch_size=6, max_preempt_count=100,
                         host_cache_blocks=200, swap_preemption=True, **kw)
    assert run_tokens(engine, requests(ps, SEEDED)) == ref
    st = engine.stats()
    assert st.num_preemptions > 0 and st.num_swapped_out == st.num_preemptions
    assert st.num_swapped_in == st.num_swapped_out and st.num_preemptions_recomputed == 0
    # Resumes feed only the tokens after the restored KV: the prompts plus ~1 per resume.
    assert st.num_prompt_tokens <= sum(map(len, ps)) + st.num_swapped_in * (1 + k)
    assert st.host_blocks_used == 0 and st.num_requests_swapped == 0    # all slots back


def test_swap_falls_back_to_recompute_when_the_tier_is_full():
    model, ps = tiny_model(), prompts(6, seed=2, lo=10, hi=30)
    ref = run_tokens(make_engine(model, k=1, num_blocks=512), requests(ps, SEEDED))
    engine = make_engine(model, k=1, num_blocks=22, max_batch_size=6, max_preempt_count=100,
                         host_cache_blocks=2, swap_preemption=True)
    assert run_tokens(engine, requests(ps, SEEDED)) == ref
    st = engine.stats()
    assert st.num_preemptions_recomputed > 0
    assert st.num_swapped_out + st.num_preemptions_recomputed == st.num_preemptions


def test_swap_through_the_worker_process():
    """Async scheduling on a CPU runs the worker in its own process: the copies travel in
    the pickled step messages, in step order."""
    model, ps = tiny_model(), prompts(5, seed=4, lo=10, hi=30)
    ref = run_tokens(make_engine(model, k=1, num_blocks=512), requests(ps, SEEDED))
    engine = make_engine(model, k=1, num_blocks=20, max_batch_size=5, max_preempt_count=100,
                         host_cache_blocks=200, swap_preemption=True, async_scheduling=True,
                         async_executor="process")
    try:
        assert run_tokens(engine, requests(ps, SEEDED)) == ref
        st = engine.stats()
        assert st.num_swapped_out > 0 and st.num_preemptions_recomputed == 0
    finally:
        engine.shutdown()


# ---- the disk tier ------------------------------------------------------------------

def _disk_engine(folder, **kw):
    return make_engine(tiny_model(), k=1, num_blocks=24, block_size=8, max_batch_size=2,
                       enable_prefix_cache=True, host_cache_blocks=64, host_cache_prefix=True,
                       disk_cache_dir=str(folder), disk_cache_gb=0.01, **kw)


def _one_round(engine) -> dict:
    out = {}
    for rid, p in _prefix_workload(rounds=1)[0]:
        out.update(run_tokens(engine, requests([p], GREEDY, prefix=rid)))
    return out


def test_disk_tier_survives_a_restart_and_never_serves_a_damaged_file(tmp_path):
    first = _disk_engine(tmp_path)
    ref = _one_round(first)
    written = first.stats()
    assert written.disk_blocks_used > 0 and written.disk_bytes_written > 0
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]       # named by the fingerprint
    files = sorted(folder.glob("*.kvb"))
    assert len(files) == written.disk_blocks_used

    restarted = _disk_engine(tmp_path)                  # a new engine: empty device and host
    assert _one_round(restarted) == ref
    st = restarted.stats()
    assert st.disk_cache_hits > 0 and st.disk_corrupt_files == 0
    assert st.disk_bytes_read == st.disk_cache_hits // 8 * written.kv_bytes_saved // written.kv_blocks_saved

    flipped, cut = files[0], files[1]
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0x40                                    # a payload bit: the digest catches it
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-10])             # truncated: caught by its length
    third = _disk_engine(tmp_path)
    assert _one_round(third) == ref                     # recomputed where a file was damaged
    st = third.stats()
    assert st.disk_corrupt_files == 2 and st.disk_cache_hits > 0
    block_bytes = written.kv_bytes_saved // written.kv_blocks_saved
    for f in (flipped, cut):          # removed, or written again whole once recomputed
        assert not f.exists() or read_block(f, _key_in(f), block_bytes) is not None


def _key_in(path) -> BlockKey:
    """The key a block file claims to hold (its content field, kvblock/file.py)."""
    data = path.read_bytes()
    n = int.from_bytes(data[40:48], "little")
    content = data[HEADER_BYTES:HEADER_BYTES + n]
    return BlockKey(digest_of(content), content)


def test_disk_files_of_another_layout_are_not_read(tmp_path):
    ref = _one_round(_disk_engine(tmp_path))
    other = _disk_engine(tmp_path, kv_cache_dtype="int8")   # other bytes per block: own folder
    _one_round(other)
    assert other.stats().disk_cache_hits == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2
    assert _one_round(_disk_engine(tmp_path)) == ref


def test_kv_file_round_trip_and_every_kind_of_damage(tmp_path):
    key, other = block_key(None, [1, 2, 3, 4], 5), block_key(None, [1, 2, 3, 4], 6)
    path = tmp_path / file_name(key)
    assert path.name == key.digest.hex() + ".kvb"
    write_block(path, key, b"x" * 64)
    assert read_block(path, key, 64) == b"x" * 64
    assert [p.name for p in tmp_path.iterdir()] == [path.name]      # no temporary left
    assert read_block(path, other, 64) is None                      # another block's file
    assert read_block(path, key, 63) is None                        # another layout
    data = path.read_bytes()
    path.write_bytes(data[:-1] + b"y")
    assert read_block(path, key, 64) is None                        # payload changed
    path.write_bytes(data[:40])
    assert read_block(path, key, 64) is None                        # truncated
    path.write_bytes(b"MTPKVB01" + data[8:])
    assert read_block(path, key, 64) is None                        # the format before
    assert read_block(tmp_path / "missing.kvb", key, 64) is None


def test_a_failing_disk_write_is_a_later_miss_not_an_engine_error(tmp_path, monkeypatch):
    import server.engine.kv.transfer.host_pool as host_pool

    def full_disk(path, block_hash, payload):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(host_pool, "write_block", full_disk)
    engine = _disk_engine(tmp_path)
    ref = _one_round(engine)                            # no step fails
    assert engine.stats().disk_blocks_used > 0          # planned, never written
    monkeypatch.undo()
    again = _disk_engine(tmp_path)                      # finds no file: every block a miss
    assert _one_round(again) == ref
    st = again.stats()
    assert st.disk_cache_hits == 0 and st.disk_corrupt_files == 0


@pytest.mark.parametrize("async_on", [False, True])
def test_swap_and_prefix_tier_together_on_shared_prefixes(async_on):
    """One host tier for both uses: swapped requests own their slots, evicted prefix
    blocks fill the rest; requests share a 24-token prefix (3 blocks) under pressure."""
    model = tiny_model()
    shared = prompts(1, seed=8, lo=24, hi=25)[0]
    ps = [shared + tail for tail in prompts(6, seed=9, lo=4, hi=20)]
    kw = dict(async_scheduling=async_on, async_executor="thread", enable_prefix_cache=True)
    ref = run_tokens(make_engine(model, k=2, num_blocks=512, **kw), requests(ps, SEEDED))
    engine = make_engine(model, k=2, num_blocks=24, max_batch_size=6, max_preempt_count=100,
                         host_cache_blocks=40, swap_preemption=True, host_cache_prefix=True, **kw)
    assert run_tokens(engine, requests(ps, SEEDED)) == ref
    st = engine.stats()
    assert st.num_swapped_out > 0 and st.num_swapped_in == st.num_swapped_out
    assert st.prefix_cache_hits > 0
    assert st.num_requests_swapped == 0 and st.host_blocks_used == st.host_blocks_cached


def test_swapped_requests_and_tier_usage_show_while_they_wait():
    model, ps = tiny_model(), prompts(6, seed=2, lo=10, hi=30)
    engine = make_engine(model, k=1, num_blocks=22, max_batch_size=6, max_preempt_count=100,
                         host_cache_blocks=200, swap_preemption=True)
    for r in requests(ps, SEEDED):
        engine.add_request(r)
    seen = []
    while engine.has_unfinished():
        engine.step()
        st = engine.stats()
        seen.append((st.num_requests_swapped, st.host_blocks_used, st.num_waiting))
    assert max(s for s, _, _ in seen) > 0
    assert all(used > 0 and waiting >= swapped for swapped, used, waiting in seen if swapped)
    assert seen[-1][:2] == (0, 0)


@pytest.mark.parametrize("host_blocks", [1, 3])
def test_a_step_evicting_more_blocks_than_host_slots_never_mixes_blocks(tmp_path, host_blocks):
    """A host tier of a few slots under a disk tier, six prompts admitted per step: one
    step evicts more blocks than the tier has slots.  Every block's file holds its own
    rows, so the outputs equal an engine without tiers, in the run and after a restart (a
    new engine on the same folder).  Before the fix, two saves shared a slot and the disk
    files of the earlier blocks held the later block's rows under a valid digest."""
    ref_engine = make_engine(tiny_model(), k=1, num_blocks=24, block_size=8, max_batch_size=6)
    rounds = _prefix_workload()
    plain = [run_tokens(ref_engine, [r for rid, p in batch for r in requests([p], GREEDY, prefix=rid)])
             for batch in rounds]

    def run_rounds():
        engine = make_engine(tiny_model(), k=1, num_blocks=24, block_size=8, max_batch_size=6,
                             enable_prefix_cache=True, host_cache_blocks=host_blocks,
                             host_cache_prefix=True, disk_cache_dir=str(tmp_path),
                             disk_cache_gb=0.01, adaptive_speculation=False)   # k by time: not repeatable
        outs = [run_tokens(engine, [r for rid, p in batch
                                    for r in requests([p], GREEDY, prefix=rid)])
                for batch in rounds]
        return outs, engine.stats()

    got, st = run_rounds()
    assert got == plain
    assert st.host_saves_skipped > 0 and st.disk_corrupt_files == 0   # the tier was too small
    again, st2 = run_rounds()                         # restarted: device and host empty
    assert again == plain
    if host_blocks == 3:                              # this workload reads files back
        assert st.disk_cache_hits > 0 and st2.disk_cache_hits > 0


def test_a_directory_in_place_of_a_block_file_is_a_miss_at_start_and_at_run_time(tmp_path):
    first = _disk_engine(tmp_path)
    ref = _one_round(first)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    files = sorted(folder.glob("*.kvb"))
    for f in files[:2]:                                 # swapped for directories under a live engine
        f.unlink()
        f.mkdir()
    assert _one_round(first) == ref                     # no step fails
    assert first.stats().num_requests_failed == 0
    restarted = _disk_engine(tmp_path)                  # start-up scans them: not fatal
    assert _one_round(restarted) == ref
    st = restarted.stats()
    assert st.num_requests_failed == 0 and st.disk_cache_hits > 0


@pytest.mark.parametrize("kind", ["fifo", "link_to_big_file", "big_file"])
def test_a_fifo_or_link_in_place_of_a_block_file_is_a_miss_without_a_wait(tmp_path, kind):
    """Reads while serving open only a regular file of a block file's size, never through
    a link: a FIFO hung the engine for good (the read waited for a writer), a link to a
    large file allocated its size on every read.  Now each is a logged, counted miss."""
    import os
    import threading
    import tracemalloc
    from server.engine.kv.disk_tier import DiskTier
    disk = DiskTier(tmp_path / "tier", 8, 64, 4)
    key = block_key(None, [1, 2, 3, 4], 5)
    path = disk.plan_write(key)
    write_block(path, key, b"x" * 64)
    disk.end_step()
    os.unlink(path)
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(256 << 20)                           # sparse: no disk used
    {"fifo": lambda: os.mkfifo(path), "link_to_big_file": lambda: os.symlink(big, path),
     "big_file": lambda: os.replace(big, path)}[kind]()
    got: list = []
    tracemalloc.start()
    reader = threading.Thread(target=lambda: got.append(disk.read(key)), daemon=True)
    reader.start()
    reader.join(5)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    if reader.is_alive():                               # (the old code) let it go
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert got == [None], "the read waited on the entry"
    assert peak < 1 << 20 and disk.num_corrupt == 1 and not os.path.lexists(path)
    assert disk.read(key) is None                       # gone from the index: a plain miss
