"""Sequence parallel (sp = tp = 2): the latent KV striped over the ranks by block.

The engines serve the same tokens as one process, greedy and seeded, MTP off and k=1
(the only k MindIE allows with sp), on the demo model and on a random checkpoint, with
prompts spanning several blocks on both ranks (block_size 8) and prefix-cache hits; the
pool holds ~2x the tokens for the same memory per rank.  The merge of partial
attentions is checked on its own, and so is what a striped pool refuses.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from server.engine.config import EngineError
from server.engine.core import LLMEngine
from server.engine.kv.cache import rank_blocks
from server.engine.protocol import SamplingParams
from server.model.layers.latent_cache import Int8LatentCache, LatentCache
from server.model.loading import inspect_checkpoint, load_checkpoint
from server.model.parallel.sequence import StripedLatentCache, StripeIndex, merge_partials, partial_attention
from server.model.static_decode import supports_static_decode
from server.testing.tiny_checkpoint import make_tiny_checkpoint
from tests.engine.helpers import prompts, requests, run_tokens
from tests.engine.test_parallel import BASE, DEMO, _parallel, _single, parallel_config

# The long-prompt engines size their pool from a memory budget (npuMemSize) of this many
# float32 blocks of 8 tokens: below what 8 sequences of 512 tokens could use, so it binds.
BUDGET_BLOCKS = 200


# -- the merge and the striped cache, no ranks -----------------------------------------
def test_partial_attentions_merge_to_the_whole():
    """Two ranks' halves of the keys (blocks alternating), merged, equal attention over
    all of them to 1e-5 in float32, including rows whose owned part is empty."""
    g = torch.Generator().manual_seed(0)
    b, lq, nh, s, d, dv = 3, 4, 4, 40, 24, 16
    q = torch.randn(b, lq * nh, d, generator=g)
    ctx = torch.randn(b, s, d, generator=g)
    causal = torch.arange(s)[None, None, :] <= torch.tensor([5, 12, 20, 39])[None, :, None]
    visible = causal.expand(b, lq, s).clone()
    visible[1, 0] = False
    visible[1, 0, 9] = True                     # query row 0 of sequence 1 sees key 9 only
    owner = (torch.arange(s) // 8) % 2          # blocks of 8 on ranks 0, 1, 0, ...
    whole, _ = partial_attention(q, ctx, visible, 0.3, dv)
    parts = [partial_attention(q, ctx, visible & (owner == r), 0.3, dv) for r in (0, 1)]
    assert torch.isinf(parts[0][1][1, :nh]).all()        # nothing owned: lse -inf ...
    assert not parts[0][0][1, :nh].any()                  # ... and output 0, no NaN
    merged = merge_partials(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]))
    assert not torch.isnan(merged).any()
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    empty = merge_partials(torch.zeros(2, 1, dv), torch.full((2, 1), float("-inf")))
    assert not empty.isnan().any() and not empty.any()


@pytest.mark.parametrize("int8", [False, True])
def test_striped_cache_holds_each_block_on_one_rank(int8):
    """Two ranks' striped caches, written with the same global slots, together hold what
    one whole cache holds; each keeps half the blocks (plus the sink)."""
    bs, dim, rope, blocks = 4, 12, 4, 6
    def cache(n):
        if int8:
            return Int8LatentCache(n, bs, dim - rope, rope, torch.float32, "cpu")
        return LatentCache(torch.zeros(n, bs, dim))
    whole = cache(blocks)
    ranks = [StripedLatentCache(cache(rank_blocks(blocks, 2)), StripeIndex(r, 2, bs)) for r in (0, 1)]
    assert [c.num_blocks for c in ranks] == [blocks, blocks]
    table = torch.tensor([[5, 2, 0], [3, 4, 1]])
    slots = (table[:, :, None] * bs + torch.arange(bs)).flatten(1)[:, :10].flatten()
    rows = torch.randn(slots.numel(), dim)
    for c in [whole] + ranks:
        c.write(slots, rows)
    want = whole.gather(table, 10)
    joined, seen = torch.zeros_like(want), torch.zeros(2, 10, dtype=torch.int64)
    for c in ranks:
        got, pos, owned = c.gather_owned(table, 10)
        assert got.shape[1] == 8                          # at most 2 of the 3 blocks per rank
        seq = torch.arange(2)[:, None].expand_as(pos)
        joined[seq[owned], pos[owned]] = got[owned]
        seen[seq[owned], pos[owned]] += 1
    assert (seen == 1).all()                              # every position on exactly one rank
    assert torch.equal(joined, want)
    assert torch.equal(ranks[0].gather(table, 10) + ranks[1].gather(table, 10), want)
    assert not supports_static_decode(None, ranks)       # the eager path serves striped caches
    assert torch.equal(ranks[1].read_slots([12, 13]), whole.read_slots([12, 13]))   # block 3
    with pytest.raises(ValueError, match=r"slots \[13\] are held by another rank"):
        ranks[0].read_slots([8, 13])


# -- engines: tp=2 sp=2 against one process ----------------------------------------------
@pytest.mark.slow
@pytest.mark.demo
@pytest.mark.parametrize("k, kw", [(0, {}), (1, {"async_scheduling": True})])
def test_demo_model_identical(k, kw):
    assert _parallel(str(DEMO), k, "tp2-sp2", **kw) == _single(str(DEMO), k)


def _long_batches(vocab: int) -> list[list]:
    """Prompts of 33-95 tokens (5-12 blocks of 8, on both ranks), greedy and seeded; then
    prompts sharing the first's 64-token prefix (prefix-cache hits, continued on both
    ranks' blocks)."""
    ps = prompts(3, seed=7, lo=33, hi=96, vocab=vocab - 8)
    tails = prompts(2, seed=8, lo=5, hi=30, vocab=vocab - 8)
    shared = [ps[0][:64] + t for t in tails]
    def both(batch, name):
        return (requests(batch, SamplingParams(max_tokens=16, temperature=0.0), f"{name}g")
                + requests(batch, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95,
                                                 seed=5), f"{name}s"))
    return [both(ps, "a"), both(shared, "b")]


