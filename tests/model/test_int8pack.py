"""The "int8pack" int8 backend (server/model/quant/int8.py): 16-bit models on CPUs without fast
int8 products take torch._weight_int8pack_mm with the quantized activations as bf16.

Checked against the exact backends: each integer sum comes back as the exact one rounded
once to bf16 (so a row's output does not depend on the rows beside it, and MTP stays
lossless), or exact from INT8PACK_MAX_ROWS rows (prompts); in-features it cannot take fall back to the exact float path; a bf16 W8A8 model
on it agrees with the exact path within bf16 rounding; float32 models and row-parallel
layers never take it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.protocol import EngineRequest, SamplingParams
import server.model.quant.linear as qlinear
from server.model import quant
from server.model.kernels import gemm, int8pack
from server.model.loading import CheckpointError, load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "deepseek-v3-tiny-mtp"
pytestmark = [pytest.mark.demo, pytest.mark.skipif(not any(DEMO.glob("*.safetensors")),
                                                   reason="demo model weights not present")]


def _exact(x_q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x_q.double() @ w.double().t()


@pytest.mark.parametrize("k", [1536, 64])
def test_sums_are_the_exact_ones_rounded_once_to_bf16(k):
    g = torch.Generator().manual_seed(k)
    w = torch.randint(-127, 128, (1000, k), dtype=torch.int8, generator=g)
    x_q = torch.randint(-127, 128, (5, k), dtype=torch.int8, generator=g)
    got = quant.int8_matmul(x_q, w, "int8pack")
    assert got.dtype == torch.float32
    assert torch.equal(got, _exact(x_q, w).to(torch.bfloat16).float())
    # A row alone gives what it gives among others: MTP's k+1-row windows stay lossless.
    assert torch.equal(quant.int8_matmul(x_q[2:3], w, "int8pack"), got[2:3])


def test_prompts_rows_take_the_exact_sums_in_blocks(monkeypatch):
    """From INT8PACK_MAX_ROWS rows (prompts) the exact float path runs instead (the kernel
    is compute-bound there); it converts the weight a block of rows at a time, the weight
    on the left up to 128 rows, and its sums are the exact ones either way."""
    monkeypatch.setattr(gemm, "BLOCK_BYTES", 4 * 1536 * 96)                   # 96-row blocks
    g = torch.Generator().manual_seed(2)
    for k in (1536, 512):                                   # two float32 parts / one
        w = torch.randint(-127, 128, (1000, k), dtype=torch.int8, generator=g)
        for rows in (quant.INT8PACK_MAX_ROWS, 200):
            x_q = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=g)
            assert torch.equal(quant.int8_matmul(x_q, w, "int8pack").double(), _exact(x_q, w))
            assert torch.equal(quant.int8_matmul(x_q, w, "float").double(), _exact(x_q, w))
        few = torch.randint(-127, 128, (quant.INT8PACK_MAX_ROWS - 1, k), dtype=torch.int8, generator=g)
        assert torch.equal(quant.int8_matmul(few, w, "int8pack"), _exact(few, w).to(torch.bfloat16).float())


def test_in_features_it_cannot_take_get_the_exact_sums():
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (64, 100), dtype=torch.int8, generator=g)   # 100 % 8 != 0
    x_q = torch.randint(-127, 128, (3, 100), dtype=torch.int8, generator=g)
    assert torch.equal(quant.int8_matmul(x_q, w, "int8pack").double(), _exact(x_q, w))


def test_float32_models_never_take_it():
    assert quant.fastest_int8_backend("cpu", torch.float32) in quant.EXACT_BACKENDS
    assert quant.fastest_int8_backend("cpu", torch.bfloat16) in quant.EXACT_BACKENDS + ("int8pack",)


def test_row_parallel_layers_keep_the_exact_sums(monkeypatch):
    layer = quant.QuantLinear(64, 32, "w8a8_dynamic", backend="int8pack", row_parallel=True)
    monkeypatch.setattr(qlinear.collectives, "all_reduce", lambda t, op="sum": t)
    seen = []
    real = quant.int8_matmul
    monkeypatch.setattr(qlinear, "int8_matmul", lambda x, w, b: seen.append(b) or real(x, w, b))
    layer(torch.randn(2, 64, dtype=torch.bfloat16))
    assert seen == ["float"]


@pytest.mark.parametrize("inter", [16, 12])         # 12: the down product keeps the exact sums
def test_gathered_experts_compute_what_the_routed_ones_do(inter):
    g = torch.Generator().manual_seed(inter)
    E, H, k = 4, 32, 2
    gate_up = torch.randint(-127, 128, (E, 2 * inter, H), dtype=torch.int8, generator=g)
    down = torch.randint(-127, 128, (E, H, inter), dtype=torch.int8, generator=g)
    gu_scale, down_scale = torch.rand(E, 2 * inter, generator=g) / 500, torch.rand(E, H, generator=g) / 500
    x = torch.randn(3, H, generator=g).to(torch.bfloat16)
    weights, idx = torch.rand(3, k, generator=g), torch.tensor([[0, 3], [2, 3], [1, 0]])
    got = quant.gathered_int8_experts(x, weights, idx, gate_up, gu_scale, down, down_scale, backend="int8pack")
    for t in range(3):
        want = sum(quant.int8_expert(x[t:t + 1], gate_up[e], gu_scale[e], down[e], down_scale[e], "int8pack")[0]
                   .float() * weights[t, j] for j, e in enumerate(idx[t].tolist()))
        torch.testing.assert_close(got[t], want, atol=1e-5, rtol=1e-5)


def test_a_bf16_w8a8_model_agrees_with_the_exact_path_and_mtp_stays_lossless(quantized, monkeypatch):
    calls = []
    real = int8pack.int8pack_mm
    monkeypatch.setattr(int8pack, "int8pack_mm", lambda *a: calls.append(1) or real(*a))
    with pytest.raises(CheckpointError, match="int8pack"):
        load_checkpoint(quantized["ct"], int8_backend="int8pack")          # float32
    models = {b: load_checkpoint(quantized["ct"], dtype=torch.bfloat16, int8_backend=b)[0].eval()
              for b in ("float", "int8pack")}
    models["float32"] = load_checkpoint(quantized["ct"], int8_backend="float")[0].eval()
    ids = torch.tensor([list(range(5, 60))])
    with torch.inference_mode():
        logits = {b: m.compute_logits(m.forward_full(ids)[0]).float() for b, m in models.items()}
    assert calls, "the int8pack backend never ran torch._weight_int8pack_mm"
    # The extra bf16 rounding of the integer sums moves the logits no more than computing
    # the same int8 model in bf16 instead of float32 does.
    bf16_noise = (logits["float"] - logits["float32"]).abs().mean()
    assert (logits["int8pack"] - logits["float"]).abs().mean() <= 2 * bf16_noise
    agree = (logits["int8pack"].argmax(-1) == logits["float"].argmax(-1)).float().mean()
    assert agree >= 0.9

    from server.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(DEMO)
    prompts = [list(range(10 + 7 * i, 40 + 7 * i)) for i in range(4)]

    def run(k: int) -> dict:
        cfg = EngineConfig(block_size=16, num_blocks=256, num_speculative_tokens=k, max_queue_delay_us=0,
                           max_batch_size=4, max_seq_len=256, adaptive_speculation=False)
        eng = LLMEngine(models["int8pack"], cfg, tok, eos_token_ids=set())
        outs = eng.generate([EngineRequest(f"r{i}", p, SamplingParams(max_tokens=24, temperature=0))
                             for i, p in enumerate(prompts)])
        return {r: [t for o in v for t in o.token_ids] for r, v in outs.items()}

    assert run(1) == run(0)


def test_a_compiled_graph_calls_it_and_loads_from_disk(tmp_path):
    """Traced into a graph (compile_step._load_or_compile: compiled, saved, loaded again),
    the int8pack layer and gathered experts call the backend as they do uncompiled; the
    experts' operator takes the same integers, so only the graph's fused rounding differs."""
    from server.engine.worker import compile_step
    g = torch.Generator().manual_seed(3)
    E, I, H, k = 4, 16, 32, 2
    gate_up = torch.randint(-127, 128, (E, 2 * I, H), dtype=torch.int8, generator=g)
    down = torch.randint(-127, 128, (E, H, I), dtype=torch.int8, generator=g)
    gate_up_scale, down_scale = torch.rand(E, 2 * I, generator=g) / 500, torch.rand(E, H, generator=g) / 500
    layer = quant.QuantLinear(H, H, "w8a8_dynamic", backend="int8pack")
    layer.weight.data = torch.randint(-127, 128, (H, H), dtype=torch.int8, generator=g)
    layer.weight_scale.data = torch.rand(H, generator=g) / 500

    def fn(layer, x, weights, idx, *stacks):      # modules as arguments, as static_decode's
        return layer(x) + quant.gathered_int8_experts(x, weights, idx, *stacks, backend="int8pack").to(x.dtype)

    x = torch.randn(2, H, generator=g).to(torch.bfloat16)
    args = (layer, x, torch.rand(2, k, generator=g), torch.tensor([[0, 3], [2, 3]]),
            gate_up, gate_up_scale, down, down_scale)
    path = tmp_path / "g.bin"
    with torch.inference_mode():
        want = fn(*args).float()
        graph, hit = compile_step._load_or_compile(fn, args, path, torch.device("cpu"), static=True)
        loaded, hit_again = compile_step._load_or_compile(fn, args, path, torch.device("cpu"), static=True)
        got, again = graph(*args).float(), loaded(*args).float()
    assert (hit, hit_again) == (False, True)
    assert torch.equal(got, again)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_checkpoint_layers_of_two_models_run_in_one_process_compiled(quantized, tmp_path):
    """What ``benchmarks.engine_step --against`` does with a bf16 model and its W8A8 copy
    (both compiled, one process), on the demo model's layers as loaded from disk: int8pack
    layers whose weights safetensors placed off a 64-byte boundary took a general
    protection fault in a compiled graph on AVX-512 (aligned loads).  Loaded, every weight
    is aligned, and each graph computes what its layer computes uncompiled."""
    from server.engine.worker import compile_step
    from server.model import kernels
    int8, _ = load_checkpoint(quantized["ct"], dtype=torch.bfloat16, int8_backend="int8pack")
    half, _ = load_checkpoint(DEMO, dtype=torch.bfloat16)
    assert list(kernels.misaligned(int8)) == [] and list(kernels.misaligned(half)) == []
    q = int8.model.layers[0].self_attn.q_a_proj
    f = half.model.layers[0].self_attn.q_a_proj
    assert isinstance(q, quant.QuantLinear) and q.backend == "int8pack" and quant.packs("int8pack", q.in_features)

    def fn(q, f, x):                                # modules as arguments, as static_decode's
        return q(x).float().sum(-1) + f(x).float().sum(-1)

    x = torch.randn(5, q.in_features).to(torch.bfloat16)
    calls = []
    real = int8pack.int8pack_mm
    with torch.inference_mode():
        want = fn(q, f, x)
        graph, _ = compile_step._load_or_compile(fn, (q, f, x), tmp_path / "g.bin", torch.device("cpu"),
                                                 static=True)
        got = graph(q, f, x)
        with pytest.MonkeyPatch.context() as mp:    # eager: the operator itself ran
            mp.setattr(int8pack, "int8pack_mm", lambda *a: calls.append(1) or real(*a))
            fn(q, f, x)
    assert calls
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0.02)
