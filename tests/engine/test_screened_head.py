"""Greedy ids through the screened head (server/engine/sample/screened_head.py): the int8
copy screens the vocabulary and the candidates' rows are multiplied exactly, so every id
is the served head's argmax bit for bit, ties included (the first largest), on every
16-bit backend whose products are ``columns_exact`` that this CPU runs, with ops.cpp's
operators and with their torch forms; a step whose rows cannot be screened (flat logits,
non-finite rows, a backend that is not exact by column) reads the whole head; served
greedy tokens are those of the whole head, with MTP and without."""
from __future__ import annotations

import functools

import pytest
import torch

from server.config import kernel_env
from server.engine.protocol import SamplingParams
from server.engine.sample import screened_head as sh
from server.model.quant.int8_copy import int8_copy
from server.model.kernels import native, select
from server.model.kernels.choice import KERNEL_OF
from server.model.layers.linear import Linear
from server.model.loading import load_checkpoint
from server.testing.tiny_checkpoint import make_tiny_checkpoint
from tests.engine.helpers import _TMP, force_kernel_setting, make_engine, prompts, requests, run_tokens

EXACT = ("avx512", "avx2")          # 16-bit backends whose products are exact by column
INT8 = ("vnni", "avx2")             # our int8 kernels (the exact float path: the tie test)


def _runs(backend: str) -> bool:
    return native.kernel_library(KERNEL_OF[backend]) is not None


def _int8_runs(backend: str) -> bool:
    return backend == "float" or native.kernel_library(
        {"vnni": "avx512_vnni", "avx2": "half_avx2"}[backend]) is not None


