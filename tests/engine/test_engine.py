"""Engine behaviour on the tiny model: seeds, preemption, pool accounting, prefix cache,
stop strings, failures, logprobs, the async front."""
from __future__ import annotations

import asyncio
import os

import pytest
import torch

from server.engine.kv.block_manager import BlockManager
from server.engine.config import EngineConfig
from server.engine import AsyncEngine, EngineError, LLMEngine
from server.engine.protocol import EngineRequest, FinishReason, SamplingParams
from tests.engine.helpers import (high_acceptance_model, make_engine, prompts, requests,
                                  run_staggered, run_tokens, tiny_model, tokens_of)

GREEDY = SamplingParams(max_tokens=48, temperature=0.0)


# ---- seeds -----------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 2])
def test_seeded_request_reproduces_alone_and_in_a_busy_batch(k):
    model = high_acceptance_model()
    seeded = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=1234)
    target = EngineRequest("target", prompts(1, seed=9)[0], seeded)
    alone = run_tokens(make_engine(model, k), [target])["target"]
    again = run_tokens(make_engine(model, k), [EngineRequest("target", target.prompt_token_ids,
                                                             seeded)])["target"]
    assert alone == again
    # (the others are seeded too, only so that the test itself is deterministic)
    others = [SamplingParams(max_tokens=30 + i, temperature=0.5 + 0.1 * i, top_k=10 * (i + 1),
                             seed=100 + i) for i in range(7)]
    busy = requests(prompts(7, seed=4), others, "o")
    busy.insert(3, EngineRequest("target", target.prompt_token_ids, seeded))
    out = run_staggered(make_engine(model, k), busy, every=1)
    assert out["target"] == alone
    # ... and after being preempted and recomputed from its tokens
    eng = make_engine(model, k, num_blocks=24, max_preempt_count=4)
    out = run_staggered(eng, busy, every=1)
    assert out["target"] == alone
    assert eng.stats().num_preemptions > 0


# ---- preemption and pool accounting ------------------------------------------------------
@pytest.mark.parametrize("k,preempt,prefix", [(0, 3, False), (1, 3, False), (2, 3, True),
                                               (2, 0, False)])
def test_tiny_pool_completes_everything_identically(k, preempt, prefix):
    model = tiny_model()
    ps = prompts(8, seed=5, lo=10, hi=30)
    ref = run_tokens(make_engine(model, k), requests(ps, GREEDY))
    eng = make_engine(model, k, num_blocks=20, max_preempt_count=preempt,
                      enable_prefix_cache=prefix)
    outs = eng.generate(requests(ps, GREEDY))
    assert {r: tokens_of(v) for r, v in outs.items()} == ref
    assert all(v[-1].finish_reason is FinishReason.LENGTH for v in outs.values())
    st = eng.stats()
    assert st.kv_blocks_used == 0 and st.num_running == st.num_waiting == 0
    preempted = sum(v[-1].counters.num_preemptions for v in outs.values())
    assert preempted == st.num_preemptions
    if preempt:
        assert st.num_preemptions > 0
    else:
        assert st.num_preemptions == 0          # reserve mode: waits instead


def test_pool_free_after_aborts_mid_decode():
    model = tiny_model()
    for k in (0, 2):
        eng = make_engine(model, k, enable_prefix_cache=True)
        reqs = requests(prompts(8, seed=6), GREEDY)
        for r in reqs:
            eng.add_request(r)
        for _ in range(5):
            eng.step()
        assert eng.stats().kv_blocks_used > 0
        for r in reqs[::2]:
            eng.abort(r.request_id)
        finals = {o.request_id: o for o in eng.step() if o.finished}
        assert {r.request_id for r in reqs[::2]} <= set(finals)
        assert all(finals[r.request_id].finish_reason is FinishReason.ABORT for r in reqs[::2])
        while eng.has_unfinished():
            eng.step()
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
        assert eng.stats().kv_blocks_used == 0 and eng.stats().num_worker_requests == 0


