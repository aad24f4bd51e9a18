"""A step's layer graphs called back to back from C++ (model/layer_chain.py): the chain
runs the very graphs the layer-by-layer path runs, so its hidden state and the cache rows it
writes are theirs bit for bit; where a layer's call is not a C++ wrapper's, no chain."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from server.model.batch import DecodeMetadata
from server.model.layer_chain import available


def _graphs(model, tmp_path: Path, q: int, lone: bool) -> dict:
    """Every layer kind's static graph for ``q``-token windows (C++ wrapper)."""
    from server.engine.worker import compile_step
    device = torch.device("cpu")
    dec = model.static_decoder
    graphs = {}
    main = model.config.num_hidden_layers
    with torch.inference_mode():
        for kind, index in dec.layer_kinds().items():
            # What a main forward's window of few tokens takes (not the MTP layer's).
            if index >= main or not kind.startswith(("dense", "gmoe")):
                continue
            args = compile_step._example(model, index, q, lone, 8, device, True, kind)
            fn = dec.function(kind, not lone)
            path = Path(tempfile.mkdtemp(dir=tmp_path)) / "g.bin"
            graphs[(kind, f"q{q}", lone)], _ = compile_step._load_or_compile(fn, args, path, device, static=True)
    return graphs


def _step(model, seqs: int, q: int, caches: list, start: int) -> torch.Tensor:
    tables = [[1 + 2 * s, 2 + 2 * s] for s in range(seqs)]
    meta = DecodeMetadata.build([start + s for s in range(seqs)], q, tables, 8, torch.device("cpu"))
    ids = torch.arange(seqs * q) % model.config.vocab_size + 3
    with torch.inference_mode():
        return model.static_decoder.forward(ids, meta, caches)


def _caches(model, seqs: int, form: str) -> list:
    """A float or int8 latent cache a main layer, random rows."""
    from server.model.layers.latent_cache import Int8LatentCache
    c, blocks = model.config, 2 * seqs + 2
    caches = []
    for _ in range(c.num_hidden_layers):
        if form == "float":
            caches.append(torch.randn(blocks, 8, model.kv_cache_dim).to(torch.bfloat16))
            continue
        cache = Int8LatentCache(blocks, 8, c.kv_lora_rank, c.qk_rope_head_dim, torch.bfloat16, torch.device("cpu"))
        cache.latent.copy_(torch.randint(-127, 128, cache.latent.shape, dtype=torch.int8))
        cache.scale.uniform_(0.001, 0.02)
        cache.rope.copy_(torch.randn(cache.rope.shape))
        caches.append(cache)
    return caches


def _tensors(caches: list) -> list[torch.Tensor]:
    return [t for c in caches for t in ((c,) if isinstance(c, torch.Tensor) else c.block_tensors())]


def _clone(caches: list) -> list:
    out = []
    for c in caches:
        if isinstance(c, torch.Tensor):
            out.append(c.clone())
            continue
        copy = type(c).__new__(type(c))
        copy.__dict__.update(c.__dict__)
        copy.latent, copy.scale, copy.rope = c.latent.clone(), c.scale.clone(), c.rope.clone()
        out.append(copy)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not available(), reason="layer_chain.cpp is built with ops.cpp: no kernel library here")
@pytest.mark.parametrize("seqs, form", [(1, "float"), (2, "float"), (1, "int8")],
                         ids=["lone", "batch", "lone-int8-kv"])
def test_a_chain_emits_and_writes_what_the_layers_one_by_one_do(tmp_path, monkeypatch, seqs, form):
    from server.engine.worker import compile_step
    from server.model.loading import load_checkpoint
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    monkeypatch.setenv(compile_step.CPP_WRAPPER_ENV, "1")    # the serving default (the suite's is 0)
    # Every main layer an MoE one: one graph serves them all (a compile is ~9 s here).
    model, _ = load_checkpoint(make_tiny_checkpoint(tmp_path / "ckpt", seed=3, first_k_dense_replace=0),
                               dtype=torch.bfloat16)
    model.eval()
    dec = model.static_decoder
    dec.prepare()
    dec.kv_form = form                                      # the graphs are made for this cache
    graphs = _graphs(model, tmp_path, 1, seqs == 1)
    assert len(graphs) == 1, graphs
    dec.use_graphs(graphs)
    n = model.config.num_hidden_layers
    caches = _caches(model, seqs, form)
    first = _step(model, seqs, 1, caches, 5)               # learns each layer's call, makes the chain
    assert dec.chains.made == 1, dec.chains.reasons
    outs, layers = {}, []
    real = dec.run_layer
    monkeypatch.setattr(dec, "run_layer", lambda i, *a: layers.append(i) or real(i, *a))
    for chained in (True, False, True):
        dec.chains.enabled = chained
        mine = _clone(caches)
        layers.clear()
        outs.setdefault(chained, []).append((_step(model, seqs, 1, mine, 6), _tensors(mine)))
        assert layers == ([] if chained else list(range(n)))
    (a, ca), (b, cb) = outs[True][0], outs[False][0]
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ca, cb))
    assert torch.equal(outs[True][1][0], a)
    assert not torch.equal(a, first)                        # another position, other rows
    assert any(not torch.equal(c, m) for c, m in zip(_tensors(caches), ca))   # the step wrote its rows
    # Other graphs: the chains go with the calls they were made of.
    dec.use_graphs({})
    assert dec.chains.made == 1 and not dec.chains._chains


@pytest.mark.skipif(not available(), reason="layer_chain.cpp is built with ops.cpp: no kernel library here")
def test_bad_chain_arguments_raise_and_never_reach_a_wrapper():
    ops = torch.ops.mtp_native
    with pytest.raises(RuntimeError, match="no entry point"):
        ops.chain_add(0, 0, 1, 0, False, 0, [0, 0, -1], [torch.zeros(1)])
    with pytest.raises(RuntimeError, match="constant 3 of 1"):
        ops.chain_add(0, 1, 1, 0, False, 0, [0, 3, -1], [torch.zeros(1)])
    with pytest.raises(RuntimeError, match="output 2 of 1"):
        ops.chain_add(0, 1, 1, 2, False, 0, [], [])
    with pytest.raises(RuntimeError, match="no chain 123456"):
        ops.chain_run(123456, torch.zeros(1), [], [])
