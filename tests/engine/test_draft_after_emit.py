"""Drafting after the tokens go out (EngineConfig.draft_after_emit, worker/worker.py): a step
returns its verified tokens before its MTP passes run; the passes run in finish_step (the
engine loop calls it after handing the outputs out) or first thing in the next step.

The outputs must not change: the same passes run on the same inputs, in the same order
relative to every forward."""
from __future__ import annotations

import pytest

from server.engine.protocol import FinishReason, SamplingParams
from tests.engine.helpers import (high_acceptance_model, make_engine, prompts, requests,
                                  run_staggered)

MIXED = ([SamplingParams(max_tokens=24, temperature=0.0)] * 4
         + [SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=50 + i) for i in range(3)]
         + [SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.2)])


def _run(engine, reqs, finish_each_step: bool) -> dict[str, list[int]]:
    """Staggered arrivals (prefills among decodes); with ``finish_each_step`` the caller
    runs the draft passes after each step as the engine loop does, else the next step
    runs them."""
    outs = {r.request_id: [] for r in reqs}
    pending, step = list(reqs), 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            engine.add_request(pending.pop(0))
        for o in engine.step():
            outs[o.request_id].extend(o.token_ids)
        if finish_each_step:
            engine.finish_step()
        step += 1
    return outs


@pytest.mark.parametrize("k", [1, 2])
def test_outputs_identical_with_drafting_after_the_tokens(k):
    model = high_acceptance_model()
    reqs = requests(prompts(8, seed=5), MIXED)
    ref_engine = make_engine(model, k, enable_prefix_cache=True)
    ref = run_staggered(ref_engine, reqs, every=2)
    for finish in (True, False):
        eng = make_engine(model, k, enable_prefix_cache=True, draft_after_emit=True)
        assert _run(eng, reqs, finish) == ref, (k, finish)
        assert eng.stats().num_accepted_tokens > 0
    # the same prompts again: prefix-cache hits, whose MTP KV was written after the fact
    again = requests(prompts(8, seed=5), MIXED, prefix="again")
    eng2 = make_engine(model, k, enable_prefix_cache=True, draft_after_emit=True)
    _run(eng2, reqs, True)
    second = _run(eng2, again, True)
    assert [second[f"again{i}"] for i in range(8)] == [ref[f"r{i}"] for i in range(8)]


def test_a_step_returns_its_tokens_before_its_draft_pass(monkeypatch):
    model = high_acceptance_model()
    calls: list[str] = []
    for name in ("mtp_forward", "mtp_write_kv"):       # a draft pass, or k=0's KV write
        def spy(self, *args, _real=getattr(type(model), name), **kwargs):
            calls.append("mtp")
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(type(model), name, spy)
    eng = make_engine(model, 1, draft_after_emit=True, adaptive_speculation=False)
    eng.add_request(requests(prompts(1, seed=9), SamplingParams(max_tokens=8, temperature=0.0))[0])
    for step in range(3):
        before = len(calls)
        outs = eng.step()
        assert outs and outs[0].token_ids            # tokens out ...
        assert len(calls) == before                  # ... before the MTP layer ran
        eng.finish_step()
        # The draft pass (k=1): on the prompt, its KV write and the layer on the last row.
        assert len(calls) == before + (2 if step == 0 else 1)
    eng_inline = make_engine(model, 1, adaptive_speculation=False)
    eng_inline.add_request(requests(prompts(1, seed=9), SamplingParams(max_tokens=8,
                                                                        temperature=0.0))[0])
    before = len(calls)
    eng_inline.step()
    assert len(calls) == before + 2                  # the default: drafted inside the step


def test_a_failed_draft_pass_fails_its_requests_in_the_next_step(monkeypatch):
    model = high_acceptance_model()
    eng = make_engine(model, 1, draft_after_emit=True, adaptive_speculation=False)
    ps = prompts(3, seed=13)
    reqs = requests(ps[:2], SamplingParams(max_tokens=16, temperature=0.0))
    for r in reqs:
        eng.add_request(r)
    eng.step()
    eng.finish_step()
    real = type(model).mtp_forward

    def broken(self, *args, **kwargs):
        raise RuntimeError("injected")
    monkeypatch.setattr(type(model), "mtp_forward", broken)
    assert all(not o.finished for o in eng.step())   # tokens out; the draft pass is next
    eng.finish_step()                                # fails, and is logged
    monkeypatch.setattr(type(model), "mtp_forward", real)
    outs = eng.step()
    failed = {o.request_id: o for o in outs if o.finished}
    assert set(failed) == {"r0", "r1"}
    assert all(o.finish_reason is FinishReason.ERROR and "draft pass failed" in o.error
               for o in failed.values())
    assert eng.stats().num_running == 0 and eng.stats().num_waiting == 0
    # the engine goes on: a new request gets what a fresh engine gives it
    late = requests([ps[2]], SamplingParams(max_tokens=16, temperature=0.0), prefix="late")
    fresh = make_engine(model, 1)
    assert run_staggered(eng, late) == run_staggered(fresh, late)