def test_abort_of_waiting_and_unknown_requests():
    eng = make_engine(tiny_model(), 1, max_batch_size=1)
    a, b = requests(prompts(2), GREEDY)
    eng.add_request(a), eng.add_request(b)
    eng.step()
    eng.abort("b0-unknown")
    eng.abort(b.request_id)                     # still waiting
    outs = eng.step()
    assert any(o.request_id == b.request_id and o.finish_reason is FinishReason.ABORT for o in outs)
    while eng.has_unfinished():
        eng.step()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


# ---- prefix cache --------------------------------------------------------------------------
def test_prefix_cache_hits_give_identical_outputs():
    model = tiny_model()
    shared = prompts(1, seed=7, lo=41, hi=42)[0]
    tails = prompts(6, seed=8, lo=2, hi=9)
    ps = [shared + t for t in tails]
    for k in (0, 1, 2):
        ref = run_tokens(make_engine(model, k), requests(ps, GREEDY))
        eng = make_engine(model, k, enable_prefix_cache=True)
        first = eng.generate(requests(ps[:1], GREEDY))
        rest = eng.generate(requests(ps[1:], GREEDY, "h"))
        got = {"r0": tokens_of(first["r0"])}
        got.update({f"r{i + 1}": tokens_of(v) for i, v in enumerate(rest.values())})
        assert got == ref
        cached = [v[-1].counters.cached_tokens for v in rest.values()]
        assert all(c >= 32 for c in cached), cached      # 41 shared tokens, blocks of 8
        assert eng.stats().prefix_cache_hits >= sum(cached)
        assert eng.stats().kv_blocks_used == 0


def _mtp_rows_after_prefill(eng: LLMEngine, req: EngineRequest) -> torch.Tensor:
    eng.add_request(req)
    eng.step()
    return eng.worker.kv_rows(req.request_id, range(len(req.prompt_token_ids)), layer=-1)


def test_prefix_hit_reuses_mtp_kv_only_when_the_next_token_matches():
    """MTP KV at the last slot of a block depends on the next block's first token."""
    model = tiny_model()
    base = prompts(1, seed=11, lo=30, hi=31)[0]
    a = base[:24] + [7] + base[25:]             # block 3 starts with 7 ...
    b = base[:24] + [9] + base[25:]             # ... or 9: blocks 0-1 reusable, block 2 not for MTP
    fresh = _mtp_rows_after_prefill(make_engine(model, 1), EngineRequest("b", b, GREEDY))
    eng = make_engine(model, 1, enable_prefix_cache=True)
    run_tokens(eng, [EngineRequest("a", a, GREEDY)])
    rows = _mtp_rows_after_prefill(eng, EngineRequest("b", b, GREEDY))
    assert eng.scheduler.requests["b"].counters.cached_tokens == 16
    assert torch.allclose(rows, fresh, atol=1e-5)
    # Keyed without the next token, block 2 would be reused with a stale last MTP slot:
    bad = make_engine(model, 1, enable_prefix_cache=True,
                      blocks=BlockManager(512, 8, enable_prefix_cache=True, hash_next_token=False))
    run_tokens(bad, [EngineRequest("a", a, GREEDY)])
    rows_bad = _mtp_rows_after_prefill(bad, EngineRequest("b", b, GREEDY))
    assert bad.scheduler.requests["b"].counters.cached_tokens == 24
    assert not torch.allclose(rows_bad[23], fresh[23], atol=1e-3)


# ---- stop strings, lengths ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    from server.text.tokenizer import Tokenizer
    import tempfile
    return Tokenizer.from_dir(make_tiny_checkpoint(tempfile.mkdtemp(), seed=0))


