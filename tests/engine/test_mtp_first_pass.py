"""A prompt's first MTP pass in two parts (server/engine/spec/proposer.py, module docstring): every
position's MTP KV written without running the layer, then the layer on the last position
alone.  It must leave the MTP KV and the first draft the whole-layer pass leaves, and
outputs stay those of MTP off (the lossless tests elsewhere run it on every prompt of at
least ``SPLIT_FIRST_PASS_ROWS`` tokens; this one compares the two forms directly).
"""
from __future__ import annotations

import pytest
import torch

from server.engine.spec import proposer
from server.engine.protocol import EngineRequest, SamplingParams
from server.model.deepseek_v3 import DeepseekV3ForCausalLM
from tests.engine.helpers import high_acceptance_model, make_engine, prompts, requests, run_tokens

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _first_step(model, prompt: list[int], split: bool, static: bool, monkeypatch):
    """After the prefill step: the prompt's MTP KV rows, the held first draft, and the
    rows each MTP-layer call got."""
    monkeypatch.setattr(proposer, "SPLIT_FIRST_PASS_ROWS", 8 if split else 10 ** 9)
    calls: list[tuple[str, int]] = []
    write, forward = DeepseekV3ForCausalLM.mtp_write_kv, DeepseekV3ForCausalLM.mtp_forward

    def spied_write(self, input_ids, *a, **kw):
        calls.append(("write", input_ids.shape[0]))
        return write(self, input_ids, *a, **kw)

    def spied_forward(self, input_ids, *a, **kw):
        calls.append(("forward", input_ids.shape[0]))
        return forward(self, input_ids, *a, **kw)

    monkeypatch.setattr(DeepseekV3ForCausalLM, "mtp_write_kv", spied_write)
    monkeypatch.setattr(DeepseekV3ForCausalLM, "mtp_forward", spied_forward)
    eng = make_engine(model, 1, static_decode=static, adaptive_speculation=False)
    eng.add_request(EngineRequest("r", prompt, GREEDY))
    eng.step()
    kv = eng.worker.kv_rows("r", range(len(prompt)), -1)
    ids, row, _q = eng.worker.proposer.inner._held["r"]
    monkeypatch.setattr(DeepseekV3ForCausalLM, "mtp_write_kv", write)
    monkeypatch.setattr(DeepseekV3ForCausalLM, "mtp_forward", forward)
    return kv, ids[row].tolist(), calls


@pytest.mark.parametrize("static", [False, True], ids=["varlen", "static"])
def test_a_prompts_split_first_pass_leaves_the_kv_and_draft_of_the_whole_pass(static, monkeypatch):
    model = high_acceptance_model()
    prompt = prompts(1, seed=3, lo=30, hi=31)[0]
    kv_split, draft_split, calls_split = _first_step(model, prompt, True, static, monkeypatch)
    kv_whole, draft_whole, calls_whole = _first_step(model, prompt, False, static, monkeypatch)
    assert calls_split == [("write", 30), ("forward", 1)]      # the layer ran on one row
    assert calls_whole == [("forward", 30)]
    torch.testing.assert_close(kv_split, kv_whole, rtol=1e-5, atol=1e-6)
    assert draft_split == draft_whole


def test_split_first_passes_stay_lossless_across_prompt_lengths():
    """Prompts on both sides of the threshold, then again with the prefix cache (a cached
    prefix leaves a shorter first pass, split or not on its own length), against MTP off."""
    model = high_acceptance_model()
    ps = prompts(8, seed=21, lo=2, hi=60)
    ref = run_tokens(make_engine(model, 0), requests(ps, GREEDY))
    for k in (1, 2):
        eng = make_engine(model, k, adaptive_speculation=False, enable_prefix_cache=True)
        assert run_tokens(eng, requests(ps, GREEDY)) == ref
        # The same prompts again: their prefixes are cached now.
        assert run_tokens(eng, requests(ps, GREEDY, prefix="again")) == \
            {f"again{i}": v for i, v in enumerate(ref.values())}
