"""The engine's decode paths on a CUDA device (skipped without one).

Float32 tiny models (tests/engine/helpers.py) copied to the GPU: the static decode/verify
path (``static_decode=True``, the default) must emit exactly what the varlen path emits,
greedy and seeded sampling, MTP off, k=1 and k=2, with prefills landing between decode
steps; and greedy MTP k=1 / k=2 must emit exactly what MTP off emits.  The CPU versions
of these checks are tests/engine/test_static_decode.py and tests/engine/test_lossless.py.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch

from server.engine.protocol import SamplingParams
from tests.engine.helpers import (high_acceptance_model, make_engine, prompts, requests,
                                  run_staggered, tiny_model)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
SEEDED = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=7)
MODELS = {"random": tiny_model, "high_acceptance": high_acceptance_model}


@functools.lru_cache(maxsize=None)
def cuda_model(name: str):
    """A float32 copy on the GPU (the cached CPU model other tests use stays where it is)."""
    return copy.deepcopy(MODELS[name]()).to("cuda").eval()


def test_the_model_is_on_the_gpu():
    model = cuda_model("random")
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in model.parameters())
    eng = make_engine(model, 1, device="cuda")
    assert eng.worker.kv_caches and eng.runtime.decode_path == "static"


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_static_path_emits_what_the_varlen_path_emits_on_cuda(model_name, k, sp):
    model = cuda_model(model_name)
    reqs = lambda: requests(prompts(8, seed=5), sp)                     # noqa: E731
    ref = run_staggered(make_engine(model, k, device="cuda", static_decode=False,
                                    adaptive_speculation=False), reqs(), every=3)
    eng = make_engine(model, k, device="cuda", static_decode=True, adaptive_speculation=False)
    assert eng.runtime.decode_path == "static"
    out = run_staggered(eng, reqs(), every=3)
    assert out == ref
    assert all(len(v) == sp.max_tokens for v in out.values())


@pytest.mark.parametrize("static", [True, False], ids=["static", "varlen"])
@pytest.mark.parametrize("k", [1, 2])
def test_mtp_greedy_emits_what_mtp_off_emits_on_cuda(k, static):
    model = cuda_model("high_acceptance")
    reqs = lambda: requests(prompts(8, seed=9), GREEDY)                 # noqa: E731
    ref = run_staggered(make_engine(model, 0, device="cuda", static_decode=static), reqs(), every=3)
    eng = make_engine(model, k, device="cuda", static_decode=static, adaptive_speculation=False)
    assert run_staggered(eng, reqs(), every=3) == ref
    stats = eng.stats()
    assert stats.num_accepted_tokens > 0
