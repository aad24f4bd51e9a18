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


def test_daemon_serves_the_compiled_step_and_answers_as_the_uncompiled_one(tmp_path):
    """The default daemon path: $MTP_SERVE_COMPILE on, graphs loaded or compiled before the
    ports open; /v1/status says so; greedy chat answers equal the uncompiled daemon's."""
    import openai

    from tests.api.daemon_proc import Daemon, make_config
    answers = []
    for compile_env in ("0", "1"):
        (tmp_path / compile_env).mkdir()
        cfg = make_config(tmp_path / compile_env, DEMO_MODEL,
                          model={"plugin_params": '{"plugin_type":"mtp","num_speculative_tokens":1}'})
        d = Daemon(cfg, env={"MTP_SERVE_COMPILE": compile_env}).start(timeout_s=300)
        try:
            runtime = d.status()["runtime"]
            assert runtime["decode_path"] == ("compiled" if compile_env == "1" else "static")
            assert (runtime["compile_seconds"] is not None) == (compile_env == "1")
            client = openai.OpenAI(base_url=d.base + "/v1", api_key="x", max_retries=0)
            answers.append([client.chat.completions.create(
                model=client.models.list().data[0].id, temperature=0, max_tokens=48,
                messages=[{"role": "user", "content": q}]).choices[0].message.content
                for q in ("What's the weather like in Paris?", "Tell me about the sea.")])
        finally:
            assert d.terminate() == 0
    assert answers[0] == answers[1]
