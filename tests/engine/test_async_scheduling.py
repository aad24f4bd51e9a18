"""Asynchronous scheduling emits exactly what synchronous scheduling emits.

Each case runs the same requests through an engine with async scheduling off (the
reference) and on: greedy and seeded sampling, MTP off / k=1 / k=2 / adaptive / k up to 5,
one at a time and 16 at a time with staggered arrivals, stop strings, max_tokens,
min_tokens, EOS, prefix-cache hits, preemption and aborts mid-stream.  Pools must be back
to empty and the worker must hold no request state afterwards.
"""
from __future__ import annotations

import tempfile

import pytest

from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.protocol import EngineRequest, FinishReason, SamplingParams
from tests.engine.helpers import (high_acceptance_model, make_engine, prompts, requests,
                                  run_staggered, run_tokens, tiny_model, tokens_of)

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)
pytestmark = pytest.mark.slow          # every case runs twice (sync, async): about 2 min on 2 CPU cores


def both(model, k: int, run, **kw) -> tuple[dict, dict]:
    """``run(engine)`` with async scheduling off and on; both engines end empty."""
    outs = []
    for on in (False, True):
        eng = make_engine(model, k, async_scheduling=on, **kw)
        assert (eng.worker is None) is (on and kw.get("async_executor", "auto") != "thread")
        assert eng.runtime.async_scheduling is on
        placeholders = watch_placeholders(eng)
        outs.append(run(eng))
        # async: steps really were scheduled before the previous one's tokens were known
        assert (max(placeholders) > 0) is on
        st = eng.stats()
        assert st.kv_blocks_used == 0 and st.num_running == st.num_waiting == 0
        assert st.num_worker_requests == 0
        eng.shutdown()
    return outs[0], outs[1]


def watch_placeholders(eng: LLMEngine) -> list[int]:
    """Record the most placeholders any request carried, per launched step."""
    seen = [0]
    launch = eng.executor.execute_model

    def execute_model(so):
        seen.append(max((c.num_output_placeholders for c in so.cached_requests), default=0))
        return launch(so)

    eng.executor.execute_model = execute_model
    return seen


def sampled(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=24 + i, temperature=0.7 + 0.05 * i, top_p=0.95, top_k=20,
                          seed=500 + i, min_tokens=3 * (i % 3))


@pytest.mark.parametrize("k,adaptive", [(0, False), (1, False), (2, False), (2, True), (5, False)])
def test_greedy_identical_sixteen_staggered_and_one_at_a_time(k, adaptive):
    model = high_acceptance_model()
    reqs = requests(prompts(16, seed=21), GREEDY)

    def run(e):
        """16 staggered, then (the engine empty again) the first 4 one at a time: one
        engine pair for both, as each async engine starts a worker process."""
        staggered = run_staggered(e, reqs, every=1)
        placeholders = watch_placeholders(e)          # the one-at-a-time steps' own
        alone = {r.request_id: run_tokens(e, [r])[r.request_id] for r in reqs[:4]}
        return staggered, alone, max(placeholders) > 0

    (ref, ref1, sync_ahead), (got, got1, async_ahead) = both(
        model, k, run, max_batch_size=16, adaptive_speculation=adaptive)
    assert got == ref
    assert got1 == ref1 == {r: ref[r] for r in ref1}
    assert async_ahead and not sync_ahead         # one at a time too, async ran steps ahead


@pytest.mark.parametrize("k", [0, 1, 2])
def test_seeded_sampling_identical(k):
    model = high_acceptance_model()
    reqs = requests(prompts(16, seed=22), [sampled(i) for i in range(16)])
    ref, got = both(model, k, lambda e: run_staggered(e, reqs, every=2), max_batch_size=16)
    assert got == ref


@pytest.mark.parametrize("k", [0, 2])
def test_eos_min_tokens_and_lengths_never_emit_past_the_end(k):
    model = tiny_model()
    ps = prompts(12, seed=23)
    ref_free = run_staggered(make_engine(model, k), requests(ps, GREEDY))
    eos = {ref_free["r0"][5], ref_free["r3"][2]}       # tokens the outputs really contain
    params = [SamplingParams(max_tokens=3 + 4 * i, temperature=0.0, min_tokens=i % 4)
              for i in range(12)]

    def run(e):
        outs = e.generate(requests(ps, params))
        for rid, v in outs.items():
            assert sum(o.finished for o in v) == 1 and v[-1].finished
        return {rid: (tokens_of(v), v[-1].finish_reason) for rid, v in outs.items()}

    ref, got = both(model, k, run, eos=eos)
    assert got == ref
    for i, (rid, (toks, reason)) in enumerate(got.items()):
        assert len(toks) <= params[i].max_tokens
        if reason is FinishReason.STOP:
            assert toks[-1] in eos and not set(toks[:-1]) & eos and len(toks) > params[i].min_tokens


@pytest.mark.parametrize("k", [0, 1, 2])
def test_prefix_cache_hits_identical(k):
    model = tiny_model()
    shared = prompts(1, seed=24, lo=41, hi=42)[0]
    ps = [shared + t for t in prompts(8, seed=25, lo=2, hi=9)]

    def run(e):
        first = run_tokens(e, requests(ps[:1], GREEDY))
        rest = run_staggered(e, requests(ps[1:], GREEDY, "h"), every=1)
        return first, rest, e.stats().prefix_cache_hits

    ref, got = both(model, k, run, enable_prefix_cache=True)
    assert got[:2] == ref[:2] and got[2] >= 7 * 40


