"""Attention data parallel (dp = 2, tp = 1, moe_ep = 2): each dp group attends for its own
requests over its own KV pool; the MoE and everything else run on every token.

The engines serve the same tokens as one process, greedy and seeded, MTP off, k=1 and
k=2, on the demo model and on a random checkpoint (asynchronous scheduling in one); each
group's pool holds only its own requests' blocks, twice one group's KV tokens for the
same npuMemSize; a prefix-cache hit stays in its group; a group with no request in a step
still joins the collectives.  The block bookkeeping is checked on its own, without ranks.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from server.engine.config import EngineConfig, EngineError, ParallelConfig
from server.engine.core import LLMEngine
from server.engine.kv.dp_blocks import DataParallelBlocks
from server.engine.messages import ModelRunnerOutput
from server.engine.protocol import FinishReason, SamplingParams
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence
from server.engine.batch.metadata import build_metadata
from server.model.parallel.data import sub_batch
from server.model.loading import CheckpointError, inspect_checkpoint, load_checkpoint
from server.model.parallel.plan import ParallelPlan
from server.testing.tiny_checkpoint import make_tiny_checkpoint
from tests.engine.helpers import free_port, prompts, requests, run_tokens
from tests.engine.test_parallel import BASE, DEMO, _requests, _single

# name: (world, dp, moe_tp, moe_ep)
LAYOUTS = {"dp2": (2, 2, 1, 2), "dp2-tp2": (4, 2, 1, 4)}
# The pool-size engines size their pool from a memory budget (npuMemSize) of this many
# float32 blocks of 8 tokens per rank.
BUDGET_BLOCKS = 200


def dp_config(layout: str = "dp2", **kw) -> ParallelConfig:
    world, dp, moe_tp, moe_ep = LAYOUTS[layout]
    return ParallelConfig(world_size=world, dp=dp, moe_tp=moe_tp, moe_ep=moe_ep,
                          master_port=free_port(), **kw)


def _dp_engine(path: str, cfg: EngineConfig, layout: str = "dp2") -> LLMEngine:
    return LLMEngine(inspect_checkpoint(path), dataclasses.replace(cfg, parallel=dp_config(layout)),
                     eos_token_ids=set())


def _served(path: str, k: int, layout: str = "dp2", **kw) -> dict[str, list[int]]:
    engine = _dp_engine(path, dataclasses.replace(BASE, num_speculative_tokens=k, **kw), layout)
    try:
        assert engine.runtime.dp == 2 and engine.runtime.decode_path == "eager"
        return run_tokens(engine, _requests(engine.runtime.vocab_size))
    finally:
        engine.shutdown()
        assert not any(p.is_alive() for p in engine.executor._procs), "a rank outlived shutdown"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("dp") / "tiny", seed=5))


# -- bookkeeping, no ranks ----------------------------------------------------------------
def _seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(max_tokens=8),
                    max_output_tokens=8, seed=0)


def test_groups_place_requests_and_keep_their_blocks_and_prefixes():
    """Requests go to the least loaded group; a prompt sharing a cached prefix goes to the
    group holding it, and only blocks of a sequence's group are ever in its table."""
    blocks = DataParallelBlocks(32, 4, 2, enable_prefix_cache=True, hash_next_token=False)
    sched = Scheduler(EngineConfig(block_size=4, max_queue_delay_us=0, max_seq_len=64),
                      blocks)
    first = _seq("a", list(range(2, 22)))
    for seq in (first, _seq("b", list(range(30, 40)))):
        sched.add(seq)
    sched.schedule()
    a, b = sched.requests["a"], sched.requests["b"]
    assert {a.dp_group, b.dp_group} == {0, 1}
    for seq in (a, b):
        assert seq.block_table and all(blk % 2 == seq.dp_group for blk in seq.block_table)
    a.num_computed_tokens = a.num_tokens                     # its prompt's blocks are computed
    blocks.register_computed(a)
    sched.finish(a, FinishReason.STOP)
    again = _seq("c", list(range(2, 18)) + [99, 98])         # 16 tokens of a's prefix
    sched.add(again)
    sched.schedule()
    c = sched.requests["c"]
    assert c.dp_group == first.dp_group and c.num_computed_tokens == 16
    assert blocks.num_prefix_hits == 16
    other = blocks.match_prefix(again, 1 - c.dp_group)
    assert other.num_blocks == 0                             # the other group has no such rows


def test_preemption_frees_blocks_of_the_group_that_needs_them():
    """Group 0 is full when its first sequence needs a block: its newest sequence is
    preempted, not the newest overall, which sits in group 1 and would free nothing there."""
    blocks = DataParallelBlocks(8, 4, 2)
    sched = Scheduler(EngineConfig(block_size=4, max_queue_delay_us=0, max_seq_len=64,
                                   max_preempt_count=3), blocks)
    for rid, n in (("a", 8), ("b", 8), ("c", 8), ("d", 3)):
        sched.add(_seq(rid, list(range(2, 2 + n))))
    first = sched.schedule()
    assert [sched.requests[r].dp_group for r in "abcd"] == [0, 1, 0, 1]
    ids = list(first.request_ids)
    sched.update(ModelRunnerOutput(first.step_id, ids, [[5]] * 4, [0] * 4, [0] * 4, [None] * 4))
    second = sched.schedule()                                  # a needs a third block in group 0
    assert second.preempted_request_ids == ("c",)
    assert sorted(r.request_id for r in second.cached_requests) == ["a", "b", "d"]