def _serve_batches(engine: LLMEngine, vocab: int) -> tuple[dict, int]:
    out: dict[str, list[int]] = {}
    for batch in _long_batches(vocab):
        out.update(run_tokens(engine, batch))
    return out, engine.stats().prefix_cache_hits


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("sp") / "tiny", seed=5))


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 1])
def test_long_prompts_and_prefix_hits_identical_with_twice_the_kv(tiny_path, k):
    """Random checkpoint, pool sized by the same npuMemSize in both: the tokens are one
    process's, the prefix cache hits, and the striped pool holds >= 1.9x the blocks."""
    model, _ = load_checkpoint(tiny_path)
    mem_gb = BUDGET_BLOCKS * model.num_kv_layers * 8 * model.kv_cache_dim * 4 / 2**30
    cfg = dataclasses.replace(BASE, num_speculative_tokens=k, enable_prefix_cache=True,
                              num_blocks=None, mem_size_gb=mem_gb)
    one = LLMEngine(model.eval(), cfg, eos_token_ids=set())
    want, want_hits = _serve_batches(one, 512)
    par = LLMEngine(inspect_checkpoint(tiny_path),
                    dataclasses.replace(cfg, parallel=parallel_config("tp2-sp2")), eos_token_ids=set())
    try:
        got, hits = _serve_batches(par, 512)
        info, rt = par.executor.info, par.runtime.to_dict()
    finally:
        par.shutdown()
    assert got == want
    assert hits == want_hits >= 2 * 64
    blocks_sp1 = one.runtime.num_kv_blocks
    assert (info.sp, info.kv_blocks_per_rank * 2) == (2, info.num_kv_blocks)
    assert info.num_kv_blocks >= 1.9 * blocks_sp1, (info.num_kv_blocks, blocks_sp1)
    assert rt["kv_tokens"] == info.num_kv_blocks * 8 and rt["parallel"]["sp"] == 2
    assert rt["decode_path"] == "eager"
    print(f"\nnpuMemSize {mem_gb:.2e} GiB: sp=1 {blocks_sp1 * 8} KV tokens, tp=2 sp=2 "
          f"{info.num_kv_blocks * 8} ({info.num_kv_blocks / blocks_sp1:.2f}x)")


@pytest.mark.slow
def test_int8_kv_cache_identical(tiny_path):
    """kv_cache_dtype int8 stripes too (the striped cache wraps the int8 one)."""
    cfg = dataclasses.replace(BASE, num_speculative_tokens=1, kv_cache_dtype="int8")
    model, _ = load_checkpoint(tiny_path)
    batches = _long_batches(512)[:1]
    want = run_tokens(LLMEngine(model.eval(), cfg, eos_token_ids=set()), batches[0])
    par = LLMEngine(inspect_checkpoint(tiny_path),
                    dataclasses.replace(cfg, parallel=parallel_config("tp2-sp2")), eos_token_ids=set())
    try:
        assert par.runtime.num_int8_kv_layers == model.num_kv_layers
        assert run_tokens(par, batches[0]) == want
    finally:
        par.shutdown()


# -- refusals ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw, text", [
    ({"host_cache_blocks": 16}, r"the host KV tier \(kvPoolConfig.backend, or cpuMemSize with "
                                r"maxPreemptCount > 0\)"),
    ({"host_cache_gb": 1.0, "disk_cache_dir": "kv-disk"},
     r"the host KV tier \(.*\) and the disk KV tier \(kvPoolConfig configPath's disk_path\)"),
])
def test_kv_tiers_are_refused_with_a_striped_pool(tiny_path, kw, text):
    cfg = dataclasses.replace(BASE, **kw, parallel=parallel_config("tp2-sp2"))
    with pytest.raises(EngineError, match=rf"sp 2 \(sequence parallel\) stripes the KV pool over "
                                          rf"the ranks, and {text} moves? whole blocks of one "
                                          r"pool: not served together; turn the tier off or "
                                          r"serve with sp 1"):
        LLMEngine(inspect_checkpoint(tiny_path), cfg, eos_token_ids=set())


def test_sp_other_than_the_world_is_refused(tiny_path):
    cfg = dataclasses.replace(BASE, parallel=dataclasses.replace(parallel_config("tp4-ep4"), sp=2))
    with pytest.raises(EngineError, match=r"sp 2 \(sequence parallel\) must equal tp \(4\) "
                                          r"when above 1"):
        LLMEngine(inspect_checkpoint(tiny_path), cfg, eos_token_ids=set())
