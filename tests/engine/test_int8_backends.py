"""Every int8 backend this CPU can run, forced the way an operator forces it
($MTP_SERVE_INT8_BACKEND), on a bf16 W8A8_DYNAMIC model: in one process and in a tp=2
moe_ep=2 group, every tensor a kernel reads is 64-byte aligned, and greedy tokens (MTP
k=1) equal the exact float path's in the same layout.

"The exact path's" per backend: int_mm, avx2 and float compute the same integer sums, so
their tokens are the float backend's bit for bit.  int8pack rounds each sum once to bf16
(quant.py): its reference is the same model with the operator replaced by exactly that.
A bf16 group is compared with the bf16 group on the exact path, not with one process:
its all-reduces round bf16 partial sums (the float backend itself differs from one
process at the 6th token of one request here).

Why: ``torch._weight_int8pack_mm`` on an AVX-512 CPU segfaulted on a weight that
safetensors handed out 8 bytes past a 64-byte boundary; the suite died with it.  The
loader now aligns what it loads (kernels/alignment.py) and the operator's rules are
checked before each call (kernels/int8pack.py).
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.protocol import SamplingParams
from server.model import kernels, quant
from server.model.kernels import native, select
from server.model.kernels import int8pack
from server.model.loading import inspect_checkpoint, load_checkpoint
from server.model.parallel.plan import ParallelPlan
from tests.engine.helpers import prompts, requests, run_tokens
from tests.engine.test_parallel import parallel_config

pytestmark = pytest.mark.demo
BASE = EngineConfig(block_size=8, num_blocks=256, max_queue_delay_us=0, max_batch_size=4,
                    max_seq_len=256, adaptive_speculation=False, num_speculative_tokens=1,
                    dtype="bfloat16")


def runnable() -> list[str]:
    """The int8 backends this CPU and build can run."""
    built = select.built_kernels(native.KERNELS)
    return list(kernels.int8_candidates(kernels.cpu_caps(), half=True, built=built))


def _requests():
    return requests(prompts(3, seed=4, vocab=500), SamplingParams(max_tokens=12, temperature=0.0))


@pytest.fixture
def forced(monkeypatch):
    """force(backend): $MTP_SERVE_INT8_BACKEND set for this process and its ranks."""
    def force(backend: str) -> None:
        monkeypatch.setenv(kernels.INT8_ENV, backend)
        kernels.kernel_settings.cache_clear()
    yield force
    monkeypatch.undo()
    kernels.kernel_settings.cache_clear()


def kernel_tensors(model) -> dict[str, torch.Tensor]:
    """What the int8 and 16-bit products read: every QuantLinear's weight and scales, every
    16-bit linear's weight, and the experts' stacks the gathered MoE reads by index."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, quant.QuantLinear):
            out.update({f"{name}.{p}": t for p, t in m.named_parameters(recurse=False)})
        elif isinstance(m, torch.nn.Linear) and m.weight.dtype in (torch.bfloat16, torch.float16):
            out[f"{name}.weight"] = m.weight
        elif hasattr(m, "expert_stacks") and m.can_gather:
            out.update({f"{name}.stack{i}": t for i, t in enumerate(m.expert_stacks())})
    return out


def assert_aligned(model) -> None:
    assert list(kernels.misaligned(model)) == []
    tensors = kernel_tensors(model)
    assert any(t.dtype == torch.int8 for t in tensors.values())
    bad = {n: t.data_ptr() % 64 for n, t in tensors.items() if not kernels.is_aligned(t)}
    assert bad == {}


@functools.lru_cache(maxsize=None)
def _one_process(path: str, backend: str) -> dict[str, list[int]]:
    model, _ = load_checkpoint(path, dtype=torch.bfloat16, int8_backend=backend)
    return run_tokens(LLMEngine(model.eval(), BASE, eos_token_ids=set()), _requests())


@functools.lru_cache(maxsize=None)
def _group(path: str, backend: str) -> dict[str, list[int]]:
    with pytest.MonkeyPatch.context() as mp:            # the ranks read it as the loader does
        mp.setenv(kernels.INT8_ENV, backend)
        cfg = dataclasses.replace(BASE, parallel=parallel_config("ep2"))
        engine = LLMEngine(inspect_checkpoint(path), cfg, eos_token_ids=set())
        try:
            return run_tokens(engine, _requests())
        finally:
            engine.shutdown()


