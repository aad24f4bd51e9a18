"""Context parallel (tp = sp = 2, cp = 2: 4 ranks): a step's tokens split zigzag over the
cp ranks, their latent rows all-gathered into each cp rank's sp-striped pool.

The engines serve the same tokens as one process, greedy and seeded, MTP off and k=1
(the only k MindIE allows with cp), on the demo model and on a random checkpoint (also
with an int8 KV cache), with the prefix cache on and hitting; prompts of 24-60 tokens
give every cp rank real chunks.
Without ranks: the split covers every token once and its pseudo-sequences' masks are the
whole step's rows.  With ranks but no engine: the hidden states of a prefill and a
decode step match one process's, and skipping the KV exchange breaks them.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from server.engine.config import EngineError, ParallelConfig
from server.engine.core import LLMEngine
from server.engine.protocol import SamplingParams
from server.engine.batch.metadata import build_metadata
from server.model.layers.attention import build_plan
from server.model.parallel.context import ContextParallelPlanner, zigzag_chunks
from server.model.loading import inspect_checkpoint, load_checkpoint
from server.testing.tiny_checkpoint import make_tiny_checkpoint
from tests.engine.helpers import free_port, prompts, requests, run_rank_processes, run_tokens
from tests.engine.test_parallel import BASE, DEMO


def cp_config(**kw) -> ParallelConfig:
    """tp 2, sp 2, cp 2 on 4 ranks; experts over moe_ep 4 (MindIE's moe_tp x moe_ep ==
    worldSize)."""
    return ParallelConfig(world_size=4, moe_tp=1, moe_ep=4, sp=2, cp=2,
                          master_port=free_port(), **kw)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("cp") / "tiny", seed=5))


# -- the split, no ranks ----------------------------------------------------------------
def test_zigzag_split_covers_every_token_once_and_balances_causal_work():
    for n in range(0, 40):
        for index in range(3):
            shares = zigzag_chunks(n, 2, index)
            tokens = sorted(t for runs in shares for a, b in runs for t in range(a, b))
            assert tokens == list(range(n))
            # Keys the rank's queries see (causal): equal to within n (rounding of the
            # chunks); a contiguous split would differ by ~n^2 / 4.
            work = [sum(t + 1 for a, b in runs for t in range(a, b)) for runs in shares]
            assert abs(work[0] - work[1]) <= max(n, 1), (n, work)
    assert zigzag_chunks(10, 2) == [[(0, 2), (7, 10)], [(2, 5), (5, 7)]]
    assert [zigzag_chunks(1, 2, i) for i in (0, 1)] == [[[(0, 1)], []], [[], [(0, 1)]]]


def test_rank_plans_are_the_whole_steps_rows(tiny_path):
    """A prefill, a chunk continuing one and a decode in one step: each cp rank's
    pseudo-sequences see exactly the keys their tokens see in the whole step's plan, and
    the gathered rows come back in step order."""
    model, _ = load_checkpoint(tiny_path)
    bs = 4
    meta = build_metadata([0, 13, 29], [21, 9, 1], [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11],
                                                    [12, 13, 14, 15, 16, 17, 18, 19]],
                          bs, torch.device("cpu"))
    whole = build_plan(meta, model.rope, 4, 16)
    q_pos = [p for p in meta.positions.tolist()]
    seq_of = [s for s, n in enumerate(meta.query_lens_cpu) for _ in range(n)]
    plans = [ContextParallelPlanner(c, 2)(meta, model.rope, 4, 16) for c in (0, 1)]
    seen = []
    for plan in plans:
        local, index = plan.local, plan.token_index.tolist()
        seen += index
        pad = local.pad_index.tolist()
        for j, t in enumerate(index):
            b, i = divmod(pad[j], local.max_query_len)
            s = seq_of[t]
            width = local.block_tables.shape[1]
            assert torch.equal(local.block_tables[b], whole.block_tables[s][:width])
            keys = local.mask[b, 0, i].nonzero().flatten().tolist()
            assert keys == list(range(q_pos[t] + 1))
            assert whole.mask[s, 0, pad_row(whole, t)].nonzero().flatten().tolist() == keys
    assert sorted(seen) == list(range(meta.num_tokens)) and plans[0].width == plans[1].width
    order = plans[0].order.tolist()
    assert sorted(x for x in order if x < meta.num_tokens) == list(range(meta.num_tokens))


def pad_row(plan, token: int) -> int:
    return plan.pad_index[token].item() % plan.max_query_len


# -- ranks, no engine: hidden states and the exchange ---------------------------------
def _rank_forward(rank: int, port: int, path: str, out: str, broken: bool) -> None:
    """One of 4 ranks: a prefill + chunk step, then a chunk + decode step; rank 0 saves
    both steps' hidden states.  ``broken``: the KV exchange keeps this rank's rows only."""
    import torch.distributed as dist

    from server.model.parallel import context as cpm
    from server.model.layers.latent_cache import LatentCache
    from server.model.parallel.plan import ParallelPlan
    from server.model.parallel.sequence import StripedLatentCache, StripeIndex
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4)
    model, _ = load_checkpoint(path, plan=ParallelPlan(4, 1, 4, sp=2, cp=2, rank=rank))
    cpm.join_groups(model, 4, 2)
    if broken:
        def own_rows_only(self, rows, plan):
            full = rows.new_zeros(plan.num_tokens, rows.shape[1])
            if plan.token_index is not None:
                full[plan.token_index] = rows
            return full
        cpm.ContextParallelMLA.exchange = own_rows_only
    index = StripeIndex(rank % 2, 2, 4)
    caches = [StripedLatentCache(LatentCache(torch.zeros(9, 4, model.kv_cache_dim)), index)
              for _ in range(model.num_kv_layers)]
    hidden = [model.forward(ids, meta, caches) for ids, meta in _steps()]
    if rank == 0:
        torch.save(hidden, out)
    dist.barrier()
    dist.destroy_process_group()


def _steps() -> list:
    """Two steps over a pool of 16 blocks of 4: sequence 0 prefills 29 tokens, then
    decodes one; sequence 1 prefills 13, then its other 8."""
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(2, 500, (30,), generator=g), torch.randint(2, 500, (21,), generator=g)]
    tables = [list(range(8)), list(range(8, 14))]
    cpu = torch.device("cpu")
    return [(torch.cat([ids[0][:29], ids[1][:13]]),
             build_metadata([0, 0], [29, 13], tables, 4, cpu)),
            (torch.cat([ids[1][13:], ids[0][29:]]),
             build_metadata([13, 29], [8, 1], tables[::-1], 4, cpu))]


@pytest.mark.slow
def test_hidden_states_match_one_process_and_need_the_kv_exchange(tiny_path, tmp_path):
    model, _ = load_checkpoint(tiny_path)
    cache = [torch.zeros(16, 4, model.kv_cache_dim) for _ in range(model.num_kv_layers)]
    with torch.inference_mode():
        want = [model.forward(ids, meta, cache) for ids, meta in _steps()]
    got = {}
    for broken in (False, True):
        port, out = free_port(), str(tmp_path / f"h{int(broken)}.pt")
        codes = run_rank_processes(_rank_forward, lambda r: (r, port, tiny_path, out, broken), 4)
        assert codes == [0] * 4
        got[broken] = torch.load(out)
    for w, g in zip(want, got[False]):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
    # Without the exchange the second cp rank's queries miss the first's keys (and the
    # cache misses rows): the prefill's hidden states are wrong by far more than rounding.
    errs = [(g - w).abs().max().item() for w, g in zip(want, got[True])]
    assert min(errs) > 1e-2, errs


# -- engines: tp=2 sp=2 cp=2 against one process -----------------------------------------
def _batches(vocab: int) -> list[list]:
    """Prompts of 24-59 tokens, greedy and seeded; then prompts sharing the first's
    32-token prefix (prefix-cache hits, the rest split over the cp ranks)."""
    ps = prompts(2, seed=7, lo=24, hi=60, vocab=vocab - 8)
    shared = [ps[0][:32] + t for t in prompts(2, seed=8, lo=5, hi=20, vocab=vocab - 8)]
    def both(batch, name):
        return (requests(batch, SamplingParams(max_tokens=10, temperature=0.0), f"{name}g")
                + requests(batch, SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95,
                                                 seed=5), f"{name}s"))
    return [both(ps, "a"), both(shared, "b")]


def _serve(engine: LLMEngine, vocab: int) -> tuple[dict, int]:
    out: dict[str, list[int]] = {}
    for batch in _batches(vocab):
        out.update(run_tokens(engine, batch))
    return out, engine.stats().prefix_cache_hits


@pytest.mark.slow
@pytest.mark.parametrize("model, k, kw", [
    pytest.param("demo", 0, {}, marks=pytest.mark.demo),
    pytest.param("demo", 1, {"async_scheduling": True}, marks=pytest.mark.demo),
    ("tiny", 0, {}), ("tiny", 1, {}), ("tiny", 1, {"kv_cache_dtype": "int8"})])
def test_identical_to_one_process_with_prefix_hits(model, k, kw, tiny_path):
    path = str(DEMO) if model == "demo" else tiny_path
    cfg = dataclasses.replace(BASE, num_speculative_tokens=k, enable_prefix_cache=True, **kw)
    one, _ = load_checkpoint(path)
    vocab = one.config.vocab_size
    want, want_hits = _serve(LLMEngine(one.eval(), cfg, eos_token_ids=set()), vocab)
    par = LLMEngine(inspect_checkpoint(path), dataclasses.replace(cfg, parallel=cp_config()),
                    eos_token_ids=set())
    try:
        got, hits = _serve(par, vocab)
        info, rt = par.executor.info, par.runtime.to_dict()
    finally:
        par.shutdown()
    assert not any(p.is_alive() for p in par.executor._procs), "a rank outlived shutdown"
    assert got == want
    assert hits == want_hits >= 2 * 32
    assert (info.sp, info.kv_blocks_per_rank * 2) == (2, info.num_kv_blocks)
    assert {key: rt["parallel"][key] for key in ("world_size", "tp", "cp", "sp")} == \
        {"world_size": 4, "tp": 2, "cp": 2, "sp": 2}
    assert rt["decode_path"] == "eager"


# -- refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize("par, kw, text", [
    (dict(sp=1), {}, r"cp 2 \(context parallel\) needs sp > 1"),
    (dict(sp=4), {}, r"sp 4 \(sequence parallel\) must equal tp \(2\) when above 1"),
    (dict(world_size=8, dp=2, moe_ep=8), {}, r"cp 2 \(context parallel\) cannot be combined "
                                             r"with dp 2 \(attention data parallel\)"),
    ({}, {"host_cache_blocks": 16}, r"sp 2 \(sequence parallel\) stripes the KV pool over "
                                    r"the ranks, and the host KV tier"),
    ({}, {"disk_cache_dir": "kv-disk", "host_cache_gb": 1.0}, r"and the disk KV tier"),
])
def test_what_cp_cannot_serve_is_refused_before_any_rank_starts(tiny_path, par, kw, text):
    cfg = dataclasses.replace(BASE, **kw, parallel=dataclasses.replace(cp_config(), **par))
    with pytest.raises(EngineError, match=text):
        LLMEngine(inspect_checkpoint(tiny_path), cfg, eos_token_ids=set())


@pytest.mark.demo
def test_int8_attention_cut_over_tp_is_refused_with_cp(quantized):
    """An int8 o_proj sums integers over its group; with cp the world's ranks hold
    different tokens, so the cut is refused at load, naming the layer."""
    from server.model.loading import CheckpointError
    from server.model.parallel.plan import ParallelPlan
    with pytest.raises(CheckpointError, match=r"an int8 attention layer cut over tp 2 ranks "
                                              r"with cp 2 .*serve int8 attention with cp 1"):
        load_checkpoint(str(quantized["w8a8"]), plan=ParallelPlan(4, 1, 4, sp=2, cp=2, rank=0))
