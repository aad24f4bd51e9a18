"""The static decode/verify path (server/model/static_decode.py) against the varlen path.

The static path serves every step where each request feeds one token plus the same number
of drafts; the varlen path (``static_decode=False``) is the reference.  Float32 outputs
must be identical token for token: greedy and seeded sampling, MTP off, k=1 and k=2,
requests arriving while others decode (prefills stay on the varlen path, so steps switch
between the two).
"""
from __future__ import annotations

import pytest
import torch

from server.engine.worker import runner
from server.engine.protocol import SamplingParams
from server.model.batch import BatchMetadata, DecodeMetadata
from server.model.static_decode import StaticDecoder
from tests.engine.helpers import (high_acceptance_model, make_engine, prompts, requests,
                                  run_staggered, tiny_model)

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, top_k=50, seed=11)
MODELS = {"random": tiny_model, "high_acceptance": high_acceptance_model}


def _count_static_steps(monkeypatch) -> list[int]:
    calls = [0]
    original = StaticDecoder.forward

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StaticDecoder, "forward", counted)
    return calls


def _count_host_verifications(monkeypatch) -> list[int]:
    calls = [0]
    original = runner.greedy_accept

    def counted(*args):
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(runner, "greedy_accept", counted)
    return calls


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_static_path_emits_what_the_varlen_path_emits(model_name, k, sp, monkeypatch):
    model = MODELS[model_name]()
    reqs = lambda: requests(prompts(10, seed=5), sp)                     # noqa: E731
    ref = run_staggered(make_engine(model, k, static_decode=False, adaptive_speculation=False),
                        reqs(), every=3)
    calls = _count_static_steps(monkeypatch)
    host = _count_host_verifications(monkeypatch)
    eng = make_engine(model, k, static_decode=True, adaptive_speculation=False)
    out = run_staggered(eng, reqs(), every=3)
    assert out == ref
    assert calls[0] > 20                      # most steps took the static path
    # Greedy static steps verify on the host (runner._greedy_on_host), sampled ones never.
    assert (host[0] > 20) if sp is GREEDY else host[0] == 0
    assert eng.runtime.decode_path == "static"


def test_adaptive_k_switches_between_paths_losslessly():
    """Adaptive speculation changes k between steps: the step after a switch holds mixed
    draft counts (varlen path), the rest are uniform (static path)."""
    model = high_acceptance_model()
    reqs = lambda: requests(prompts(12, seed=8), GREEDY)                 # noqa: E731
    ref = run_staggered(make_engine(model, 0, static_decode=False), reqs(), every=2)
    for k in (1, 2):
        assert run_staggered(make_engine(model, k), reqs(), every=2) == ref


def test_decode_metadata_worked_example():
    meta = DecodeMetadata.build([5, 1], 2, [[7, 2], [4]], 4, torch.device("cpu"))
    assert meta.positions.tolist() == [5, 6, 1, 2]
    assert meta.slot_mapping.tolist() == [9, 10, 17, 18]
    assert meta.block_tables.tolist() == [[7, 2], [4, 0]]
    assert meta.num_seqs == 2 and meta.query_len == 2
    # at least two table columns, so a compiled step never specialises on one
    assert DecodeMetadata.build([0], 1, [[3]], 16, torch.device("cpu")).block_tables.tolist() == [[3, 0]]


@pytest.mark.parametrize("dense", [True, False], ids=["dense-moe", "routed-moe"])
def test_static_forward_matches_varlen_forward_and_ignores_unwritten_slots(dense, monkeypatch):
    """Same hidden states as the varlen forward for a 3-token verify window on two
    sequences of different lengths; cache slots never written hold NaN and must not leak.
    The demo model's few experts run densely; a model whose tokens would spend more than
    DENSE_MOE_WASTE multiply-adds on unchosen experts routes them (attention half only)."""
    from server.model import static_decode
    model = tiny_model()
    if not dense:
        monkeypatch.setattr(static_decode, "DENSE_MOE_WASTE", model.static_decoder.dense_moe_waste / 2)
        monkeypatch.setattr(model, "static_decoder", StaticDecoder(model))
    assert model.static_decoder.dense_moe == dense
    assert {k for k in model.static_decoder._kinds} == {"dense", "moe" if dense else "half"}
    bs, cfg = 4, model.config
    torch.manual_seed(0)
    caches = [torch.full((32, bs, model.kv_cache_dim), float("nan")) for _ in range(model.num_kv_layers)]
    tables = [[5, 9, 2, 14], [3, 11, 7]]
    lens = [9, 5]                                  # tokens already cached
    with torch.inference_mode():
        for s, (table, n) in enumerate(zip(tables, lens)):      # prefill each sequence
            ids = torch.randint(0, cfg.vocab_size, (n,))
            meta = BatchMetadata(torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                                 torch.tensor([n], dtype=torch.int32), torch.tensor([table], dtype=torch.int32),
                                 torch.tensor([table[p // bs] * bs + p % bs for p in range(n)]),
                                 bs, [n], [n])
            model.forward(ids, meta, caches)
        window = torch.randint(0, cfg.vocab_size, (6,))
        varlen_caches = [c.clone() for c in caches]
        static = model.forward(window, DecodeMetadata.build(lens, 3, tables, bs, torch.device("cpu")), caches)
        pos = [p for n in lens for p in range(n, n + 3)]
        seq = [0, 0, 0, 1, 1, 1]
        width = max(len(t) for t in tables)
        meta = BatchMetadata(torch.tensor(pos), torch.tensor([0, 3, 6], dtype=torch.int32),
                             torch.tensor([n + 3 for n in lens], dtype=torch.int32),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
                             torch.tensor([tables[s][p // bs] * bs + p % bs for s, p in zip(seq, pos)]),
                             bs, [3, 3], [n + 3 for n in lens])
        varlen = model.forward(window, meta, varlen_caches)
    assert torch.isfinite(static).all()
    torch.testing.assert_close(static, varlen, rtol=1e-5, atol=1e-5)


def test_a_failed_compile_leaves_the_uncompiled_static_path(monkeypatch, caplog):
    """No C++ compiler, a torch without Inductor...: the engine still starts, says why."""
    import server.engine.worker.step_graphs as graphs_module

    def fail(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(graphs_module, "compile_static_decoder", fail)
    eng = make_engine(tiny_model(), 1, compile="on")
    assert eng.runtime.decode_path == "static" and eng.runtime.compile_seconds is None
    assert "no C++ compiler found" in caplog.text
    out = run_staggered(eng, requests(prompts(2), GREEDY))
    assert all(len(v) == GREEDY.max_tokens for v in out.values())


def test_gathered_moe_equals_the_routed_and_dense_moe():
    """The gathered MoE (each token through its top-k experts, weights read by index)
    computes what the routed MoE computes, on one token and on a few; building the
    experts' stacks leaves the experts' own weights as views of them (nothing copied)."""
    from server.model.static_decode import gathered_moe
    model = tiny_model()
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate"))
    assert moe.can_gather
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        w_gate_up, w_down = moe.expert_stacks()
        assert moe.experts[1].up_proj.weight.data_ptr() == \
            w_gate_up[1, moe.experts[1].gate_proj.out_features:].data_ptr()
        for t in (1, 3):
            x = torch.randn(t, model.config.hidden_size, generator=g)
            torch.testing.assert_close(gathered_moe(moe, x, w_gate_up, w_down), moe(x),
                                       rtol=1e-5, atol=1e-5)
