"""An int8 copy of the MTP head for the drafts only (server/engine/spec/draft_head.py,
``MTP_SERVE_DRAFT_HEAD``), and the MTP layer's own products in int8
(engine/spec/draft_layer.py, ``MTP_SERVE_DRAFT_LAYER``): verification keeps the model's own
weights, so greedy tokens with MTP stay those of MTP off and acceptance stays near the
float layer's; "auto" leaves float32 layers alone.  A bad setting's refusal:
tests/config/test_env_and_cli.py."""
from __future__ import annotations

import torch

from server.config import kernel_env
from server.engine.protocol import SamplingParams
from server.engine.spec import draft_head as dh
from server.engine.spec import draft_layer as dl
from server.model.quant.linear import QuantLinear
from tests.engine.helpers import (force_kernel_setting, high_acceptance_model, make_engine, prompts,
                                  requests, run_tokens)

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def test_auto_and_model_leave_a_float32_head_alone(monkeypatch):
    model = high_acceptance_model()
    assert model._mtp(0).shared_head.head.weight.dtype == torch.float32
    for value in ("auto", "model"):
        force_kernel_setting(monkeypatch, kernel_env.DRAFT_HEAD_ENV, value)
        assert dh.draft_head(model) is None


def test_int8_drafts_keep_the_tokens_and_the_acceptance(monkeypatch):
    model = high_acceptance_model()
    ps = prompts(6, seed=3)
    off = run_tokens(make_engine(model, 0), requests(ps, GREEDY))
    on_model = make_engine(model, 1, adaptive_speculation=False)
    got_model = run_tokens(on_model, requests(ps, GREEDY))
    force_kernel_setting(monkeypatch, kernel_env.DRAFT_HEAD_ENV, "int8")
    on_int8 = make_engine(model, 1, adaptive_speculation=False)
    head = on_int8.worker.proposer.inner.draft_head
    assert isinstance(head, QuantLinear) and head.weight.dtype == torch.int8
    calls = []
    forward = head.forward
    head.forward = lambda x: (calls.append(x.shape[0]), forward(x))[1]
    got_int8 = run_tokens(on_int8, requests(ps, GREEDY))
    assert calls                                    # the drafts took it
    assert got_model == off and got_int8 == off
    a_model, a_int8 = on_model.stats().acceptance_rate, on_int8.stats().acceptance_rate
    assert a_model > 0.5 and abs(a_int8 - a_model) <= 0.05, (a_model, a_int8)


# -- the MTP layer's own products in int8 (server/engine/spec/draft_layer.py) -----------------

def _fresh_model():
    """Not the helpers' cached model: the conversion is in place."""
    return high_acceptance_model.__wrapped__()


def test_auto_model_and_rank_groups_leave_the_layer_as_loaded(monkeypatch):
    model = _fresh_model()
    for value in ("auto", "model"):
        force_kernel_setting(monkeypatch, kernel_env.DRAFT_LAYER_ENV, value)
        assert dl.int8_draft_layers(model) == 0
    force_kernel_setting(monkeypatch, kernel_env.DRAFT_LAYER_ENV, "int8")
    assert dl.int8_draft_layers(model, grouped=True) == 0
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_an_int8_draft_layer_keeps_the_tokens_and_the_acceptance(monkeypatch):
    ps = prompts(6, seed=5)
    model = high_acceptance_model()
    off = run_tokens(make_engine(model, 0), requests(ps, GREEDY))
    on_model = make_engine(model, 1, adaptive_speculation=False)
    got_model = run_tokens(on_model, requests(ps, GREEDY))

    force_kernel_setting(monkeypatch, kernel_env.DRAFT_LAYER_ENV, "int8")
    converted = _fresh_model()
    on_int8 = make_engine(converted, 1, adaptive_speculation=False)
    mtp = converted._mtp(0)
    assert isinstance(mtp.eh_proj, QuantLinear) and mtp.eh_proj.weight.dtype == torch.int8
    assert isinstance(mtp.self_attn.q_a_proj, QuantLinear)
    assert isinstance(mtp.mlp.experts[0].down_proj, QuantLinear)
    assert not isinstance(mtp.self_attn.kv_b_proj, QuantLinear)      # read as raw matrices
    assert not isinstance(mtp.shared_head.head, QuantLinear)         # the head has its own switch
    assert not any(isinstance(m, QuantLinear) for m in converted.model.layers[0].modules())
    calls = []
    forward = mtp.eh_proj.forward
    mtp.eh_proj.forward = lambda x: (calls.append(x.shape[0]), forward(x))[1]
    got_int8 = run_tokens(on_int8, requests(ps, GREEDY))
    assert calls                                    # the drafts took it
    assert got_model == off and got_int8 == off
    a_model, a_int8 = on_model.stats().acceptance_rate, on_int8.stats().acceptance_rate
    assert a_model > 0.5 and abs(a_int8 - a_model) <= 0.05, (a_model, a_int8)
