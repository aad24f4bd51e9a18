"""An int8 copy of the MTP head for the drafts only (server/engine/spec/draft_head.py,
``MTP_SERVE_DRAFT_HEAD``): verification keeps the model's own head, so greedy tokens with
MTP stay those of MTP off and acceptance stays near the model head's; a bad setting is
refused before anything loads; "auto" leaves float32 heads alone."""
from __future__ import annotations

import pytest
import torch

from server.config import kernel_env
from server.engine.protocol import SamplingParams
from server.model.kernels import settings
from server.engine.spec import draft_head as dh
from server.model.quant.linear import QuantLinear
from tests.engine.helpers import high_acceptance_model, make_engine, prompts, requests, run_tokens

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def _with(monkeypatch, value: str) -> None:
    chosen = kernel_env.parse({kernel_env.DRAFT_HEAD_ENV: value})
    monkeypatch.setattr(settings, "kernel_settings", lambda: chosen)


def test_a_bad_setting_is_refused_naming_the_variable():
    found = kernel_env.problems({kernel_env.DRAFT_HEAD_ENV: "fp4"})
    assert [p.variable for p in found] == ["MTP_SERVE_DRAFT_HEAD"]
    assert "auto, model, int8" in str(found[0])
    assert kernel_env.parse({}).draft_head == "auto"


def test_auto_and_model_leave_a_float32_head_alone(monkeypatch):
    model = high_acceptance_model()
    assert model._mtp(0).shared_head.head.weight.dtype == torch.float32
    for value in ("auto", "model"):
        _with(monkeypatch, value)
        assert dh.draft_head(model) is None


def test_int8_drafts_keep_the_tokens_and_the_acceptance(monkeypatch):
    model = high_acceptance_model()
    ps = prompts(6, seed=3)
    off = run_tokens(make_engine(model, 0), requests(ps, GREEDY))
    on_model = make_engine(model, 1, adaptive_speculation=False)
    got_model = run_tokens(on_model, requests(ps, GREEDY))
    _with(monkeypatch, "int8")
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
