"""Prompt logprobs (SamplingParams.prompt_logprobs) against a transformers forward.

The engine computes them from its own prefill; transformers' DeepseekV3ForCausalLM on the
same tiny checkpoint is the reference (as in tests/model/test_vs_transformers.py).  A
second request sharing a cached prefix must still get every position: the scheduler skips
the prefix cache for it.  MTP on (k=1) must not change them.
"""
from __future__ import annotations

import logging

import pytest
import torch

from server.engine.protocol import EngineRequest, SamplingParams
from server.model.loading import load_checkpoint
from server.testing.tiny_checkpoint import make_tiny_checkpoint
from tests.engine.helpers import make_engine

transformers = pytest.importorskip("transformers")
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("plp"), seed=1, n_group=2, topk_group=1)
    model, _ = load_checkpoint(path, dtype=torch.float32)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    return model.eval(), hf


def _reference(hf, ids: list[int], top: int):
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)     # [n, V]
    chosen = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return chosen, lp[:-1].topk(top, -1)


@pytest.mark.parametrize("k", [0, 1])
def test_prompt_logprobs_match_transformers_with_a_cached_prefix(checkpoint, k):
    model, hf = checkpoint
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 512, (24,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 9)]
    eng = make_engine(model, k, enable_prefix_cache=True)
    sp = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3)
    got = {}
    for i, p in enumerate(prompts):       # one after the other: the second hits the cache
        outs = eng.generate([EngineRequest(f"p{i}", p, sp)])[f"p{i}"]
        firsts = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        assert len(firsts) == 1 and outs[0].prompt_logprobs is not None
        got[i] = firsts[0]
    assert eng.stats().prefix_cache_hits == 0       # it did not take the cached blocks
    for i, p in enumerate(prompts):
        items = got[i]
        assert len(items) == len(p) and items[0] is None
        chosen, (top_lp, top_ids) = _reference(hf, p, 3)
        ours = torch.tensor([it.logprob for it in items[1:]])
        assert [it.token_id for it in items[1:]] == p[1:]
        assert torch.allclose(ours, chosen, atol=TOL), (ours - chosen).abs().max()
        for j, it in enumerate(items[1:]):
            assert [t for t, _ in it.top] == top_ids[j].tolist()
            assert torch.allclose(torch.tensor([l for _, l in it.top]), top_lp[j], atol=TOL)


def test_no_prompt_logprobs_unless_asked(checkpoint):
    model, _ = checkpoint
    eng = make_engine(model, 1)
    outs = eng.generate([EngineRequest("a", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0))])
    assert all(o.prompt_logprobs is None for o in outs["a"])


@pytest.mark.slow
def test_prompt_logprobs_cross_the_worker_process(checkpoint):
    """Asynchronous scheduling on a CPU runs the worker in its own process: the prompt
    logprobs come back through the pickled step output, unchanged."""
    model, _ = checkpoint
    p = list(range(5, 30))
    sp = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    got = []
    for on in (False, True):
        eng = make_engine(model, 1, async_scheduling=on)
        try:
            outs = eng.generate([EngineRequest("a", p, sp)])["a"]
        finally:
            eng.shutdown()
        got.append([(it.token_id, it.logprob, it.top) if it else None for it in outs[0].prompt_logprobs])
    assert got[0] == got[1] and len(got[0]) == len(p)