def _head(backend: str, v: int, k: int, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    head = Linear(k, v, bias=False)
    with torch.no_grad():
        head.weight.data = (torch.randn(v, k, generator=g) * 0.02).to(torch.bfloat16)
        head.weight.data[7] = head.weight.data[3]          # an exact tie: 3 must win
        head.weight.data[v - 1] = head.weight.data[5]      # another, past the last full block
    head.weight.requires_grad_(False)
    head.products = select.products_named(backend)
    return head.eval()


def _rows(m: int, k: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * scale
    x[:, 0] *= 40                                           # an outlier feature, as real rows have
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("int8_backend", INT8)
@pytest.mark.parametrize("backend", EXACT)
@pytest.mark.parametrize("ops", [True, False], ids=["ops", "torch"])
def test_screened_ids_are_the_whole_heads_argmax_bit_for_bit(backend, int8_backend, ops, monkeypatch):
    if not _runs(backend) or not _int8_runs(int8_backend):
        pytest.skip(f"{backend} / {int8_backend} cannot run on this CPU / build")
    if not ops:
        monkeypatch.setattr(sh, "ops_ready", lambda: False)
    elif not native.ops_ready():
        pytest.skip("ops.cpp is not built here")
    checked = screened = 0
    for v, k in ((4099, 200), (6007, 1536)):
        head = _head(backend, v, k, seed=v)
        screen = sh.ScreenedHead(head, int8_copy(head, int8_backend))
        for m in (1, 2, 3, 5, 8):
            for seed in range(4):
                x = _rows(m, k, seed=100 * m + seed, scale=(0.5, 1.0, 3.0, 10.0)[seed])
                if seed == 0:                               # rows that tie tokens 3 and 7
                    x[0] = head.weight[3].float().mul(50).to(torch.bfloat16)
                got = screen.ids(x)
                want = head(x).float().argmax(dim=1)
                checked += 1
                if got is not None:
                    screened += 1
                    assert torch.equal(got, want), (backend, int8_backend, v, k, m, seed)
    # random heads give flatter logits than a model's; most rows still screen
    assert screened >= 0.5 * checked, (screened, checked)


@pytest.fixture
def exact_backend() -> str:
    """A 16-bit backend exact by column that runs here."""
    backend = next((b for b in EXACT if _runs(b)), None)
    if backend is None:
        pytest.skip("no 16-bit backend exact by column runs here")
    return backend


def test_ties_go_to_the_first_index(exact_backend):
    head = _head(exact_backend, 4099, 200, seed=3)
    screen = sh.ScreenedHead(head, int8_copy(head, "float"))
    x = head.weight[[3, 5]].float().mul(50).to(torch.bfloat16)   # rows 3 = 7, 5 = last
    full = head(x).float()
    assert full[0, 3] == full[0, 7] and full[1, 5] == full[1, 4098]
    assert torch.equal(screen.ids(x), full.argmax(dim=1))
    assert screen.ids(x).tolist() == [3, 5]


def test_rows_that_cannot_be_screened_read_the_whole_head(exact_backend):
    head = _head(exact_backend, 4099, 200, seed=4)
    screen = sh.ScreenedHead(head, int8_copy(head, "float"))
    assert screen.ids(torch.zeros(2, 200, dtype=torch.bfloat16)) is None      # all tied
    assert screen.fallbacks == 1
    x = _rows(2, 200, 5)
    x[1, 3] = float("nan")
    assert screen.ids(x) is None
    x[1, 3] = float("inf")
    assert screen.ids(x) is None
    assert screen.ids(x.float()) is None                       # not the head's dtype
    assert screen.ids(_rows(sh.MAX_ROWS + 1, 200, 7)) is None   # past the rows it pays for
    torch_head = _head(exact_backend, 4099, 200, seed=4)
    torch_head.products = select.products_named("torch")       # oneDNN: not exact by column
    assert sh.ScreenedHead(torch_head, int8_copy(torch_head, "float")).ids(_rows(1, 200, 6)) is None


def test_the_native_rows_and_candidates_agree_with_their_torch_forms():
    if not native.ops_ready():
        pytest.skip("ops.cpp is not built here")
    x = _rows(3, 200, 9)
    q, stats = torch.ops.mtp_native.screen_rows(x)
    q_t, stats_t = sh.screen_rows(x)
    assert torch.equal(q, q_t)
    assert torch.allclose(stats, stats_t, rtol=1e-6, atol=0)
    x[2, 4] = float("inf")
    _, stats = torch.ops.mtp_native.screen_rows(x)
    assert stats[:2, 1:].isfinite().all() and stats[2, 1:].isnan().all()


# -- served: the worker takes the screen where it applies -------------------------------------

@functools.lru_cache(maxsize=None)
def _checkpoint() -> str:
    return str(make_tiny_checkpoint(f"{_TMP}/screened-head", seed=11, dtype="bfloat16"))


@pytest.mark.parametrize("k", [0, 1])
def test_served_greedy_tokens_are_the_whole_heads(k, monkeypatch):
    model, _ = load_checkpoint(_checkpoint(), dtype=torch.bfloat16)
    model = model.eval()
    head = model.lm_head
    if not head.products.columns_exact(head.weight, 1) or sh.screened_head(model) is None:
        pytest.skip("this CPU's 16-bit or int8 products are not ones the screen takes")
    reqs = lambda: requests(prompts(4, seed=2, vocab=500), SamplingParams(max_tokens=16, temperature=0.0))
    force_kernel_setting(monkeypatch, kernel_env.GREEDY_HEAD_ENV, "model")
    whole = make_engine(model, k, max_batch_size=4)
    assert whole.worker.runner.screen is None
    want = run_tokens(whole, reqs())
    force_kernel_setting(monkeypatch, kernel_env.GREEDY_HEAD_ENV, "auto")
    screened = make_engine(model, k, max_batch_size=4)
    screen = screened.worker.runner.screen
    assert screen is not None
    got = run_tokens(screened, reqs())
    assert got == want
    assert screen.calls > 0 and screen.fallbacks < screen.calls
    # sampled requests (and logprobs) read the whole head
    calls = screen.calls
    sampled = requests(prompts(2, seed=3, vocab=500), SamplingParams(max_tokens=6, temperature=0.8, seed=1))
    run_tokens(screened, sampled)
    assert screen.calls == calls


def test_the_native_operators_refuse_bad_arguments():
    if not native.ops_ready():
        pytest.skip("ops.cpp is not built here")
    op = torch.ops.mtp_native
    sums = torch.zeros(2, 16, dtype=torch.int32)
    stats = torch.ones(2, 4)
    col = torch.ones(16)
    with pytest.raises(RuntimeError, match="sums"):
        op.screen_candidates(sums.float(), stats, col, col, col, 0.0, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="stats"):
        op.screen_candidates(sums, torch.ones(3, 4), col, col, col, 0.0, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="column vectors"):
        op.screen_candidates(sums, stats, torch.ones(15), col, col, 0.0, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="screen_rows"):
        op.screen_rows(torch.ones(2, 16, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="screen_rows"):
        op.screen_rows(torch.ones(16, 2, dtype=torch.bfloat16).t())
