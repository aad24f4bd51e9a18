"""The "avx2" int8 backend (server/model/quant/int8.py, half_avx2.c): the exact integer sums
``torch._int_mm`` gives, read a byte a weight, eager and as operators of a compiled graph;
the gathered experts' rows through it; a W8A8 model on it serves what the exact float
path serves."""
from __future__ import annotations

import platform
import shutil

import pytest
import torch

import server.model.quant.int8 as int8
from server.model import quant
from server.model.kernels import half_cpu, native
from server.model.loading import load_checkpoint
from tests.model.int8_moe_cases import check_one_operator, moe_window


@pytest.fixture(autouse=True)
def kernel():
    if platform.machine() != "x86_64" or not torch.cpu._is_avx2_supported() or not shutil.which("cc"):
        pytest.skip("half_avx2.c needs an x86 CPU with AVX2 and a C compiler")
    assert native.half_kernel() is not None, "AVX2 and cc are here: the kernel must build"


def _exact(x_q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x_q.double() @ w.double().t()).to(torch.int64)


# 37 rows: a prompt's order (blocks of weight rows through rows of x), with tails of both.
@pytest.mark.parametrize("k,rows", [(1536, 9), (203, 9), (9000, 9), (203, 37)])
def test_sums_are_the_exact_ones_and_each_rows_own(k, rows):
    """Any in-features (a tail past the 16-wide vectors, more than 2**24 / 128**2 of them),
    any out-features, the extremes of int8: int32 sums equal to the exact ones, and a row's
    the same alone as beside others."""
    g = torch.Generator().manual_seed(k)
    w = torch.randint(-128, 128, (101, k), dtype=torch.int8, generator=g)
    w[0] = -128
    x_q = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=g)
    x_q[0] = -127
    got = quant.int8_matmul(x_q, w, "avx2")
    assert got.dtype == torch.int32 and torch.equal(got.to(torch.int64), _exact(x_q, w))
    assert torch.equal(quant.int8_matmul(x_q[4:5], w, "avx2"), got[4:5])
    compiled = torch.compile(lambda a, b: quant.int8_matmul(a, b, "avx2") * 2, dynamic=True)
    assert torch.equal(compiled(x_q, w), got * 2)


@pytest.mark.parametrize("rows,k,n", [(1, 1536, 40), (9, 37, 11), (37, 203, 70)])
def test_the_dynamic_product_in_one_operator_is_quantlinears_numbers(rows, k, n):
    """Eager, the dynamic scheme's quantization, integer sums and scaling are one operator
    (int8_dynamic_mm): the numbers of torch's operations over the same rows bit for bit
    (a zero row, values on the rounding's half-way points, tails past 8 and 32 lanes, a
    prompt's row count); traced, the graph keeps torch's operations."""
    if not native.native_ops():
        pytest.skip("ops.cpp cannot be built here")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g) * 3
    x[0, :4] = torch.tensor([127.0, -63.5, 0.5, -0.5])        # s = 1: half-way points
    x[0, 4:] = 0.0
    if rows > 2:
        x[2] = 0.0
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    ws = torch.rand(n, generator=g) / 50
    s = int8.row_scales(x)
    want = quant.int8_matmul(int8.quantize_rows(x, s).to(torch.int8), w, "avx2").float() * (s * ws)
    assert torch.equal(int8.dynamic_product(x, w, ws, "avx2"), want)
    assert torch.equal(torch.ops.mtp_native.int8_dynamic_mm(x, w, ws), want)
    compiled = torch.compile(lambda a: int8.dynamic_product(a, w, ws, "avx2"), dynamic=True)
    assert torch.equal(compiled(x), want)
    with pytest.raises(RuntimeError, match="one float32 scale a weight row"):
        torch.ops.mtp_native.int8_dynamic_mm(x, w, ws[1:].contiguous())
    with pytest.raises(RuntimeError, match="rows have"):
        torch.ops.mtp_native.int8_dynamic_mm(x[:, 1:].contiguous(), w, ws)


def test_activations_past_127_take_the_widening_path_to_the_same_exact_sums():
    """The byte products (vpmaddubsw) need activations within +-127; a static scheme's
    reach -128 and, with a zero point, past the int8 range: those rows are summed by the
    widening blocks, exactly too."""
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (33, 100), dtype=torch.int8, generator=g)
    x = torch.randint(-127, 128, (3, 100), generator=g).to(torch.int16)
    x[1, 7], x[2, 3] = -128, 300
    want = (x.double() @ w.double().t()).to(torch.int64)
    assert torch.equal(int8.int8_kernel_mm(x, w).to(torch.int64), want)
    expert = torch.tensor([0, 0, 0])
    assert torch.equal(int8.int8_rows(x.float(), expert, w[None]).to(torch.int64), want)


def test_gathered_rows_read_their_own_experts():
    g = torch.Generator().manual_seed(3)
    w = torch.randint(-128, 128, (5, 40, 96), dtype=torch.int8, generator=g)
    rows = torch.randint(-127, 128, (7, 96), generator=g).float()
    expert = torch.tensor([4, 0, 0, 2, 4, 1, 3])
    got = torch.ops.mtp_serve.int8_rows(rows, expert, w)
    want = torch.stack([_exact(r[None], w[e])[0] for r, e in zip(rows, expert.tolist())])
    assert got.dtype == torch.int32 and torch.equal(got.to(torch.int64), want)


@pytest.mark.parametrize("tokens,k,h,i", [(1, 4, 1536, 512), (3, 4, 1536, 512), (37, 2, 203, 37)])
def test_the_routed_int8_experts_in_one_operator_are_the_gathered_ones(tokens, k, h, i):
    """int8_moe (half_avx2.c): quant.experts.gathered_int8_experts' numbers for bfloat16
    activations bit for bit (the torch operations around int8_rows: quantizing, scaling,
    the activation's bf16 roundings, requantizing, the weighted sum), a zero row among them;
    each token's row the same alone as in its window (MTP's verify windows stay lossless);
    refusals for ids outside the experts and scales of the wrong size."""
    from server.model.quant import experts
    if not native.native_ops() or not experts.native_moe("avx2"):
        pytest.skip("ops.cpp cannot be built here")
    op = torch.ops.mtp_native.int8_moe
    x, w, idx, gate_up, gus, down, ds = case = moe_window(tokens, k, h, i, all_on_one=False)
    check_one_operator("avx2", op, case)
    with pytest.raises(RuntimeError, match="scales must be"):
        op(x.float(), w, idx, gate_up, gus[1:].contiguous(), down, ds)


def test_the_fastest_backend_is_chosen_among_the_exact_ones_with_it():
    int8._FASTEST.clear()
    try:
        assert quant.fastest_int8_backend("cpu", torch.float32) in quant.EXACT_BACKENDS
    finally:
        int8._FASTEST.clear()


@pytest.mark.demo
def test_a_w8a8_model_on_it_serves_the_exact_float_paths_logits(quantized):
    from tests.model.test_quantized import heldout
    prompts, conts = heldout()
    ids = torch.tensor([prompts[0] + conts[0]])
    with torch.inference_mode():
        outs = []
        for backend in ("float", "avx2"):
            model = load_checkpoint(quantized["w8a8"], int8_backend=backend)[0]
            assert {m.backend for m in model.modules() if isinstance(m, quant.QuantLinear)} == {backend}
            outs.append(model.compute_logits(model.forward_full(ids)[0]))
    assert torch.equal(outs[0], outs[1])
