"""The weights packed into one arena (loading/arena.py): same values, same tensor objects,
one storage in forward order, nothing held twice, and greedy output unchanged."""
from __future__ import annotations

import pytest
import torch

from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.protocol import EngineRequest, SamplingParams
from server.model.kernels.alignment import ALIGNMENT
from server.model.loading import load_checkpoint
from server.model.loading.arena import ENV, pack_weights, weight_tensors
from server.testing.tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # float experts that the static step gathers: the MoE stacks, their expert views and
    # the experts' own gate-and-up stacks all exist.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("arena"), seed=3)


def _greedy(model, packed: bool, monkeypatch) -> list[int]:
    monkeypatch.setenv(ENV, "1" if packed else "0")
    eng = LLMEngine(model, EngineConfig(block_size=8, num_blocks=64, num_speculative_tokens=1,
                                        max_queue_delay_us=0, max_seq_len=256), eos_token_ids=set())
    eng.add_request(EngineRequest("a", [5, 17, 33, 2, 9, 41], SamplingParams(max_tokens=12, temperature=0.0)))
    out: list[int] = []
    while eng.has_unfinished():
        out += [t for o in eng.step() for t in o.token_ids]
        eng.finish_step()
    return out


def _storages(model) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in weight_tensors(model)}


def test_a_served_model_holds_its_weights_in_one_arena_in_forward_order(checkpoint, monkeypatch):
    plain, _ = load_checkpoint(checkpoint)
    model, _ = load_checkpoint(checkpoint)
    want = _greedy(plain, packed=False, monkeypatch=monkeypatch)
    assert len(_storages(plain)) > 10                       # the unpacked form: a storage per weight
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = _greedy(model, packed=True, monkeypatch=monkeypatch)
    assert got == want
    assert len(_storages(model)) == 1
    for n, p in model.named_parameters():
        assert torch.equal(p, values[n]), n
        assert p.data_ptr() % ALIGNMENT == 0, n
    # Forward order: a layer's weights lie before the next layer's, the head's last.
    layers = model.model.layers
    first = layers[0].self_attn.o_proj.weight.data_ptr()
    assert first < layers[1].self_attn.o_proj.weight.data_ptr() < layers[2].self_attn.o_proj.weight.data_ptr()
    assert model.model.embed_tokens.weight.data_ptr() < first < model.lm_head.weight.data_ptr()
    # A second engine on the packed model restacks nothing and so packs nothing again.
    assert _greedy(model, packed=True, monkeypatch=monkeypatch) == want
    assert len(_storages(model)) == 1 and layers[0].self_attn.o_proj.weight.data_ptr() == first


def test_routed_experts_are_held_once(checkpoint, monkeypatch):
    """An expert's gate-and-up stack is a view of its MoE's stack, not a second copy."""
    model, _ = load_checkpoint(checkpoint)
    _greedy(model, packed=False, monkeypatch=monkeypatch)
    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert moes
    for moe in moes:
        stacks = moe.expert_stacks()
        for e, expert in enumerate(moe.experts):
            assert expert.gate_up.data_ptr() == stacks[0][e].data_ptr()
            assert expert.gate_up.untyped_storage().data_ptr() == stacks[0].untyped_storage().data_ptr()
    # What the model holds is its parameters, plus the absorbed attention weights
    # (derived, a few per cent) and, where the experts are few enough to run densely, that
    # copy of them (MoE._stacked): no expert weight twice besides.
    dense = {t.untyped_storage().data_ptr() for moe in moes if moe._stack is not None
             for t in moe._stack[:2]}
    held = sum(n for at, n in _storages(model).items() if at not in dense)
    params = sum(p.nbytes for p in {id(p): p for p in model.parameters()}.values())
    assert held < 1.25 * params


def test_packing_again_or_switched_off_moves_nothing(checkpoint, monkeypatch):
    model, _ = load_checkpoint(checkpoint)
    monkeypatch.setenv(ENV, "0")
    assert pack_weights(model) is None
    assert len(_storages(model)) > 10
    monkeypatch.setenv(ENV, "1")
    objects = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    held = sum(_storages(model).values())
    with torch.inference_mode():                # as an engine may be built
        packed = pack_weights(model)
    # Plain tensors still: version counters (the dense MoE stack's key) and in-place edits work.
    assert not any(p.is_inference() for p in model.parameters())
    assert all(p._version >= 0 for p in model.parameters())
    # The same Parameter objects: a head shared by the MTP layer stays one.
    assert {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)} == objects
    assert packed is not None and packed.storages > 10
    assert held <= packed.nbytes < held + packed.storages * ALIGNMENT
    where = model.lm_head.weight.data_ptr()
    assert pack_weights(model) is None
    assert model.lm_head.weight.data_ptr() == where


def test_a_model_that_ran_eagerly_in_inference_mode_packs_and_serves(checkpoint, monkeypatch):
    """An eager forward inside inference mode builds the dense MoE stack; packing after it
    leaves every weight a plain tensor the next forward can use."""
    plain, _ = load_checkpoint(checkpoint)
    want = _greedy(plain, packed=False, monkeypatch=monkeypatch)
    model, _ = load_checkpoint(checkpoint)
    ids = torch.tensor([[5, 17, 33, 2]])
    with torch.inference_mode():
        before = model.compute_logits(model.forward_full(ids))
    assert any(getattr(layer.mlp, "_stack", None) is not None for layer in model.model.layers)
    assert _greedy(model, packed=True, monkeypatch=monkeypatch) == want
    assert len(_storages(model)) == 1
    with torch.inference_mode():
        assert torch.equal(model.compute_logits(model.forward_full(ids)), before)