def _engine_with_tok(tokenizer, k: int) -> LLMEngine:
    cfg = EngineConfig(block_size=8, num_blocks=256, num_speculative_tokens=k,
                       max_queue_delay_us=0, max_batch_size=8, max_seq_len=512)
    return LLMEngine(high_acceptance_model(), cfg, tokenizer, eos_token_ids=set())


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tokenizer, k, include):
    prompt = tokenizer.encode("The quick brown fox jumps over")
    full = _engine_with_tok(tokenizer, k).generate(
        [EngineRequest("f", prompt, SamplingParams(max_tokens=40, temperature=0.0))])["f"]
    text = "".join(o.text for o in full)
    toks = tokens_of(full)
    # a 3-character stop string whose first and last characters come from different tokens
    ends = [len(tokenizer.decode(toks[:j])) for j in range(1, len(toks) + 1)]
    offset = next(i for i in range(4, len(text) - 3)
                  if "\ufffd" not in text[i:i + 3] and text.find(text[i:i + 3]) == i
                  and any(i < e < i + 3 for e in ends))
    stop = text[offset:offset + 3]
    completing = next(j for j, e in enumerate(ends) if e >= offset + 3)
    sp = SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,), include_stop_str_in_output=include)
    outs = _engine_with_tok(tokenizer, k).generate([EngineRequest("s", prompt, sp)])["s"]
    got = "".join(o.text for o in outs)
    assert got == text[:offset + (len(stop) if include else 0)]
    last = outs[-1]
    assert last.finished and last.finish_reason is FinishReason.STOP and last.stop_reason == stop
    assert tokens_of(outs) == toks[:completing + 1]  # tokens after the completing one dropped
    streamed = ""
    for o in outs[:-1]:                             # no partial stop string ever streamed
        streamed += o.text
        assert len(streamed) <= offset


def test_eos_stops_and_is_not_text(tokenizer):
    eng = _engine_with_tok(tokenizer, 1)
    prompt = tokenizer.encode("hello there")
    first = tokens_of(eng.generate([EngineRequest("a", prompt, SamplingParams(max_tokens=5, temperature=0))])["a"])
    eng2 = LLMEngine(high_acceptance_model(), eng.cfg, tokenizer, eos_token_ids={first[2]})
    outs = eng2.generate([EngineRequest("b", prompt, SamplingParams(max_tokens=5, temperature=0)),
                          EngineRequest("c", prompt, SamplingParams(max_tokens=5, temperature=0,
                                                                    ignore_eos=True)),
                          EngineRequest("d", prompt, SamplingParams(max_tokens=5, temperature=0,
                                                                    min_tokens=3))])
    assert tokens_of(outs["b"]) == first[:3] and outs["b"][-1].finish_reason is FinishReason.STOP
    assert "".join(o.text for o in outs["b"]) == tokenizer.decode(first[:2])
    assert tokens_of(outs["c"]) == first and outs["c"][-1].finish_reason is FinishReason.LENGTH
    assert first[2] not in tokens_of(outs["d"])[:3]      # masked until min_tokens


def test_length_limits_max_iter_times_and_max_seq_len():
    eng = make_engine(tiny_model(), 2, max_iter_times=7)
    outs = eng.generate(requests(prompts(2), SamplingParams(max_tokens=50, temperature=0)))
    assert all(len(tokens_of(v)) == 7 and v[-1].finish_reason is FinishReason.LENGTH
               for v in outs.values())
    cfg = EngineConfig(block_size=8, num_blocks=64, num_speculative_tokens=2, max_queue_delay_us=0,
                       max_seq_len=20)
    eng = LLMEngine(tiny_model(), cfg, eos_token_ids=set())
    out = eng.generate([EngineRequest("x", list(range(2, 17)), SamplingParams(max_tokens=50, temperature=0))])
    assert len(tokens_of(out["x"])) == 5


