"""The 16-bit products for a CPU without 16-bit float instructions (kernels/half_cpu.py):
``HalfCpuProducts`` eager (half_avx2.c up to KERNEL_ROWS rows, float32 GEMMs past it) and
the forms a compiled graph of each window takes (``window``): the same products as
``F.linear`` and the absorbed attention's bmms to bf16 rounding.  The backend is made here
as an object, so these run on every CPU able to run them, AVX-512 ones included, where
the automatic choice is oneDNN's own product."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from server.model import kernels
from server.model.kernels import gemm, half_cpu, native, select
from server.model.kernels.products import Products, products_for, use_products
from server.model.layers.linear import Linear


@pytest.fixture
def products() -> half_cpu.HalfCpuProducts:
    """The "avx2" backend where the kernel runs here, else "float32"."""
    return half_cpu.HalfCpuProducts(native.half_kernel())


def test_latent_products_are_the_bmms(products):
    """Eager, every backend's absorbed-attention products are torch's bmms."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 16 + 8, 32, generator=g).to(torch.bfloat16)       # [nH, dn + dv, kvr]
    w_uk, w_uv = w[:, :16], w[:, 16:]
    for t in (1, 3):
        q = torch.randn(t, 4, 16, generator=g).to(torch.bfloat16)
        o = torch.randn(t, 4, 32, generator=g).to(torch.bfloat16)
        want_q = torch.bmm(q.transpose(0, 1).float(), w_uk.float()).transpose(0, 1)
        want_o = torch.bmm(o.transpose(0, 1).float(), w_uv.transpose(1, 2).float()).transpose(0, 1)
        for p in (products, products.window("lone")):                    # not tracing: the bmms
            torch.testing.assert_close(p.latent_query(q, w_uk).float(), want_q, atol=0.05, rtol=0.01)
            torch.testing.assert_close(p.latent_value(o, w_uv).float(), want_o, atol=0.05, rtol=0.01)


def test_latent_attention_is_the_bf16_bmms_in_float32_while_traced(products):
    """Uncompiled, the bf16 bmms; traced in a window's form, the same attention in float32
    (one rounding to bf16 at the end), each query row computed alone: a verify window's
    rows equal the same rows attended one at a time, as MTP's losslessness needs."""
    g = torch.Generator().manual_seed(7)
    heads, kvr, dim, ctx_len = 4, 32, 40, 50
    ctx = torch.randn(1, ctx_len, dim, generator=g).to(torch.bfloat16)
    q = torch.randn(1, 2 * heads, dim, generator=g).to(torch.bfloat16)          # 2 rows x heads
    visible = torch.arange(ctx_len)[None, :] <= torch.tensor([[47], [48]])       # [Q, S]
    bias = torch.zeros(1, 2, ctx_len).masked_fill(~visible[None], float("-inf"))
    bias = bias.repeat_interleave(heads, dim=1).to(torch.bfloat16)
    scale = dim ** -0.5
    scores = torch.baddbmm(bias, q, ctx.transpose(1, 2), alpha=scale)
    eager = torch.bmm(scores.softmax(-1), ctx[:, :, :kvr])
    lone = products.window("lone")
    assert torch.equal(lone.latent_attention(q, ctx, bias, scale, kvr), eager)
    exact = torch.bmm(torch.baddbmm(bias.float(), q.float(), ctx.float().transpose(1, 2), alpha=scale)
                      .softmax(-1), ctx[:, :, :kvr].float())
    fn = torch.compile(lambda q, ctx, bias: lone.latent_attention(q, ctx, bias, scale, kvr),
                       dynamic=False, fullgraph=True)
    both = fn(q, ctx, bias)
    alone = [fn(q[:, r * heads:(r + 1) * heads], ctx, bias[:, r * heads:(r + 1) * heads]) for r in range(2)]
    assert both.dtype == torch.bfloat16
    torch.testing.assert_close(both.float(), exact, atol=0.0, rtol=2 ** -8)      # one bf16 rounding
    torch.testing.assert_close(both.float(), eager.float(), atol=0.05, rtol=0.02)
    assert torch.equal(torch.cat(alone, dim=1), both)