def test_sub_batch_picks_a_groups_sequences():
    meta = build_metadata([5, 0, 7], [2, 3, 1], [[7, 2], [4], [1, 3]], 4, torch.device("cpu"))
    assert meta.first_blocks_cpu == [7, 4, 1]
    sub, index = sub_batch(meta, [0, 2])                     # the odd blocks: group 1 of 2
    assert index.tolist() == [0, 1, 5]
    assert sub.query_start_loc.tolist() == [0, 2, 3] and sub.query_lens_cpu == [2, 1]
    assert sub.slot_mapping.tolist() == [9, 10, 3 * 4 + 3]   # positions 5, 6 and 7
    assert sub.block_tables.tolist() == [[7, 2], [1, 3]] and sub.seq_lens_cpu == [7, 8]


def test_dp_refuses_the_kv_tiers(tiny_path):
    cfg = dataclasses.replace(BASE, host_cache_blocks=16, parallel=dp_config())
    with pytest.raises(EngineError, match=r"dp 2 \(attention data parallel\) splits the KV pool "
                                          r"over its groups, and the host KV tier .* serve with dp 1"):
        LLMEngine(inspect_checkpoint(tiny_path), cfg, eos_token_ids=set())


# -- engines: dp=2 tp=1 moe_ep=2 against one process ---------------------------------------
@pytest.mark.slow
@pytest.mark.demo
@pytest.mark.parametrize("k", [0, 1, 2])
def test_demo_model_identical(k):
    assert _served(str(DEMO), k) == _single(str(DEMO), k)


@pytest.mark.slow
@pytest.mark.demo
def test_acceptance_is_the_one_processs_k2():
    """SGLang saw acceptance fall with DP attention on (reference: scale-facts.md); here
    every draft is the one process's, so the draft and acceptance counts are equal."""
    cfg = dataclasses.replace(BASE, num_speculative_tokens=2)
    model, _ = load_checkpoint(DEMO)
    reqs = _requests(model.config.vocab_size)
    one = LLMEngine(model.eval(), cfg, eos_token_ids=set())
    want = run_tokens(one, reqs)
    par = _dp_engine(str(DEMO), cfg)
    try:
        got, st = run_tokens(par, reqs), par.stats()
    finally:
        par.shutdown()
    ref = one.stats()
    assert got == want
    counts = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.accepted_per_position)
    assert counts == (ref.num_drafts, ref.num_draft_tokens, ref.num_accepted_tokens,
                      ref.accepted_per_position)
    print(f"\nk=2 acceptance, one process and dp=2: {st.num_accepted_tokens}/"
          f"{st.num_draft_tokens} ({st.num_accepted_tokens / st.num_draft_tokens:.3f})")


@pytest.mark.slow
def test_random_checkpoint_identical_k2_async(tiny_path):
    assert _served(tiny_path, 2, async_scheduling=True) == _single(tiny_path, 2)


@pytest.mark.slow
def test_two_groups_of_two_heads_halves_identical_k2(tiny_path):
    """dp=2 tp=2 moe_ep=4 (4 ranks): each group's attention cut by heads over its two
    ranks; the one all-reduce that gathers the groups' rows sums the heads too."""
    assert _served(tiny_path, 2, "dp2-tp2") == _single(tiny_path, 2)


@pytest.mark.slow
def test_recompute_preemption_in_small_groups_identical_k1(tiny_path):
    """32 blocks (16 a group) for 8 requests that need up to 8 each: sequences are
    preempted and recomputed, in their group or another, and the tokens do not change."""
    cfg = dataclasses.replace(BASE, num_speculative_tokens=1, num_blocks=32, max_preempt_count=4)
    model, _ = load_checkpoint(tiny_path)
    want = run_tokens(LLMEngine(model.eval(), cfg, eos_token_ids=set()), _requests(512))
    par = _dp_engine(tiny_path, cfg)
    try:
        got, preemptions = run_tokens(par, _requests(512)), par.stats().num_preemptions
    finally:
        par.shutdown()
    assert got == want and preemptions > 0


@pytest.mark.slow
def test_int8_random_checkpoint_identical_k1(tmp_path, tiny_path):
    """W8A8 with W4A8 experts: attention whole per rank (tp 1) in int8, int8 experts whole
    over moe_ep 2, the dense layers' int8 down projections summing over all ranks."""
    from training import quantize
    out = tmp_path / "tiny-w4a8"
    assert quantize.main([tiny_path, str(out), "--calib-samples", "8", "--w4a8-experts"]) == 0
    assert _served(str(out), 1) == _single(str(out), 1)
    with pytest.raises(CheckpointError, match=r"an int8 attention layer cut over tp 2 ranks "
                                              r"with dp 2 .*serve int8 attention with dp and tp 1"):
        load_checkpoint(str(out), plan=ParallelPlan(4, 1, 4, dp=2, rank=0))


