"""The compiled static step (torch.compile / Inductor on CPU) against the uncompiled one.

Float32 outputs must be identical token for token with the compile on and off: greedy and
seeded sampling, MTP off and k=1, with prefills landing between decode steps.  After
the start-up warm-up nothing recompiles (a recompile in serving would stall every request
for seconds).  The first compile on a machine takes up to a minute; later ones read
Inductor's on-disk cache.
"""
from __future__ import annotations

import functools

import pytest
import torch

from server.engine.protocol import SamplingParams
from server.model.loading import load_checkpoint
from server.testing.daemon import DEMO_MODEL
from tests.engine.helpers import make_engine, prompts, requests, run_staggered

# warm_compile (tests/conftest.py): the graphs below started compiling in the background
# when the session began.
pytestmark = [pytest.mark.slow, pytest.mark.demo, pytest.mark.usefixtures("warm_compile")]

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


# k=1 first: its graphs (windows of 1-2 tokens) include every one MTP off takes, which then
# loads them instead of compiling again.  (k=2 took 4 more graphs, ~25 s of each clean
# checkout's cold compile, for windows that differ from k=1's only in a static size; k=2
# is checked uncompiled in test_lossless.py and test_demo_acceptance.py.)
@pytest.mark.parametrize("k", [1, 0])
def test_compiled_step_emits_what_the_plain_step_emits(k, monkeypatch):
    """Also: (k + 1)-token windows, of a lone sequence and of batches, take the graphs made
    for exactly that length (static sizes), the gathered or the dense MoE by their tokens."""
    from server.model.static_decode import StaticDecoder
    eager, compiled = _models()
    reqs = lambda sp: requests(prompts(8, seed=k, vocab=1000), sp)      # noqa: E731
    eng = make_engine(compiled, k, compile="on", max_batch_size=16, adaptive_speculation=False)
    assert eng.runtime.decode_path == "compiled"
    by_graph = {id(g): key for key, g in compiled.static_decoder._graphs.items()}
    used = set()
    real = StaticDecoder._graph
    def spy(self, kind, meta):
        fn, windowed, graph = real(self, kind, meta)
        if self is compiled.static_decoder:        # not the reference engine's model
            used.add(by_graph.get(id(fn), ("plain", kind, meta.query_len, meta.num_seqs)))
        return fn, windowed, graph
    monkeypatch.setattr(StaticDecoder, "_graph", spy)
    graphs = _graphs()
    flat = compiled.static_decoder.flat_calls
    for sp in (GREEDY, SEEDED):
        ref = run_staggered(make_engine(eager, k, max_batch_size=16, adaptive_speculation=False),
                            reqs(sp), every=2)
        out = run_staggered(eng, reqs(sp), every=2)
        assert out == ref, sp
    assert _graphs() == graphs, "the compiled step recompiled while serving"
    # A lone sequence's window reads only its chosen experts (the gathered MoE) while its
    # tokens x top-k fit the experts; batches past that take the dense MoE.
    lone = "gmoe" if k + 1 <= compiled.static_decoder._gather_max_tokens else "moe"
    assert {(lone, f"q{k + 1}", True), ("moe", f"q{k + 1}", False)} <= used, used
    assert not [u for u in used if u[0] == "plain"], used
    # Every (graph, layer) call after its first went below Dynamo's bytecode
    # (model/flat_calls.py), and the tokens above are the plain step's.
    assert flat.learned > 0 and flat.refused == 0, flat.reasons
    # ... and below AOTAutograd's and Inductor's wrappers too, straight into the graphs'
    # generated code (a C++ wrapper's handed its numbers as tensors).
    from server.engine.worker import compile_step
    learned = [c for c in flat._calls.values() if c is not None]
    wrapped_in_cpp = compile_step.cpp_wrapper(torch.device("cpu"))
    assert learned and all(c.direct is not None and c.scalars == wrapped_in_cpp for c in learned)
    if k:
        assert eng.stats().num_accepted_tokens > 0