def _rounded_once(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What int8pack computes (quant.py): the exact sums, scaled, rounded once to bf16."""
    return (x.double() @ w.double().t() * scales.double()).to(torch.bfloat16)


@pytest.mark.parametrize("backend", ["int_mm", "int8pack", "avx2", "vnni", "float"])
def test_a_forced_backend_loads_aligned_and_serves_the_exact_tokens(quantized, forced, backend):
    if backend not in runnable():
        pytest.skip(f"{backend} cannot run on this CPU / build")
    forced(backend)
    model, _ = load_checkpoint(quantized["ct"], dtype=torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, quant.QuantLinear)]
    assert {m.backend for m in layers} == {backend}
    assert_aligned(model)
    calls = []
    real = int8pack.int8pack_mm
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(int8pack, "int8pack_mm", lambda *a: calls.append(1) or real(*a))
        got = run_tokens(LLMEngine(model.eval(), BASE, eos_token_ids=set()), _requests())
    assert bool(calls) is (backend == "int8pack")
    if backend != "int8pack":
        assert got == _one_process(str(quantized["ct"]), "float")
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(int8pack, "int8pack_mm", _rounded_once)
        want = run_tokens(LLMEngine(model.eval(), BASE, eos_token_ids=set()), _requests())
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["int_mm", "int8pack", "avx2", "vnni", "float"])
def test_a_forced_backend_in_a_tp2_ep2_group(quantized, forced, backend):
    if backend not in runnable():
        pytest.skip(f"{backend} cannot run on this CPU / build")
    forced(backend)
    for rank in (0, 1):                             # each rank's shard as the rank loads it
        shard, _ = load_checkpoint(quantized["ct"], dtype=torch.bfloat16, plan=ParallelPlan(2, 1, 2, rank=rank))
        assert {m.backend for m in shard.modules() if isinstance(m, quant.QuantLinear)} == {backend}
        assert_aligned(shard)
    got = _group(str(quantized["ct"]), backend)
    want = _group(str(quantized["ct"]), "float")
    if backend != "int8pack":
        assert got == want
        return
    # int8pack's ranks cannot be handed the reference operator: its rounding may move a
    # late argmax, but the sums are right (a broken rule gave sums of 1e26: other tokens
    # from the first).
    pairs = [(a, b) for r in want for a, b in zip(got[r], want[r])]
    assert all(got[r][0] == want[r][0] for r in want)
    assert sum(a == b for a, b in pairs) >= 0.75 * len(pairs)


def test_an_unaligned_weight_never_reaches_the_operator():
    """The issue's reproduction through the project: a weight 8 bytes past a 64-byte
    boundary (which crashed the process on AVX-512) takes the exact sums instead, and
    activations that are not aligned are copied first."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(-127, 128, (128 * 128 + 8,), dtype=torch.int8, generator=g)
    w = base[8:].view(128, 128)
    assert w.data_ptr() % 64 == 8 and not int8pack.weight_fits(w)
    x_q = torch.randint(-127, 128, (7, 128), dtype=torch.int8, generator=g)
    exact = (x_q.double() @ w.double().t())
    assert torch.equal(quant.int8_matmul(x_q, w, "int8pack").double(), exact)
    with pytest.raises(ValueError, match="8 bytes|offset 8"):
        int8pack.int8pack_mm(x_q.to(torch.bfloat16), w, torch.ones(128, dtype=torch.bfloat16))
    fit = w.clone()
    xs = torch.empty(7 * 128 + 8, dtype=torch.bfloat16)[8:].view(7, 128)
    xs.copy_(x_q.to(torch.bfloat16))                 # 16 bytes past: crashed on AVX-512 too
    got = int8pack.int8pack_mm(xs, fit, torch.ones(128, dtype=torch.bfloat16))
    assert torch.equal(got.float(), exact.to(torch.bfloat16).float())
    # In-features that are multiples of 8 but not 16 summed wrongly or crashed on AVX-512.
    assert not quant.packs("int8pack", 136) and quant.packs("int8pack", 144)
