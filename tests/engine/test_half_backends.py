"""Every 16-bit product backend this CPU can run, forced as an operator forces it
($MTP_SERVE_HALF_BACKEND), on a bf16 model: each computes its products within bf16
rounding of a float64 reference, keeps MTP lossless (a window's rows are each summed as a
plain step's row), and serves the tokens the float32 model serves on the whole.

Why: the AVX2 kernel was proven only where the automatic choice takes it (AVX2-only
CPUs); on an AVX-512 BF16 machine oneDNN's own product is chosen and nothing ran the
kernel's model path.  Forced, it runs wherever it can.
"""
from __future__ import annotations

import functools

import pytest
import torch

from server.engine.protocol import SamplingParams
from server.model import kernels
from server.model.kernels import native, select
from server.model.kernels.choice import KERNEL_OF
from server.model.kernels.products import UsesProducts
from server.model.loading import load_checkpoint
from server.testing.tiny_checkpoint import make_tiny_checkpoint
from tests.engine.helpers import _TMP, make_engine, prompts, requests, run_tokens

BACKENDS = ("onednn", "avx512", "avx2", "float32")


def runnable() -> list[str]:
    return [b for b in BACKENDS if b not in KERNEL_OF or native.kernel_library(KERNEL_OF[b]) is not None]


def _forget_choices() -> None:
    kernels.kernel_settings.cache_clear()
    select.half_backend_name.cache_clear()


@pytest.fixture
def forced(monkeypatch):
    def force(backend: str) -> None:
        monkeypatch.setenv(kernels.HALF_ENV, backend)
        _forget_choices()
    yield force
    monkeypatch.undo()
    _forget_choices()


@functools.lru_cache(maxsize=None)
def _checkpoint() -> str:
    return str(make_tiny_checkpoint(f"{_TMP}/half-backends", seed=7, dtype="bfloat16"))


def _tokens(model, k: int) -> dict[str, list[int]]:
    reqs = requests(prompts(3, seed=5, vocab=500), SamplingParams(max_tokens=16, temperature=0.0))
    return run_tokens(make_engine(model, k, max_batch_size=4), reqs)


@functools.lru_cache(maxsize=None)
def _float32_tokens() -> dict[str, list[int]]:
    model, _ = load_checkpoint(_checkpoint(), dtype=torch.float32)
    return _tokens(model.eval(), 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forced_16_bit_backend_sums_within_bf16_and_keeps_mtp_lossless(forced, backend):
    if backend not in runnable():
        pytest.skip(f"{backend} cannot run on this CPU / build")
    forced(backend)
    assert select.half_backend_name() == backend
    model, _ = load_checkpoint(_checkpoint(), dtype=torch.bfloat16)
    assert model.products.name == ("torch" if backend == "onednn" else backend)
    assert {m.products for m in model.modules() if isinstance(m, UsesProducts)} == {model.products}
    assert list(kernels.misaligned(model)) == []
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    for rows in (1, 3, 17, 80):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        want = x.double() @ w.double().t()
        got = model.products.linear(x, w).double()
        assert ((got - want).abs() <= 2 ** -7 * want.abs() + 1e-2).all(), (backend, rows)
        if rows < 80:                              # each row its own (eager products)
            assert torch.equal(model.products.linear(x[:1], w), got[:1].to(torch.bfloat16))
    model = model.eval()
    off, k1 = _tokens(model, 0), _tokens(model, 1)
    assert k1 == off
    ref = _float32_tokens()
    pairs = [(a, b) for r in ref for a, b in zip(off[r], ref[r])]
    assert all(off[r][0] == ref[r][0] for r in ref)
    assert sum(a == b for a, b in pairs) >= 0.75 * len(pairs)