def test_lone_prefills_take_the_compiled_graphs_and_emit_what_the_varlen_path_emits(monkeypatch):
    """A step prefilling one request (alone, or beside running decodes) runs its prompt
    through the lone-sequence graphs: same tokens as the uncompiled engine (varlen
    prefills), also after a cached prefix, with prompt logprobs equal to float precision."""
    from server.engine.worker import runner
    used = []
    real = runner.ModelRunner._static_prefill
    monkeypatch.setattr(runner.ModelRunner, "_static_prefill",
                        lambda self, st, s0, n: used.append((s0, n)) or real(self, st, s0, n))
    eager, compiled = _models()
    shared = prompts(1, seed=11, lo=40, hi=41, vocab=1000)[0]
    ps = [shared + p for p in prompts(5, seed=12, lo=3, hi=60, vocab=1000)]
    lp = SamplingParams(max_tokens=16, temperature=0.0, prompt_logprobs=2)
    for k in (0, 1):
        outs = []
        for model, mode in ((eager, "off"), (compiled, "on")):
            eng = make_engine(model, k, compile=mode, max_batch_size=16, adaptive_speculation=False,
                              enable_prefix_cache=True)
            run = run_staggered(eng, requests(ps, [GREEDY, SEEDED, GREEDY, SEEDED, GREEDY]), every=4)
            from server.engine.protocol import EngineRequest
            eng.add_request(EngineRequest("lp", ps[0], lp))
            got = []
            while eng.has_unfinished():
                got += [o for o in eng.step() if o.prompt_logprobs]
            outs.append((run, got[0].prompt_logprobs))
        (ref, ref_lp), (out, out_lp) = outs
        assert out == ref, k
        assert [e.token_id if e else None for e in out_lp] == [e.token_id if e else None for e in ref_lp]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(out_lp[1:], ref_lp[1:])) < 1e-4
    assert used and any(s0 > 0 for s0, _ in used), used     # fresh prompts and cached prefixes


def test_a_prefill_takes_the_compiled_graphs_only_while_its_dense_experts_waste_little(monkeypatch):
    """The prompt graphs compute the demo model's experts densely: the multiply-adds spent
    on unchosen experts (StaticDecoder.dense_moe_waste, per token) bound the prompts they
    take (ModelRunner.STATIC_PREFILL_WASTE); longer prompts take the varlen path, and
    either way the tokens are the uncompiled engine's."""
    from server.engine.worker import runner
    eager, compiled = _models()
    cfg = compiled.config
    moe_layers = sum(1 for layer in compiled.model.layers if hasattr(layer.mlp, "gate"))
    per_token = 3 * cfg.hidden_size * cfg.moe_intermediate_size * \
        (cfg.n_routed_experts - cfg.num_experts_per_tok) * moe_layers
    assert compiled.static_decoder.dense_moe_waste == pytest.approx(per_token)
    used = []
    real = runner.ModelRunner._static_prefill
    monkeypatch.setattr(runner.ModelRunner, "_static_prefill",
                        lambda self, st, s0, n: used.append(n) or real(self, st, s0, n))
    monkeypatch.setattr(runner.ModelRunner, "STATIC_PREFILL_WASTE", 30 * per_token)
    ps = [prompts(1, seed=20 + i, lo=n, hi=n + 1, vocab=1000)[0] for i, n in enumerate((12, 30, 31, 70))]
    outs = []
    for model, mode in ((eager, "off"), (compiled, "on")):
        eng = make_engine(model, 0, compile=mode, max_batch_size=4)
        outs.append([run_staggered(eng, requests([p], GREEDY)) for p in ps])     # one at a time
    assert outs[1] == outs[0]
    assert sorted(used) == [12, 30], used
    # A decoder that takes no prompts (a 16-bit model on a CPU without 16-bit
    # instructions: its prompt graph would convert every weight to float32 on each call)
    # neither compiles the prompt window nor sends a prompt there.
    from server.engine.worker.compile_step import graph_plan
    from server.model.static_decode import StaticDecoder
    assert any(g[2] == "many" for g in graph_plan(compiled, 2))
    monkeypatch.setattr(StaticDecoder, "takes_prompts", property(lambda self: False))
    assert [g for g in graph_plan(compiled, 2) if g[2] == "many"] == []
    eng = make_engine(compiled, 0, compile="on", max_batch_size=4)
    assert run_staggered(eng, requests([ps[0]], GREEDY)) == outs[0][0]
    assert sorted(used) == [12, 30], used


