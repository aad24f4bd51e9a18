"""Greedy MTP decoding is lossless: k=1 and k=2 emit exactly what MTP off emits; so does
seeded sampling (coupled verification, sample/sampler.py).

32 prompts x 64 new tokens, on the tiny random checkpoint (acceptance near zero: reject
paths) and on a high-acceptance variant (accept and bonus paths), run 8 at a time with
staggered arrivals (prefills mixed into running decode/verify batches), and the first 16
of them one at a time (the same check per prompt; the batches cover all 32).
ENGINE_TESTS_QUICK=1 limits the one-at-a-time runs to the first 8 prompts.
"""
from __future__ import annotations

import functools
import os

import pytest

from server.engine.protocol import SamplingParams
from tests.engine.helpers import (high_acceptance_model, make_engine, prompts, requests,
                                  run_staggered, run_tokens, tiny_model)

NUM_PROMPTS, NEW_TOKENS = 32, 64
ONE_AT_A_TIME = 8 if os.environ.get("ENGINE_TESTS_QUICK") else 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
MODELS = {"random": tiny_model, "high_acceptance": high_acceptance_model}
pytestmark = pytest.mark.slow          # about 90 s on 2 CPU cores


@functools.lru_cache(maxsize=None)
def reference(model_name: str) -> dict[str, list[int]]:
    """MTP off, 8 at a time."""
    eng = make_engine(MODELS[model_name](), 0)
    return run_staggered(eng, requests(prompts(NUM_PROMPTS), GREEDY), every=2)


def one_at_a_time(model_name: str, k: int) -> tuple[dict[str, list[int]], object]:
    eng = make_engine(MODELS[model_name](), k)
    out: dict[str, list[int]] = {}
    for r in requests(prompts(NUM_PROMPTS), GREEDY)[:ONE_AT_A_TIME]:
        out.update(run_tokens(eng, [r]))
    return out, eng


@pytest.mark.parametrize("model_name", list(MODELS))
def test_reference_is_batch_invariant(model_name):
    ref = reference(model_name)
    assert all(len(v) == NEW_TOKENS for v in ref.values())
    alone, _ = one_at_a_time(model_name, 0)
    assert alone == {rid: ref[rid] for rid in alone}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_mtp_greedy_identical_in_mixed_batches(model_name, k):
    eng = make_engine(MODELS[model_name](), k)
    out = run_staggered(eng, requests(prompts(NUM_PROMPTS), GREEDY), every=2)
    ref = reference(model_name)
    mismatched = [rid for rid in ref if out[rid] != ref[rid]]
    assert not mismatched, mismatched
    st = eng.stats()
    # adaptive speculation (on by default) may draft fewer than k on some steps
    assert st.num_drafts > 0 and st.num_drafts <= st.num_draft_tokens <= k * st.num_drafts
    if model_name == "high_acceptance":
        assert st.acceptance_rate > 0.5, st
        assert all(n > 0 for n in st.accepted_per_position)
        assert st.num_steps < 0.75 * NUM_PROMPTS * NEW_TOKENS / 8 * 1.5
    assert st.kv_blocks_used == 0


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_mtp_greedy_identical_one_at_a_time(model_name, k):
    out, eng = one_at_a_time(model_name, k)
    ref = reference(model_name)
    assert out == {rid: ref[rid] for rid in out}
    if model_name == "high_acceptance":
        assert eng.stats().acceptance_rate > 0.5


def test_greedy_with_penalties_counts_accepted_drafts_as_context():
    """Repetition/frequency penalties see the accepted draft prefix at every verified row."""
    model = high_acceptance_model()
    sp = SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3,
                        frequency_penalty=0.2, presence_penalty=0.1, logit_bias={5: 2.0})
    ps = prompts(8, seed=3)
    ref = run_tokens(make_engine(model, 0), requests(ps, sp))
    for k in (1, 2):
        eng = make_engine(model, k)
        assert run_tokens(eng, requests(ps, sp)) == ref
        assert eng.stats().num_accepted_tokens > 0


@pytest.mark.parametrize("variant", [{"yarn": True}, {"q_lora_rank": None}, {"fp8": True}])
def test_mtp_greedy_identical_on_checkpoint_variants(variant, tmp_path):
    """YaRN RoPE with long prompts (positions past the original context), no q-LoRA, FP8."""
    from server.model.loading import load_checkpoint
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    model, _ = load_checkpoint(make_tiny_checkpoint(tmp_path / "ckpt", seed=1, **variant))
    model.eval()
    ps = prompts(6, seed=2, lo=20, hi=300)
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    ref = run_tokens(make_engine(model, 0), requests(ps, sp))
    for k in (1, 2):
        assert run_tokens(make_engine(model, k), requests(ps, sp)) == ref


@pytest.mark.parametrize("model_name", list(MODELS))
def test_seeded_sampling_identical_to_mtp_off(model_name):
    """Seeded sampled requests (verified by coupling) next to greedy and unseeded ones, in
    mixed staggered batches: k=1 and k=2 emit token for token what MTP off emits."""
    ps = prompts(16, seed=21)
    sp = [SamplingParams(max_tokens=32, temperature=0.6 + 0.05 * (i % 8), top_p=0.9 if i % 3 else 1.0,
                         top_k=-1 if i % 2 else 40, seed=1000 + i) for i in range(12)]
    sp += [GREEDY, GREEDY, SamplingParams(max_tokens=32, temperature=0.8),
           SamplingParams(max_tokens=32, temperature=0.8)]
    reqs = requests(ps, sp)
    ref = run_staggered(make_engine(MODELS[model_name](), 0), reqs, every=2)
    for k in (1, 2):
        eng = make_engine(MODELS[model_name](), k)
        out = run_staggered(eng, reqs, every=2)
        same = [f"r{i}" for i in range(14)]            # seeded and greedy
        assert {r: out[r] for r in same} == {r: ref[r] for r in same}, k
        if model_name == "high_acceptance":
            assert eng.stats().num_accepted_tokens > 0