# ---- failures ------------------------------------------------------------------------------
def test_bad_requests_fail_alone():
    eng = make_engine(tiny_model(), 1)
    good = EngineRequest("ok", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    bad = [EngineRequest("empty", [], GREEDY), EngineRequest("oov", [5, 10_000], GREEDY),
           EngineRequest("long", list(range(2, 600)), GREEDY)]
    outs = eng.generate(bad + [good])
    for r in bad:
        assert outs[r.request_id][-1].finish_reason is FinishReason.ERROR and outs[r.request_id][-1].error
    assert len(tokens_of(outs["ok"])) == 4


def test_output_processing_error_fails_only_that_request(monkeypatch):
    from server.engine import output
    real = output.RequestOutput.process

    def boom(self, tokens, logprobs, finished):
        if self.seq.request_id == "r1" and self.num_tokens_sent >= 3:
            raise RuntimeError("injected")
        return real(self, tokens, logprobs, finished)

    monkeypatch.setattr(output.RequestOutput, "process", boom)
    eng = make_engine(tiny_model(), 1)
    outs = eng.generate(requests(prompts(3), SamplingParams(max_tokens=12, temperature=0)))
    assert outs["r1"][-1].finish_reason is FinishReason.ERROR and "injected" in outs["r1"][-1].error
    assert len(tokens_of(outs["r0"])) == 12 and len(tokens_of(outs["r2"])) == 12
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_unknown_kv_cache_dtype_is_refused_clearly():
    with pytest.raises(EngineError, match="'fp8'; allowed: 'auto'.*'int8'"):
        LLMEngine(tiny_model(), EngineConfig(num_blocks=8, kv_cache_dtype="fp8"))


def test_mtp_requested_without_mtp_weights_decodes_plainly():
    eng = make_engine(tiny_model(with_mtp=False), 2)
    out = eng.generate(requests(prompts(2), SamplingParams(max_tokens=6, temperature=0)))
    assert all(len(tokens_of(v)) == 6 for v in out.values())
    assert eng.stats().num_speculative_tokens == 0 and eng.stats().num_drafts == 0


# ---- logprobs ----------------------------------------------------------------------------
def test_logprobs_are_the_target_models():
    model = high_acceptance_model()
    prompt = prompts(1, seed=12)[0]
    sp = SamplingParams(max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    outs = make_engine(model, 2).generate([EngineRequest("l", prompt, sp)])["l"]
    toks = tokens_of(outs)
    lps = [lp for o in outs for lp in o.logprobs]
    assert [lp.token_id for lp in lps] == toks
    with torch.no_grad():
        ids = torch.tensor([prompt + toks])
        ref = torch.log_softmax(model.compute_logits(model.forward_full(ids)[0]), -1)
    for i, lp in enumerate(lps):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp.logprob - row[toks[i]].item()) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


# ---- sampled distribution through the engine ----------------------------------------------
@pytest.mark.slow                       # statistical
@pytest.mark.parametrize("model_name,k,n", [("random", 1, 600), ("high", 1, 600), ("high", 2, 900)])
def test_sampled_joint_distribution_matches_the_target_model(model_name, k, n):
    """First k+1 tokens, top_k=3: MTP (sampled drafts, ratio test) vs the exact model joint."""
    from scipy.stats import chisquare
    model = tiny_model() if model_name == "random" else high_acceptance_model()
    prompt = prompts(1, seed=13)[0]
    temp = 1.3
    sp = [SamplingParams(max_tokens=k + 1, temperature=temp, top_k=3, seed=s) for s in range(n)]

    @torch.no_grad()
    def joint(ids, depth):
        if depth == 0:
            return {(): 1.0}
        logits = model.compute_logits(model.forward_full(torch.tensor([ids]))[0, -1:])[0] / temp
        top = logits.topk(3)
        out = {}
        for t, p in zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()):
            for rest, q in joint(ids + [t], depth - 1).items():
                out[(t,) + rest] = p * q
        return out

    exact = joint(prompt, k + 1)
    eng = make_engine(model, k, max_batch_size=64)
    outs = eng.generate(requests([prompt] * len(sp), sp))
    seqs = [tuple(tokens_of(v)) for v in outs.values()]
    assert set(seqs) <= set(exact)
    keys = sorted(exact)
    obs = [seqs.count(key) for key in keys]
    total = sum(exact.values())
    exp = [exact[key] / total * len(seqs) for key in keys]
    assert chisquare(obs, exp).pvalue > 1e-3, (obs, exp)
    st = eng.stats()
    assert st.num_draft_tokens >= k * len(sp)          # every request verified drafts
    if model_name == "high":
        assert 0.2 < st.acceptance_rate < 0.95, st.acceptance_rate    # both paths taken


