"""Rank groups on the compiled step.  Its own file so that the suite can run it last
(tests/conftest.py): by then the graphs it needs were made in the background."""
from __future__ import annotations

import dataclasses

import pytest

from server.engine.core import LLMEngine
from server.model.loading import inspect_checkpoint
from tests.engine.helpers import run_tokens
from tests.engine.test_parallel import BASE, DEMO, _requests, _single, parallel_config

pytestmark = [pytest.mark.slow, pytest.mark.demo]


def test_tp2_ranks_serve_the_compiled_step_identical(warm_compile):
    """The collectives are operators inside the graphs (model/collectives.py), the tp ranks
    share one graph set; tokens equal one process's (greedy and seeded).  MTP off: its six
    graphs (a decode window, lone and batched, and the prompt window, dense and MoE) carry
    every collective a verify window's graphs do, and the four of those windows would cost
    each clean checkout's suite ~40 s of compile (uncompiled rank groups are checked at k=1
    and k=2 in test_parallel.py).  warm_compile (tests/conftest.py) made the graphs in the
    background; cold, each rank compiles them itself."""
    cfg = dataclasses.replace(BASE, num_speculative_tokens=0, compile="on",
                              parallel=parallel_config("tp2"))
    engine = LLMEngine(inspect_checkpoint(str(DEMO)), cfg, eos_token_ids=set())
    try:
        assert engine.runtime.decode_path == "compiled"
        out = run_tokens(engine, _requests(engine.runtime.vocab_size))
    finally:
        engine.shutdown()
    assert out == _single(str(DEMO), 0)
