"""The compiled static step (torch.compile / Inductor on CPU) against the uncompiled one.

Float32 outputs must be identical token for token with the compile on and off: greedy and
seeded sampling, MTP off, k=1 and k=2, with prefills landing between decode steps.  After
the start-up warm-up nothing recompiles (a recompile in serving would stall every request
for seconds).  The first compile on a machine takes up to a minute; later ones read
Inductor's on-disk cache.
"""
from __future__ import annotations

import functools

import pytest
import torch

from server.engine.protocol import SamplingParams
from server.model.loader import load_checkpoint
from tests.api.daemon_proc import DEMO_MODEL
from tests.engine.helpers import make_engine, prompts, requests, run_staggered

pytestmark = [pytest.mark.slow, pytest.mark.demo]

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
SEEDED = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=3)


@functools.lru_cache(maxsize=None)
def _models():
    """Two instances of the demo model: compiling one must not change the other."""
    eager, _ = load_checkpoint(DEMO_MODEL)
    compiled, _ = load_checkpoint(DEMO_MODEL)
    return eager.eval(), compiled.eval()


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_compiled_step_emits_what_the_plain_step_emits(k):
    eager, compiled = _models()
    reqs = lambda sp: requests(prompts(8, seed=k, vocab=1000), sp)      # noqa: E731
    eng = make_engine(compiled, k, compile="on", max_batch_size=16, adaptive_speculation=False)
    assert eng.runtime.decode_path == "compiled"
    graphs = _graphs()
    for sp in (GREEDY, SEEDED):
        ref = run_staggered(make_engine(eager, k, max_batch_size=16, adaptive_speculation=False),
                            reqs(sp), every=2)
        out = run_staggered(eng, reqs(sp), every=2)
        assert out == ref, sp
    assert _graphs() == graphs, "the compiled step recompiled while serving"
    if k:
        assert eng.stats().num_accepted_tokens > 0


def test_compile_is_refused_where_the_static_path_does_not_apply():
    """An int8 KV cache keeps the varlen path: nothing is compiled, the engine says so."""
    eager, _ = _models()
    eng = make_engine(eager, 1, compile="on", kv_cache_dtype="int8")
    assert eng.runtime.decode_path == "eager"
    assert eng.runtime.compile_seconds is None