# ---- async front ---------------------------------------------------------------------------
def test_async_engine_streams_aborts_and_drains():
    async def main():
        eng = AsyncEngine(make_engine(high_acceptance_model(), 2))
        await eng.start()
        reqs = requests(prompts(3, seed=14), SamplingParams(max_tokens=20, temperature=0))

        async def collect(r, stop_after=None):
            got = []
            async for out in eng.submit(r):
                got.append(out)
                if stop_after is not None and len(got) >= stop_after:
                    break                      # leaving the stream aborts the request
            return got

        res = await asyncio.gather(collect(reqs[0]), collect(reqs[1], stop_after=1),
                                   collect(reqs[2]))
        for _ in range(100):
            if eng.stats().num_requests_aborted == 1 and eng.stats().kv_blocks_used == 0:
                break
            await asyncio.sleep(0.02)
        st = eng.stats()
        await eng.shutdown(drain=True)
        return res, st

    res, st = asyncio.run(main())
    assert res[0][-1].finished and len(tokens_of(res[0])) == 20
    assert res[2][-1].finished and res[2][-1].counters.completion_tokens == 20
    assert res[0][-1].counters.num_accepted_tokens > 0
    assert st.num_requests_aborted == 1 and st.kv_blocks_used == 0 and st.num_running == 0
    assert st.num_drafts > 0 and len(st.accepted_per_position) == 2