@pytest.mark.parametrize("rows", [2, 3, 8])
def test_rows_linear_is_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    for bias in (None, b):
        want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        got = half_cpu.rows_linear(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.01)


@pytest.mark.parametrize("kernel", [True, False])
def test_batch_linear_is_f_linear_for_any_row_count(kernel):
    """A batch window's linear (its rows symbolic in the graph): compiled once with a
    dynamic row count, it gives F.linear's products to bf16 rounding at every count, through
    the kernel's operator or as reductions."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    fn = torch.compile(half_cpu.batch_linear, dynamic=True, fullgraph=True)
    for rows in (2, 5, 16):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        for bias in (None, b):
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            for got in (half_cpu.batch_linear(x, w, bias, kernel), fn(x, w, bias, kernel)):
                assert got.dtype == torch.bfloat16 and got.shape == want.shape
                torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.01)


def _ops(module, x) -> list[str]:
    """The operators of the graph Dynamo traces for ``module(x)``."""
    ops = []

    def capture(gm, _inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        return gm.forward
    torch._dynamo.reset()
    torch.compile(module, backend=capture, dynamic=False, fullgraph=True)(x)
    return ops


def test_each_window_traces_its_form_and_only_while_tracing(products):
    """A Linear traced with its products' window form takes that form; the layer's own
    products come back after; nothing outside the layer is touched (F.linear is torch's)."""
    lin = Linear(32, 48, bias=False).to(torch.bfloat16)
    use_products([lin], products)
    x2 = torch.randn(2, 32).to(torch.bfloat16)
    linear_before = F.linear
    with products_for([lin], products.window("lone")):
        eager = lin(x2)                                  # not tracing: the eager products
        assert "linear" not in str(_ops(lin, x2[:1]))    # one row too: as a plain step's row
        lin32 = Linear(32, 48, bias=False)
        use_products([lin32], products.window("lone"))
        assert "linear" in str(_ops(lin32, x2.float()))  # float32 weight
        rows = _ops(lin, x2)
        assert "linear" not in str(rows)
        if products.kernel is not None:                  # half_avx2.c's operator, any rows
            assert {"mtp_native.half_mm", "mtp_serve.half_mm"} & set(rows) and "sum" not in rows
            assert "linear" not in str(_ops(lin, torch.randn(9, 32).to(torch.bfloat16)))
        else:
            assert rows.count("sum") == 2                # one reduction per row
            assert "linear" in str(_ops(lin, torch.randn(9, 32).to(torch.bfloat16)))   # over MAX_ROWS
        out = torch.compile(lin, backend="eager", dynamic=False, fullgraph=True)(x2)
    assert lin.products is products and F.linear is linear_before
    with products_for([lin], products.window("batch")):  # a batch graph: half_avx2.c's operator
        batch = _ops(lin, x2)
        if products.kernel is not None:
            assert {"mtp_native.half_mm", "mtp_serve.half_mm"} & set(batch) and "sum" not in batch
    with products_for([lin], half_cpu.HalfCpuProducts(None).window("batch")):
        batch = _ops(lin, x2)                            # or one reduction, rows inner
        assert "linear" not in str(batch) and batch.count("sum") == 1
    with products_for([lin], products.window("prompt")):  # a prompt: a float32 GEMM
        assert "linear" in str(_ops(lin, x2)) and "float" in str(_ops(lin, x2))
    with pytest.raises(ValueError, match="window"):
        products.window("decode")
    assert Products().window("lone").linear is not None       # torch's own: itself
    torch.testing.assert_close(out.float(), eager.float(), atol=0.05, rtol=0.01)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eager_products_take_the_kernel_then_float32_gemms(products, monkeypatch, dtype):
    """Eager, bf16 products of any rows take half_avx2.c (a prompt's rows as a decode
    step's), float16 ones up to KERNEL_ROWS rows and the float32 GEMM past it; without the
    kernel, FLOAT32_ROWS rows or more take the float32 GEMM and fewer F.linear's own;
    float32 weights always F.linear's."""
    gemm_rows, kernel_rows = [], []
    real_f32, real_kernel = half_cpu.float32_linear, half_cpu.kernel_linear
    monkeypatch.setattr(half_cpu, "float32_linear", lambda *a: gemm_rows.append(a[0].shape[0]) or real_f32(*a))
    monkeypatch.setattr(half_cpu, "kernel_linear",
                        lambda lib, *a: (kernel_rows.append(a[0].shape[0]) if lib is not None else None)
                        or real_kernel(lib, *a))
    w = torch.randn(48, 32).to(dtype)
    rows = (1, half_cpu.FLOAT32_ROWS - 1, half_cpu.FLOAT32_ROWS, half_cpu.KERNEL_ROWS,
            half_cpu.KERNEL_ROWS + 1)
    every = dtype == torch.bfloat16
    for p in (products, half_cpu.HalfCpuProducts(None)):
        gemm_rows.clear(), kernel_rows.clear()
        for n in rows:
            x = torch.randn(n, 32).to(dtype)
            torch.testing.assert_close(p.linear(x, w).float(), x.float() @ w.float().t(), atol=0.05, rtol=0.01)
        p.linear(torch.randn(200, 32), w.float())        # float32 weights: F.linear's
        with_kernel = p.kernel is not None
        assert kernel_rows == (list(rows if every else rows[:-1]) if with_kernel else [])
        assert gemm_rows == list(([] if every else rows[-1:]) if with_kernel else rows[2:])


def _kernel_or_skip():
    import platform
    import shutil
    if platform.machine() != "x86_64" or not torch.cpu._is_avx2_supported() or not shutil.which("cc"):
        pytest.skip("half_avx2.c needs an x86 CPU with AVX2 and a C compiler")
    lib = native.half_kernel()
    assert lib is not None, "AVX2 and cc are here: the kernel must build"
    return lib


# (rows, N, K): rows past the streamed order's 16 (tiles of 64 rows, odd ones left over),
# N past blocks of 16 with a tail, K past spans of 512 with a tail past the 16-wide pairs.
@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (46, 101, 203)), (torch.float16, (46, 101, 203)),
                                         (torch.bfloat16, (149, 37, 1100))])