@pytest.mark.parametrize("k,reserve", [(0, False), (1, False), (2, False), (2, True)])
def test_preemption_under_a_tiny_pool_identical(k, reserve):
    model = tiny_model()
    ps = prompts(10, seed=26, lo=10, hi=30)
    ref = run_tokens(make_engine(model, k), requests(ps, GREEDY))
    preempted = []

    def run(e):
        out = run_staggered(e, requests(ps, GREEDY), every=1)
        preempted.append(e.stats().num_preemptions)
        return out

    off, on = both(model, k, run, num_blocks=22, max_preempt_count=0 if reserve else 3)
    assert off == on == ref
    if not reserve:
        assert preempted[1] > 0


@pytest.mark.parametrize("k", [0, 2])
def test_aborts_mid_stream(k):
    model = high_acceptance_model()
    reqs = requests(prompts(12, seed=27), GREEDY)
    full = run_staggered(make_engine(model, k), reqs, every=1)
    aborted = {r.request_id for r in reqs[1::3]}

    def run(e):
        outs = {r.request_id: [] for r in reqs}
        for r in reqs:
            e.add_request(r)
        steps = 0
        while e.has_unfinished():
            if steps == 6:
                for rid in aborted:
                    e.abort(rid)
            for o in e.step():
                outs[o.request_id].append(o)
            steps += 1
        return outs

    for outs in both(model, k, run, max_batch_size=16):
        for rid, v in outs.items():
            assert sum(o.finished for o in v) == 1 and v[-1].finished
            toks = tokens_of(v)
            if rid in aborted:
                assert v[-1].finish_reason is FinishReason.ABORT
                assert toks == full[rid][:len(toks)] and len(toks) < len(full[rid])
            else:
                assert toks == full[rid]


@pytest.fixture(scope="module")
def tokenizer():
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    from server.text.tokenizer import Tokenizer
    return Tokenizer.from_dir(make_tiny_checkpoint(tempfile.mkdtemp(), seed=0))


@pytest.mark.parametrize("k", [0, 1, 2])
def test_stop_strings_discard_what_the_next_step_produced(tokenizer, k):
    model = high_acceptance_model()
    ps = [tokenizer.encode(t) for t in ("The quick brown fox", "jumps over the", "lazy dog and",
                                        "a cat that sat", "on the mat today")]
    plain = [EngineRequest(f"p{i}", p, GREEDY) for i, p in enumerate(ps)]
    texts = {}
    for cfg_async in (False,):
        eng = LLMEngine(model, EngineConfig(block_size=8, num_blocks=256, num_speculative_tokens=k,
                                            max_queue_delay_us=0, max_seq_len=256,
                                            async_scheduling=cfg_async), tokenizer, eos_token_ids=set())
        texts = {rid: "".join(o.text for o in v) for rid, v in eng.generate(plain).items()}
    stops = [(texts[f"p{i}"][6:9],) for i in range(len(ps))]
    reqs = [EngineRequest(f"s{i}", p, SamplingParams(max_tokens=40, temperature=0.0, stop=st))
            for i, (p, st) in enumerate(zip(ps, stops))]
    got = {}
    for on in (False, True):
        eng = LLMEngine(model, EngineConfig(block_size=8, num_blocks=256, num_speculative_tokens=k,
                                            max_queue_delay_us=0, max_seq_len=256,
                                            async_scheduling=on), tokenizer, eos_token_ids=set())
        outs = eng.generate(reqs)
        got[on] = {rid: (tokens_of(v), "".join(o.text for o in v), v[-1].finish_reason)
                   for rid, v in outs.items()}
        assert eng.stats().kv_blocks_used == 0
        eng.shutdown()
    assert got[True] == got[False]
    for i in range(len(ps)):
        toks, text, reason = got[True][f"s{i}"]
        assert reason is FinishReason.STOP and stops[i][0] not in text
        assert texts[f"p{i}"].startswith(text)


@pytest.mark.parametrize("k", [0, 2])
def test_worker_thread_executor_identical_too(k):
    """The worker-thread executor (the default on CUDA) gives the same outputs on a CPU."""
    model = high_acceptance_model()
    reqs = requests(prompts(16, seed=28), [sampled(i) if i % 2 else GREEDY for i in range(16)])
    ref, got = both(model, k, lambda e: run_staggered(e, reqs, every=1), max_batch_size=16,
                    async_executor="thread")
    assert got == ref


def test_a_worker_process_takes_a_model_of_more_storages_than_a_message_has_descriptors():
    """A model of 1159 storages (30 tiny layers; the 0.5b bench model has 639) handed, as
    loaded, to the worker process: each storage once took a file descriptor of the fork
    server's one message (at most 256), and the worker never started ("too many fds").
    (A worker packs the weights into one storage: a model an engine served before has few.)"""
    from server.model.loading import load_checkpoint
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    path = make_tiny_checkpoint(f"{tempfile.mkdtemp()}/deep", seed=0, num_hidden_layers=30)
    reqs = lambda: requests(prompts(3), SamplingParams(max_tokens=8, temperature=0.0))  # noqa: E731
    outs = []
    for on in (True, False):
        model = load_checkpoint(path)[0].eval()
        tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
        assert len({t.untyped_storage().data_ptr() for t in tensors}) > 256
        eng = make_engine(model, 1, async_scheduling=on, async_executor="process")
        assert (eng.worker is None) is on
        outs.append(run_tokens(eng, reqs()))
        eng.shutdown()
    assert outs[0] == outs[1] and all(len(t) == 8 for t in outs[0].values())