# ---- configuration -------------------------------------------------------------------------
def _shipped_config(tmp_path, **env: str) -> tuple[dict, object]:
    """conf/config.json on a tiny checkpoint with a 1 GiB pool: (the document, its AppConfig
    under ``env``).  The suite's compile switch (off) goes with it: "auto" would compile the
    tiny model's graphs in the background, minutes of a core that nothing reads."""
    import json
    from pathlib import Path

    from server.config import parse_config
    from server.testing.tiny_checkpoint import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    doc = json.loads(Path("conf/config.json").read_text())
    doc["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = str(ckpt)
    doc["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["npuMemSize"] = 1
    env = {"MTP_SERVE_COMPILE": os.environ["MTP_SERVE_COMPILE"], **env}
    return doc, parse_config(doc, base_dir=tmp_path, env=env)


def test_from_config_reads_the_shipped_config(tmp_path):
    from server.config import parse_config
    from server.engine.config import engine_config_from_app

    doc, app = _shipped_config(tmp_path)
    cfg = engine_config_from_app(app)
    sched = app.schedule
    assert cfg.block_size == sched.cache_block_size and cfg.max_batch_size == sched.max_batch_size
    assert cfg.num_speculative_tokens == app.num_speculative_tokens and cfg.mem_size_gb == 1.0
    assert cfg.adaptive_speculation is True                     # on by default
    mc = doc["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    mc["plugin_params"] = {"plugin_type": "mtp", "num_speculative_tokens": 2,
                           "adaptive_speculation": False}
    fixed = engine_config_from_app(parse_config(doc, base_dir=tmp_path))
    assert fixed.adaptive_speculation is False and fixed.num_speculative_tokens == 2

    async def main():
        eng = AsyncEngine.from_config(app, device="cpu")
        await eng.start()
        req = EngineRequest("c", eng.engine.tokenizer.encode("hello"),
                            SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        outs = [o async for o in eng.submit(req)]
        await eng.shutdown()
        return eng, outs

    eng, outs = asyncio.run(main())
    assert len(tokens_of(outs)) == 5 and outs[-1].finished
    st = eng.stats()
    assert st.num_speculative_tokens == app.num_speculative_tokens
    # 1 GiB of pool, capped at what maxBatchSize x maxSeqLen can use
    assert st.kv_blocks_total > 0 and st.block_size == sched.cache_block_size


def test_an_engine_whose_worker_is_a_process_lets_its_loaded_model_go(tmp_path, monkeypatch):
    """With asynchronous scheduling on a CPU the worker process keeps its own copy of the
    weights; the engine's process frees the one it loaded (a model's cycles wait for a full
    collection otherwise: the 0.5b model's 1.1 GB stayed mapped beside the worker's)."""
    import weakref

    from server.engine.front import async_engine
    from server.model import loading

    _, app = _shipped_config(tmp_path, MINDIE_ASYNC_SCHEDULING_ENABLE="1")
    loaded = []
    real = loading.load_checkpoint

    def load(*a, **kw):
        out = real(*a, **kw)
        loaded.append(weakref.ref(out[0]))
        return out
    monkeypatch.setattr(loading, "load_checkpoint", load)
    engine = async_engine.build_engine(app, device="cpu")
    try:
        assert engine.worker is None and len(loaded) == 1        # a worker process; loaded here
        assert loaded[0]() is None
        out = engine.generate([EngineRequest("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))])
        assert len(tokens_of(out["r"])) == 4
    finally:
        engine.shutdown()


def test_a_request_that_breaks_the_model_fails_alone(monkeypatch):
    model = tiny_model()
    real = type(model).forward

    def forward(self, input_ids, meta, kv_caches):
        if (input_ids == 499).any():
            raise RuntimeError("poisoned token")
        return real(self, input_ids, meta, kv_caches)

    monkeypatch.setattr(type(model), "forward", forward)
    eng = make_engine(model, 1)
    ps = prompts(3, seed=15, vocab=400)
    ps[1] = ps[1] + [499]
    outs = eng.generate(requests(ps, SamplingParams(max_tokens=10, temperature=0)))
    assert outs["r1"][-1].finish_reason is FinishReason.ERROR and "poisoned" in outs["r1"][-1].error
    assert len(tokens_of(outs["r0"])) == 10 and len(tokens_of(outs["r2"])) == 10
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    monkeypatch.undo()
    ref = make_engine(model, 1).generate(requests([ps[0], ps[2]], SamplingParams(max_tokens=10, temperature=0)))
    assert tokens_of(outs["r0"]) == tokens_of(ref["r0"]) and tokens_of(outs["r2"]) == tokens_of(ref["r1"])


def test_out_of_vocabulary_sampling_ids_are_refused():
    eng = make_engine(tiny_model(), 0)
    outs = eng.generate([EngineRequest("b", [5, 6], SamplingParams(logit_bias={9999: 1.0})),
                         EngineRequest("s", [5, 6], SamplingParams(stop_token_ids=(-1,)))])
    assert all(v[-1].finish_reason is FinishReason.ERROR for v in outs.values())


def test_select_batch_and_small_prefill_budgets_do_not_change_outputs():
    model = high_acceptance_model()
    ps = prompts(12, seed=16)
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    ref = run_tokens(make_engine(model, 0), requests(ps, sp))
    eng = make_engine(model, 1, support_select_batch=True, max_prefill_tokens=40,
                      max_prefill_batch_size=2, prefill_time_ms_per_req=20, decode_time_ms_per_req=5)
    assert run_staggered(eng, requests(ps, sp), every=1) == ref
    assert eng.stats().num_steps > 24