def test_half_kernel_is_f_linear_and_each_row_is_summed_alone(dtype, shape):
    """half_avx2.c: the float32 product over the 16-bit weight (any N, K with a tail past
    the 8-wide vectors, bias, 3-d rows), and each row's result bit for bit the same at any
    row count: a window of k+1 rows gives each row what a one-row step gives, and a
    prompt's rows (bf16: tiled, not streamed) what a decode step gives."""
    lib = _kernel_or_skip()
    g = torch.Generator().manual_seed(1)
    m, n, k = shape
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(*((2, m // 2) if m % 2 == 0 else (1, m)), k, generator=g).to(dtype)
    out = half_cpu.kernel_linear(lib, x, w, b)
    assert out.shape == (*x.shape[:-1], n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()),
                               atol=0.02, rtol=0.01)
    flat = x.reshape(-1, k)
    alone = torch.cat([half_cpu.kernel_linear(lib, flat[i:i + 1], w, b) for i in range(len(flat))])
    assert torch.equal(alone, out.reshape(-1, n))
    assert torch.equal(half_cpu.kernel_linear(lib, flat[5:7], w, b), alone[5:7])
    assert torch.equal(half_cpu.kernel_linear(lib, flat[3:20], w, b), alone[3:20])
    assert half_cpu.kernel_linear(lib, x, w.t().contiguous().t()) is None      # column-major: not its
    assert half_cpu.kernel_linear(lib, x, w.float()) is None
    assert half_cpu.kernel_linear(None, x, w) is None


def test_half_kernel_runs_a_routed_moes_experts_in_one_call():
    """``kernel_experts``: every expert's gate/up, SiLU and down over its rows (some with
    none) in one call, the float32 products of the stacked weights; each row's result the
    same whatever rows the other experts hold (also past the streamed order's 16 rows an
    expert, where bf16 tiles); float16 refused past KERNEL_ROWS rows an expert; nothing
    without the kernel."""
    lib = _kernel_or_skip()
    g = torch.Generator().manual_seed(2)
    e, h, i = 5, 72, 40
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * 0.1).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=g) * 0.1).to(torch.bfloat16)
    counts = [3, 0, 6, 1, 2]
    xs = torch.randn(sum(counts), h, generator=g).to(torch.bfloat16)
    out = half_cpu.kernel_experts(lib, xs, counts, gate_up, down)
    want, start = [], 0
    for j, n in enumerate(counts):
        want.append(_experts_reference(xs[start:start + n], gate_up[j], down[j], i))
        start += n
    torch.testing.assert_close(out, torch.cat(want), atol=1e-4, rtol=1e-4)
    alone = half_cpu.kernel_experts(lib, xs[3:4], [0, 0, 1, 0, 0], gate_up, down)  # expert 2's first row
    assert torch.equal(alone[0], out[3])
    many = torch.randn(half_cpu.KERNEL_ROWS + 1, h, generator=g).to(torch.bfloat16)
    tiled = half_cpu.kernel_experts(lib, many, [0, 0, 0, len(many), 0], gate_up, down)
    assert torch.equal(tiled[7], half_cpu.kernel_experts(lib, many[7:8], [0, 0, 0, 1, 0], gate_up, down)[0])
    torch.testing.assert_close(tiled, _experts_reference(many, gate_up[3], down[3], i), atol=1e-4, rtol=1e-4)
    assert half_cpu.kernel_experts(lib, many.half(), [len(many)], gate_up[:1].half(), down[:1].half()) is None
    assert half_cpu.kernel_experts(None, xs, counts, gate_up, down) is None