def test_compile_is_refused_where_the_static_path_does_not_apply():
    """Where the static step is off (as for striped sequence-parallel caches) the varlen
    path serves: nothing is compiled, the engine says so.  (An int8 KV cache takes the
    static step since issue 60: tests/model/test_latent_cache.py.)"""
    eager, _ = _models()
    eng = make_engine(eager, 1, compile="on", kv_cache_dtype="int8", static_decode=False)
    assert eng.runtime.decode_path == "eager"
    assert eng.runtime.compile_seconds is None


def _fresh_demo_model():
    model, _ = load_checkpoint(DEMO_MODEL)
    return model.eval()


def _run_one(eng, prompt: list[int], sp: SamplingParams, rid: str) -> list[int]:
    from server.engine.protocol import EngineRequest
    eng.add_request(EngineRequest(rid, prompt, sp))
    out: list[int] = []
    while eng.has_unfinished():
        for o in eng.step():
            out.extend(o.token_ids)
    return out


def test_background_graphs_are_adopted_between_steps_and_change_no_token(tmp_path, monkeypatch):
    """$MTP_SERVE_COMPILE_WAIT=0, the daemon's default: the engine serves the static step
    uncompiled while a child process compiles the graphs its cache lacks, then switches
    between two steps.  Tokens equal the uncompiled engine's before, across and after the
    switch, for a lone sequence and a batch."""
    import shutil
    import time

    from server.engine.worker import compile_step
    eager, _ = _models()
    model = _fresh_demo_model()
    warm = compile_step.cache_dir(model, torch.device("cpu"))
    monkeypatch.setenv(compile_step.CACHE_ENV, str(tmp_path / "cache"))
    folder = compile_step.cache_dir(model, torch.device("cpu"))
    # The graphs the tests above made, but for one decode window: a child compiles it (the
    # first round), the second round (the prompt windows) loads from the cache.
    lacking = ("dense-q1-lone.bin",)
    if warm.is_dir():
        shutil.copytree(warm, folder)
        for name in lacking:
            (folder / name).unlink(missing_ok=True)
    eng = make_engine(model, 1, compile="on", compile_wait=False, max_batch_size=16,
                      adaptive_speculation=False)
    assert (eng.runtime.compile_state, eng.runtime.decode_path) == ("compiling", "static")
    ref_eng = make_engine(eager, 1, max_batch_size=16, adaptive_speculation=False)
    ps = prompts(3, seed=7, vocab=1000)
    refs = [_run_one(ref_eng, p, sp, f"ref{i}{j}") for i, p in enumerate(ps) for j, sp in enumerate((GREEDY, SEEDED))]
    served_before, deadline = 0, time.monotonic() + 600
    while eng.runtime.compile_state == "compiling":
        assert time.monotonic() < deadline, "the background graphs were never adopted"
        i = served_before % len(refs)
        assert _run_one(eng, ps[i // 2], (GREEDY, SEEDED)[i % 2], f"b{served_before}") == refs[i]
        served_before += 1
        time.sleep(0.5)         # the child's compile gets the core (the suite runs on two)
    assert served_before > 0
    assert (eng.runtime.compile_state, eng.runtime.decode_path) == ("compiled", "compiled")
    assert eng.runtime.compile_seconds > 0
    assert all((folder / name).is_file() for name in lacking)
    for i, ref in enumerate(refs):
        assert _run_one(eng, ps[i // 2], (GREEDY, SEEDED)[i % 2], f"a{i}") == ref
    batch = run_staggered(eng, requests(ps, GREEDY, prefix="c"), every=2)
    assert [batch[f"c{i}"] for i in range(len(ps))] == refs[0::2]


def test_a_failed_background_compile_leaves_the_static_step_serving(monkeypatch):
    from server.engine.worker import compile_step

    def broken(self):
        raise RuntimeError("no C++ compiler here")
    monkeypatch.setattr(compile_step.BackgroundGraphs, "_run", broken)
    eager, _ = _models()
    eng = make_engine(_fresh_demo_model(), 1, compile="on", compile_wait=False,
                      adaptive_speculation=False)
    ref = _run_one(make_engine(eager, 1, adaptive_speculation=False), [5, 6, 7, 8], GREEDY, "r")
    assert _run_one(eng, [5, 6, 7, 8], GREEDY, "x") == ref
    assert (eng.runtime.compile_state, eng.runtime.decode_path) == ("failed", "static")
    assert _run_one(eng, [5, 6, 7, 8], GREEDY, "y") == ref


def test_daemon_serves_the_compiled_step_and_answers_as_the_uncompiled_one(tmp_path):
    """The default daemon path: $MTP_SERVE_COMPILE on, the ports open at once while the
    graphs load (or compile) in the background; /v1/status shows the switch; greedy chat
    answers equal the uncompiled daemon's before and after it."""
    import time

    import openai

    from server.testing.daemon import Daemon, make_config
    questions = ("What's the weather like in Paris?", "Tell me about the sea.")
    answers = []
    for compile_env in ("0", "1"):
        (tmp_path / compile_env).mkdir()
        cfg = make_config(tmp_path / compile_env, DEMO_MODEL,
                          model={"plugin_params": '{"plugin_type":"mtp","num_speculative_tokens":1}'})
        d = Daemon(cfg, env={"MTP_SERVE_COMPILE": compile_env}).start(timeout_s=300)
        try:
            client = openai.OpenAI(base_url=d.base + "/v1", api_key="x", max_retries=0)
            model = client.models.list().data[0].id

            def ask() -> list[str | None]:
                return [client.chat.completions.create(
                    model=model, temperature=0, max_tokens=48,
                    messages=[{"role": "user", "content": q}]).choices[0].message.content
                    for q in questions]
            answers.append(ask())
            runtime = d.status()["runtime"]
            if compile_env == "0":
                assert (runtime["decode_path"], runtime["compile_state"]) == ("static", "off")
                assert runtime["compile_seconds"] is None
                continue
            deadline = time.monotonic() + 600
            while runtime["compile_state"] == "compiling" and time.monotonic() < deadline:
                answers.append(ask())
                runtime = d.status()["runtime"]
            assert (runtime["decode_path"], runtime["compile_state"]) == ("compiled", "compiled")
            assert runtime["compile_seconds"] is not None
            answers.append(ask())
        finally:
            assert d.terminate() == 0
    assert all(a == answers[0] for a in answers[1:]), answers


def test_an_idle_engine_takes_up_the_background_outcome_without_a_request(monkeypatch):
    """The worker switches between steps; an engine nobody calls takes none, so the loop
    polls it while idle: /v1/status must not say "compiling" until the first request."""
    import threading
    import time

    from server.engine.worker import compile_step
    from server.engine.front.async_engine import EngineLoop

    def broken(self):
        raise RuntimeError("no C++ compiler here")
    monkeypatch.setattr(compile_step.BackgroundGraphs, "_run", broken)
    eng = make_engine(_fresh_demo_model(), 1, compile="on", compile_wait=False,
                      adaptive_speculation=False)
    assert eng.runtime.compile_state == "compiling"
    delivered: list[list] = []
    loop = EngineLoop(eng, delivered.append, lambda *a: None, lambda *a: None)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while eng.runtime.compile_state == "compiling":
            assert time.monotonic() < deadline, "the idle engine never took up the outcome"
            time.sleep(0.05)
    finally:
        loop.stop()
        thread.join(10)
    assert (eng.runtime.compile_state, eng.runtime.decode_path) == ("failed", "static")
    assert delivered and delivered[0] == []        # the change was sent on (engine_process)
    assert eng.stats().num_requests_finished == 0


def test_a_compile_child_traces_the_tensor_dtypes_the_serving_model_has(tmp_path):
    """A bf16 checkpoint keeps its router in float32; graphs compiled in the background
    were traced on a model cast to bf16 whole, and answered token 0 at every position
    once adopted (nothing checks dtypes at call time)."""
    from server.engine.worker.compile_child import empty_model, tensor_dtypes
    from server.model.loading import load_checkpoint
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    model, _ = load_checkpoint(make_tiny_checkpoint(tmp_path / "bf16", dtype="bfloat16"))
    dtypes = tensor_dtypes(model)
    assert {torch.float32, torch.bfloat16} <= set(dtypes.values())
    traced = tensor_dtypes(empty_model(model.config, dtypes, torch.device("cpu")))
    assert {n: d for n, d in dtypes.items() if n in traced} == \
        {n: d for n, d in traced.items() if n in dtypes}
    assert traced["model.layers.1.mlp.gate.weight"] == torch.float32