def _long_batches(vocab: int) -> list[list]:
    """Prompts of 33-95 tokens, greedy and seeded; then prompts sharing the first's
    64-token prefix (prefix-cache hits in the group that holds it)."""
    ps = prompts(3, seed=7, lo=33, hi=96, vocab=vocab - 8)
    shared = [ps[0][:64] + t for t in prompts(2, seed=8, lo=5, hi=30, vocab=vocab - 8)]
    def both(batch, name):
        return (requests(batch, SamplingParams(max_tokens=16, temperature=0.0), f"{name}g")
                + requests(batch, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95,
                                                 seed=5), f"{name}s"))
    return [both(ps, "a"), both(shared, "b")]


def _serve_watching_groups(engine: LLMEngine, reqs: list) -> tuple[dict, list[set[int]]]:
    """Run ``reqs``; each step, the groups of the running sequences (and check that every
    sequence's blocks are its group's)."""
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    groups = []
    while engine.has_unfinished():
        running = engine.scheduler.running
        for seq in running:
            assert all(b % 2 == seq.dp_group for b in seq.block_table), seq.block_table
        groups.append({seq.dp_group for seq in running})
        for o in engine.step():
            outs[o.request_id].extend(o.token_ids)
    return outs, groups


@pytest.mark.slow
def test_each_group_holds_its_own_requests_with_twice_the_kv(tiny_path):
    """Random checkpoint, k=1, the pool sized by the same npuMemSize per rank as one
    process: tokens are one process's, every request's blocks are in its group, both
    groups serve, the prefix cache hits as often, and the pool holds ~2x the blocks."""
    model, _ = load_checkpoint(tiny_path)
    mem_gb = BUDGET_BLOCKS * model.num_kv_layers * 8 * model.kv_cache_dim * 4 / 2**30
    cfg = dataclasses.replace(BASE, num_speculative_tokens=1, enable_prefix_cache=True,
                              num_blocks=None, mem_size_gb=mem_gb)
    one = LLMEngine(model.eval(), cfg, eos_token_ids=set())
    want = {}
    for batch in _long_batches(512):
        want.update(run_tokens(one, batch))
    par = _dp_engine(tiny_path, cfg)
    try:
        got, seen = {}, []
        for batch in _long_batches(512):
            outs, groups = _serve_watching_groups(par, batch)
            got.update(outs)
            seen += groups
        info, stats, rt = par.executor.info, par.stats(), par.runtime.to_dict()
    finally:
        par.shutdown()
    assert got == want
    assert {0, 1} in seen                                    # both groups served at once
    assert stats.prefix_cache_hits == one.stats().prefix_cache_hits >= 2 * 64
    single = one.runtime.num_kv_blocks
    assert (info.dp, info.kv_blocks_per_rank * 2) == (2, info.num_kv_blocks)
    assert info.num_kv_blocks >= 1.9 * single, (info.num_kv_blocks, single)
    assert rt["parallel"]["dp"] == 2 and rt["parallel"]["tp"] == 1
    print(f"\nnpuMemSize {mem_gb:.2e} GiB: one process {single * 8} KV tokens, dp=2 "
          f"{info.num_kv_blocks * 8} ({info.num_kv_blocks / single:.2f}x)")


@pytest.mark.slow
@pytest.mark.demo
def test_an_idle_group_still_joins_the_collectives():
    """A lone request, then one that ends early beside a long one: steps where one group
    has no request complete, and the tokens are one process's."""
    ps = prompts(2, seed=4, vocab=2040)
    reqs = [requests([ps[0]], SamplingParams(max_tokens=12, temperature=0.0), "lone")[0],
            *requests(ps, [SamplingParams(max_tokens=3, temperature=0.0),
                           SamplingParams(max_tokens=16, temperature=0.8, seed=3)], "pair")]
    cfg = dataclasses.replace(BASE, num_speculative_tokens=2)
    model, _ = load_checkpoint(DEMO)
    one = LLMEngine(model.eval(), cfg, eos_token_ids=set())
    want = {**run_tokens(one, reqs[:1]), **run_tokens(one, reqs[1:])}
    par = _dp_engine(str(DEMO), cfg)
    try:
        lone, seen = _serve_watching_groups(par, reqs[:1])
        pair, seen_pair = _serve_watching_groups(par, reqs[1:])
    finally:
        par.shutdown()
    assert {**lone, **pair} == want
    assert all(len(g) <= 1 for g in seen) and {0, 1} in seen_pair
    assert any(len(g) == 1 for g in seen_pair[seen_pair.index({0, 1}):])