def _experts_reference(x, gate_up, down, i):
    gu = x.float() @ gate_up.float().t()
    return (F.silu(gu[:, :i]) * gu[:, i:]) @ down.float().t()


def test_gathered_experts_give_the_eager_moes_numbers_for_any_window():
    """``half_gathered`` (half_avx2.c's ``half_moe_bf16`` in one call): each token's top-k
    experts, weighted and summed, equal to the eager MoE's float32 ``index_add_`` of the
    same kernel's expert outputs, value for value; a token's output is the same alone and
    among others (a window's rows are a lone row's); an expert id outside the stack is
    refused, not read."""
    lib = _kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    e, h, i, t, k = 6, 40, 24, 5, 3                       # h, i not multiples of 16: the tails
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * 0.1).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    got = half_cpu.half_gathered(x, weights, idx, gate_up, down)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ys = half_cpu.kernel_experts(lib, x.float().index_select(0, order // k),
                                 torch.bincount(flat, minlength=e).tolist(), gate_up, down)
    want = torch.zeros(t, h).index_add_(0, order // k, ys * weights.reshape(-1)[order, None])
    assert torch.equal(got, want)
    assert torch.equal(half_cpu.half_gathered(x[2:3], weights[2:3], idx[2:3], gate_up, down)[0], got[2])
    with pytest.raises((IndexError, RuntimeError)):
        half_cpu.half_gathered(x[:1], weights[:1], torch.tensor([[0, 1, e]]), gate_up, down)
    if native.native_ops():                 # the C++ operator a compiled window calls: the same
        op = torch.ops.mtp_native.half_moe
        assert torch.equal(op(x.float(), weights, idx, gate_up, down), got)
        with pytest.raises(RuntimeError, match=r"expert id 6 outside \[0, 6\)"):
            op(x[:1].float(), weights[:1], torch.tensor([[0, 1, e]]), gate_up, down)
        with pytest.raises(RuntimeError, match="contiguous"):
            op(x.float(), weights, idx, gate_up.transpose(1, 2), down)


def test_a_bf16_moe_serves_through_the_kernel_what_it_serves_without(tmp_path, monkeypatch):
    """A routed bf16 MoE layer (experts stacked, as the serving loader leaves them) gives
    the per-expert path's output through ``kernel_experts``, to bf16 rounding."""
    lib = _kernel_or_skip()
    from server.model.loading import load_checkpoint
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    model, _ = load_checkpoint(make_tiny_checkpoint(tmp_path / "m", dtype="bfloat16"))
    moe = next(m for m in model.modules() if hasattr(m, "expert_stacks"))
    moe.expert_stacks()
    calls = []
    real = half_cpu.kernel_experts
    monkeypatch.setattr(half_cpu, "kernel_experts", lambda *a: calls.append(real(*a)) or calls[-1])
    x = torch.randn(7, moe.gate.weight.shape[1]).to(torch.bfloat16)
    with torch.inference_mode():
        monkeypatch.setattr(type(moe), "_macs_per_token_dense", property(lambda _: 1 << 60))  # routed
        use_products([moe], half_cpu.HalfCpuProducts(lib))
        fused = moe(x)
        use_products([moe], Products())
        looped = moe(x)
    assert [c is not None for c in calls] == [True]                      # the kernel, then not asked
    torch.testing.assert_close(fused.float(), looped.float(), atol=0.03, rtol=0.02)


def test_half_kernel_builds_into_its_cache_and_a_failed_build_falls_back(tmp_path, monkeypatch):
    _kernel_or_skip()
    monkeypatch.setenv(kernels.KERNEL_CACHE_ENV, str(tmp_path / "k"))
    try:
        kernels.kernel_settings.cache_clear()
        native.kernel_library.cache_clear()
        assert native.half_kernel() is not None
        assert [p.suffix for p in (tmp_path / "k").iterdir()] == [".so"]     # no part left
        native.kernel_library.cache_clear()
        monkeypatch.setenv(kernels.KERNEL_CACHE_ENV, str(tmp_path / "broken"))
        kernels.kernel_settings.cache_clear()
        monkeypatch.setenv("CC", "false")                                  # exits 1
        assert native.half_kernel() is None
        native.kernel_library.cache_clear()
        monkeypatch.delenv("CC")
        monkeypatch.setenv(kernels.KERNEL_ENV, "0")
        kernels.kernel_settings.cache_clear()
        assert native.half_kernel() is None
    finally:
        monkeypatch.undo()
        kernels.kernel_settings.cache_clear()
        native.kernel_library.cache_clear()


def test_float32_products_of_a_large_weight_convert_it_by_blocks_to_the_same_result(monkeypatch):
    """Eager, a weight whose float32 copy exceeds gemm.BLOCK_BYTES is converted a block of
    output rows at a time (no fresh whole copy per call); every output column is the same
    dot product, so the result is the whole float32 product's, bit for bit (bias, 3-d rows)."""
    monkeypatch.setattr(gemm, "BLOCK_BYTES", 4 * 32 * 7)             # 7 rows of a [*, 32]
    blocks = []
    real = gemm.float_block
    monkeypatch.setattr(gemm, "float_block", lambda w, start, rows: blocks.append(rows) or real(w, start, rows))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 9, 32, generator=g).to(torch.bfloat16)
    out = half_cpu.float32_linear(x, w, b)
    assert out.shape == (2, 9, 48) and out.dtype == torch.bfloat16
    assert [min(7, 48 - 7 * i) for i in range(len(blocks))] == [7] * 6 + [6]  # never all 48 rows
    monkeypatch.setattr(gemm, "BLOCK_BYTES", 1 << 30)
    assert torch.equal(out, half_cpu.float32_linear(x, w, b))                    # one block: the same
    ref = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.01)
    # Past FLIP_ROWS rows the rows are the GEMM's left operand; the same products.
    many = torch.randn(gemm.FLIP_ROWS + 1, 32, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(half_cpu.float32_linear(many, w, b).float(),
                               F.linear(many.float(), w.float(), b.float()), atol=0.05, rtol=0.01)


def test_a_model_takes_these_products_only_for_16_bit_weights_on_a_cpu(monkeypatch):
    """select.model_products: the chosen 16-bit backend for a 16-bit model on a CPU, torch's
    own for float32 weights and on other devices; forms only where they pay."""
    for chosen, kind in (("onednn", Products), ("avx2", half_cpu.HalfCpuProducts),
                         ("float32", half_cpu.HalfCpuProducts)):
        if chosen == "avx2" and native.half_kernel() is None:
            continue
        monkeypatch.setattr(select, "half_backend_name", lambda chosen=chosen: chosen)
        p = select.model_products(torch.bfloat16, "cpu")
        assert type(p) is kind and p.takes_prompts is (chosen == "onednn")
        assert type(select.model_products(torch.float32, "cpu")) is Products
        assert type(select.model_products(torch.bfloat16, "cuda")) is Products
        assert p.column_major(torch.float32) and not (chosen != "onednn" and p.column_major(torch.bfloat16))


def test_a_16_bit_model_sends_no_prompt_through_the_prompt_graph_where_it_pays(tmp_path, products):
    """Its prompt graph would convert every weight to float32 on each call: the decoder
    takes no prompts (nor compiles the window) on these products; float32 models always do."""
    from server.model.loading import load_checkpoint
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    half, _ = load_checkpoint(make_tiny_checkpoint(tmp_path / "bf16", dtype="bfloat16"))
    full, _ = load_checkpoint(make_tiny_checkpoint(tmp_path / "fp32"))
    for p, takes in ((products, False), (Products(), True)):
        use_products([half], p)
        assert half.static_decoder.takes_prompts is takes
        assert full.static_decoder.takes_prompts


_TAKEN: list[str] = []


class Recorded(half_cpu.HalfCpuWindow):
    """The "lone" form, noting each latent product it is asked for (a compiled graph saves
    the objects it was traced with: a class of the module's top level)."""

    def latent_query(self, q_nope, w_uk):
        _TAKEN.append("latent_query")
        return super().latent_query(q_nope, w_uk)

    def latent_value(self, o, w_uv):
        _TAKEN.append("latent_value")
        return super().latent_value(o, w_uv)

    def head_rows(self, x, w):
        _TAKEN.append("head_rows")
        return super().head_rows(x, w)

    def paged_latent_attention(self, q, cache, block_tables, positions, scale, kvr):
        out = super().paged_latent_attention(q, cache, block_tables, positions, scale, kvr)
        if out is not None:
            _TAKEN.append("paged_latent_attention")
        return out


@pytest.mark.slow
def test_a_lone_verify_window_graph_takes_them_and_emits_what_the_eager_layer_emits(tmp_path, monkeypatch, products):
    """A 2-token window of a lone sequence through a bf16 tiny model's first layer on these
    products: the compiled graph (compile_step, window "lone", C++ wrapper, saved and
    loaded) reads its projections through half_avx2.c's operator (without the kernel
    ``rows_linear``), W_UK / W_UV and the attention through mla_avx2.c's operators (without
    them the latent reductions and the gathered context), and its output equals the
    uncompiled layer's to bf16 rounding."""
    from server.engine.worker import compile_step
    from server.model.loading import load_checkpoint
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    monkeypatch.setenv(compile_step.CPP_WRAPPER_ENV, "1")    # the serving default (the suite's is 0)
    taken = _TAKEN
    taken.clear()
    real_rows, real_batch = half_cpu.rows_linear, half_cpu.batch_linear
    monkeypatch.setattr(half_cpu, "rows_linear", lambda *a: taken.append("rows_linear") or real_rows(*a))
    monkeypatch.setattr(half_cpu, "batch_linear", lambda *a: taken.append("batch_linear") or real_batch(*a))
    model, _ = load_checkpoint(make_tiny_checkpoint(tmp_path / "ckpt", seed=1), dtype=torch.bfloat16)
    use_products([model], products)
    model.stack_projections()                                  # as the serving worker does
    device = torch.device("cpu")
    kind, index = next(iter(model.eval().static_decoder.layer_kinds().items()))
    lone = Recorded(products.kernel, "lone")
    with torch.inference_mode():
        args = compile_step._example(model, index, 2, True, 8, device, True, kind)
        fn = model.static_decoder.function(kind, False)
        want = fn(*args)
        path = Path(tempfile.mkdtemp(dir=tmp_path)) / "g.bin"
        graph, hit = compile_step._load_or_compile(fn, args, path, device, static=True, products=lone)
        got = graph(*args)
        loaded, hit_again = compile_step._load_or_compile(fn, args, path, device, static=True, products=lone)
        loaded.disable_guard_check()
        again = loaded(*args)
    assert (hit, hit_again) == (False, True)
    assert model.model.layers[index].self_attn.products is products      # its own again after tracing
    again = again[0] if isinstance(again, tuple) else again
    form = "batch_linear" if products.kernel is not None else "rows_linear"   # half_avx2.c's operator
    mla = {"head_rows", "paged_latent_attention"} if products.mla else {"latent_query", "latent_value"}
    assert taken.count(form) >= 4 and mla <= set(taken)
    want, got = (want[0], got[0]) if isinstance(want, tuple) else (want, got)
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.05)
    assert torch.equal(again, got)
