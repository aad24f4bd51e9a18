"""Our AVX-512 kernels (server/model/kernels/avx512.py): bf16 products with AVX-512 BF16
and exact int8 sums with AVX-512 VNNI, eager and as operators of a compiled graph, on every
CPU able to run them (skipped, saying why, elsewhere).  Each row's result is its own at
any row count (MTP's windows stay lossless); tails past the vector width are exact."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from server.model.kernels import avx512, native
from server.model.kernels.products import use_products
from tests.model.int8_moe_cases import check_one_operator, moe_window


def _needs(kernel: str):
    if native.kernel_library(kernel) is None:
        pytest.skip(f"{kernel}.c cannot run here (CPU flags or compiler)")


def _relative_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    exact = x.double() @ w.double().t()
    return ((got.double() - exact).abs() / (x.double().abs() @ w.double().abs().t())).max().item()


@pytest.mark.parametrize("n, k", [(101, 203), (96, 1536), (7, 31), (64, 64)])
def test_bf16_products_are_float32_sums_of_each_row_alone(n, k):
    _needs("avx512_bf16")
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(9, k, generator=g).to(torch.bfloat16)
    got = avx512.bf16_mm(x, w)
    assert got.dtype == torch.float32 and got.shape == (9, n)
    assert _relative_error(got, x, w) < 1e-6                   # float32 sums of exact products
    alone = torch.cat([avx512.bf16_mm(x[i:i + 1], w) for i in range(9)])
    assert torch.equal(alone, got)
    assert torch.equal(avx512.bf16_mm(x[3:8], w), got[3:8])
    for m in (2, 3, 4):                 # a window's few rows: one pass, a chain per row
        assert torch.equal(avx512.bf16_mm(x[:m], w), got[:m])


def test_the_products_take_the_kernel_for_a_windows_rows_and_onednn_past_them(monkeypatch):
    _needs("avx512_bf16")
    p = avx512.Avx512Products()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 40, generator=g).to(torch.bfloat16)
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    taken = []
    real = avx512.bf16_mm
    monkeypatch.setattr(avx512, "ops_ready", lambda: False)              # the ctypes call, counted
    monkeypatch.setattr(avx512, "bf16_mm", lambda x, w: taken.append(x.shape[0]) or real(x, w))
    for shape in ((1, 40), (2, 3, 40), (avx512.KERNEL_ROWS, 40), (avx512.KERNEL_ROWS + 1, 40)):
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        out = p.linear(x, w, b)
        assert out.shape == (*shape[:-1], 48) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()), atol=0.05, rtol=0.02)
    assert taken == [1, 6, avx512.KERNEL_ROWS]
    assert p.linear(torch.randn(2, 40), w.float()).dtype == torch.float32       # float32: torch's
    assert not p.column_major(torch.bfloat16) and p.column_major(torch.float32)


def test_bf16_experts_in_one_call_and_gathered_by_index():
    _needs("avx512_bf16")
    g = torch.Generator().manual_seed(2)
    e, h, i = 5, 72, 40
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * 0.1).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=g) * 0.1).to(torch.bfloat16)

    def expert(j: int, rows: torch.Tensor) -> torch.Tensor:
        gu = rows.float() @ gate_up[j].float().t()
        act = (F.silu(gu[:, :i]) * gu[:, i:]).to(torch.bfloat16)
        return act.float() @ down[j].float().t()

    counts = [3, 0, 6, 1, 2]
    xs = torch.randn(sum(counts), h, generator=g).to(torch.bfloat16)
    out = avx512.bf16_experts(xs, counts, gate_up, down)
    starts = [sum(counts[:j]) for j in range(e)]
    want = torch.cat([expert(j, xs[s:s + n]) for j, (s, n) in enumerate(zip(starts, counts)) if n])
    torch.testing.assert_close(out, want, atol=1e-3, rtol=1e-3)
    alone = avx512.bf16_experts(xs[3:4], [0, 0, 1, 0, 0], gate_up, down)    # expert 2's first row
    assert torch.equal(alone[0], out[3])
    assert avx512.bf16_experts(xs, [avx512.KERNEL_ROWS + 1], gate_up[:1], down[:1]) is None
    few = [2, 0, 3, 1, 2]               # at most 4 rows an expert: a chain per row, one pass
    out_few = avx512.bf16_experts(xs[:8], few, gate_up, down)
    owner = [j for j, n in enumerate(few) for _ in range(n)]
    for a, j in enumerate(owner):
        one = [int(m == j) for m in range(e)]
        assert torch.equal(avx512.bf16_experts(xs[a:a + 1], one, gate_up, down)[0], out_few[a])
    # Gathered: each token through its own top-k, weighted; the same per-expert numbers.
    x = torch.randn(3, h, generator=g).to(torch.bfloat16)
    idx = torch.tensor([[0, 3], [2, 3], [4, 0]])
    weights = torch.rand(3, 2, generator=g)
    got = avx512.Avx512Products().gathered_experts(x, weights, idx, gate_up, down)
    for t in range(3):
        ref = sum(expert(j, x[t:t + 1])[0] * weights[t, n] for n, j in enumerate(idx[t].tolist()))
        torch.testing.assert_close(got[t].float(), ref, atol=0.02, rtol=0.02)


@pytest.mark.parametrize("tokens", [1, 2, 5, 16])
def test_a_windows_moe_in_one_operator_is_the_eager_moes_numbers(tokens):
    """bf16_moe (the gathered MoE of a compiled step, grouped by expert): from the router's
    choice to the weighted sum, value for value what the eager MoE computes (its sorted
    rows through bf16_experts, weighted, index_add_ in float32), each token's alone (a
    verify window's rows equal the same rows one at a time); a bad expert id refused."""
    if not native.native_ops() or native.kernel_library("avx512_bf16") is None:
        pytest.skip("avx512_bf16.c or ops.cpp cannot run here")
    g = torch.Generator().manual_seed(tokens)
    e, h, i, k = 6, 72, 40, 3                              # 72, 40: tails past 16 and 32 lanes
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * 0.1).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(tokens, h, generator=g).to(torch.bfloat16)
    weights, idx = torch.randn(tokens, e, generator=g).softmax(-1).topk(k, dim=-1)
    got = torch.ops.mtp_native.bf16_moe(x, weights.contiguous(), idx.contiguous(), gate_up, down)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    ys = avx512.bf16_experts(x.index_select(0, token_of), torch.bincount(flat, minlength=e).tolist(),
                             gate_up, down)
    want = torch.zeros(tokens, h).index_add_(0, token_of, ys * weights.reshape(-1)[order, None])
    assert got.dtype == torch.float32 and torch.equal(got, want)
    alone = [torch.ops.mtp_native.bf16_moe(x[t:t + 1], weights[t:t + 1].contiguous(),
                                           idx[t:t + 1].contiguous(), gate_up, down) for t in range(tokens)]
    assert torch.equal(torch.cat(alone), got)
    assert torch.equal(avx512.Avx512Products().gathered_experts(x, weights, idx, gate_up, down),
                       got.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"expert id 6 outside \[0, 6\)"):
        torch.ops.mtp_native.bf16_moe(x, weights.contiguous(), torch.full_like(idx, 6), gate_up, down)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.mtp_native.bf16_moe(x, weights.double().contiguous(), idx.contiguous(), gate_up, down)


@pytest.mark.parametrize("k", [1536, 203, 9000, 64])
def test_int8_sums_are_exact_and_each_rows_own(k):
    _needs("avx512_vnni")
    g = torch.Generator().manual_seed(k)
    w = torch.randint(-128, 128, (101, k), dtype=torch.int8, generator=g)
    w[0] = -128
    w[1] = 127
    x = torch.randint(-128, 128, (9, k), dtype=torch.int8, generator=g)
    x[0] = -128
    got = avx512.vnni_mm(x, w)
    assert got.dtype == torch.int32 and torch.equal(got.long(), x.long() @ w.long().t())
    assert torch.equal(torch.cat([avx512.vnni_mm(x[i:i + 1], w) for i in range(9)]), got)
    for m in (2, 3, 4):                 # a window's few rows: the weight summed once a row
        assert torch.equal(avx512.vnni_mm(x[:m], w), got[:m])
    experts = torch.randint(-128, 128, (4, 33, k), dtype=torch.int8, generator=g)
    ids = torch.tensor([2, 0, 2, 2, 0, 2, 0])               # 4 and 3 rows an expert
    rows = avx512.vnni_rows(x[:7].float(), ids, experts)
    assert torch.equal(rows.long(), torch.stack([x[a].long() @ experts[e].long().t()
                                                 for a, e in enumerate(ids.tolist())]))
    ids = torch.tensor([3, 0, 0, 2, 1])
    rows = avx512.vnni_rows(x[:5].float(), ids, experts)
    assert torch.equal(rows.long(), torch.stack([x[a].long() @ experts[e].long().t()
                                                 for a, e in enumerate(ids.tolist())]))
    # Rows grouped by expert inside the kernel (each expert's weight read once for all its
    # rows), past the few-row path too: the same exact sums, in the rows' own order.
    many = torch.randint(-128, 128, (14, k), dtype=torch.int8, generator=g)
    ids = torch.tensor([1, 3, 1, 1, 0, 1, 1, 1, 2, 1, 3, 0, 1, 1])
    rows = avx512.vnni_rows(many.float(), ids, experts)
    assert torch.equal(rows.long(), torch.stack([many[a].long() @ experts[e].long().t()
                                                 for a, e in enumerate(ids.tolist())]))



@pytest.mark.parametrize("tokens,k,h,i", [(1, 4, 1536, 512), (6, 4, 1536, 512), (37, 2, 203, 37)])
def test_the_routed_int8_experts_in_one_vnni_operator_are_the_gathered_ones(tokens, k, h, i):
    """i8_moe (avx512_vnni.c over kernels/int8_moe.h): quant.experts.gathered_int8_experts'
    numbers on the "vnni" backend bit for bit (its i8_rows calls and the torch operations
    between them), an expert with more rows than one pass takes (6 tokens on one), a zero
    row; each token's row the same alone as in its window; the AVX2 operator's numbers too
    where that kernel runs (the two share everything but their products)."""
    _needs("avx512_vnni")
    from server.model.quant import experts
    if not native.native_ops() or not experts.native_moe("vnni"):
        pytest.skip("ops.cpp cannot be built here")
    case = moe_window(tokens, k, h, i, all_on_one=True)      # every token on one expert
    got = check_one_operator("vnni", torch.ops.mtp_native.i8_moe, case)
    if experts.native_moe("avx2"):
        assert torch.equal(experts.gathered_int8_experts(*case, "avx2"), got)


def test_the_operators_run_inside_a_compiled_graph():
    """A decode window's graph calls the kernels as operators (Dynamo cannot trace ctypes):
    the same numbers as eager."""
    _needs("avx512_bf16")
    _needs("avx512_vnni")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    w8 = torch.randint(-128, 128, (40, 64), dtype=torch.int8, generator=g)
    from server.model.layers.linear import Linear
    layer = Linear(64, 40, bias=False).to(torch.bfloat16)
    layer.weight.data = w
    use_products([layer], avx512.Avx512Products().window("batch"))

    def fn(layer, x, x8, w8):
        return layer(x).float().sum(-1) + torch.ops.mtp_serve.i8_mm(x8, w8).float().sum(-1)

    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    x8 = torch.randint(-128, 128, (3, 64), dtype=torch.int8, generator=g)
    want = (avx512.bf16_mm(x, w).to(torch.bfloat16).float().sum(-1)
            + avx512.vnni_mm(x8, w8).float().sum(-1))
    got = torch.compile(fn, fullgraph=True, dynamic=False)(layer, x, x8, w8)
    torch.testing.assert_close(got, want)


def test_the_cpp_operators_check_their_arguments_and_refuse_never_crash():
    """ops.cpp: the kernels as C++ operators (a graph calls them in 2 us, not 11).  Every
    rule is checked before a kernel reads anything: a wrong dtype, a strided weight, an
    expert id past the stack or a kernel this CPU cannot run is a RuntimeError."""
    if not native.native_ops():
        pytest.skip("ops.cpp cannot be built here (no kernel, no C++ compiler)")
    g = torch.Generator().manual_seed(5)
    ops = torch.ops.mtp_native
    w8 = torch.randint(-128, 128, (3, 16, 64), dtype=torch.int8, generator=g)
    x8 = torch.randint(-128, 128, (2, 64), dtype=torch.int8, generator=g)
    if native.kernel_library("avx512_vnni") is not None:
        assert torch.equal(ops.i8_mm(x8, w8[0]).long(), x8.long() @ w8[0].long().t())
        with pytest.raises(RuntimeError, match=r"expert id 3 outside \[0, 3\)"):
            ops.i8_rows(x8, torch.tensor([0, 3]), w8)
        with pytest.raises(RuntimeError, match="contiguous"):
            ops.i8_mm(x8, w8[0].t().contiguous().t())
        with pytest.raises(RuntimeError, match="rows have 32 features, the weight 64"):
            ops.i8_mm(x8[:, :32], w8[0])
    if native.kernel_library("avx512_bf16") is not None:
        with pytest.raises(RuntimeError, match="BFloat16"):
            ops.bf16_mm(x8.float(), w8[0].to(torch.bfloat16))
    missing = [n for n, k in (("bf16_mm", "avx512_bf16"), ("half_mm", "half_avx2"))
               if native.kernel_library(k) is None]
    for name in missing:                                    # a kernel this CPU cannot run
        with pytest.raises(RuntimeError, match="not loaded"):
            getattr(ops, name)(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16))


def test_head_rows_are_each_heads_product():
    """The absorbed attention's W_UK / W_UV through the rows kernel: each (token, head) row
    through its own head's weight, as torch's einsum over the heads."""
    _needs("avx512_bf16")
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4, 40, generator=g).to(torch.bfloat16)                  # [T, nH, K]
    w = torch.randn(4, 24, 40, generator=g).to(torch.bfloat16)                 # [nH, N, K]
    got = avx512.Avx512Products().head_rows(x, w)
    want = torch.einsum("thk,hnk->thn", x.float(), w.float())
    assert got.shape == (3, 4, 24) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)
    if native.native_ops():
        # Grouped by head (bf16_heads), past the few-row path too: each (token, head) row's
        # value is bf16_rows' for it alone, at any number of tokens up to 64.
        x = torch.randn(9, 4, 40, generator=g).to(torch.bfloat16)
        heads = torch.arange(4).repeat(9)
        rows = torch.ops.mtp_native.bf16_rows(x.reshape(36, 40), heads, w).view(9, 4, 24)
        assert torch.equal(torch.ops.mtp_native.bf16_heads(x, w), rows)
        for t in (1, 2, 4):                                 # the few-row path
            assert torch.equal(torch.ops.mtp_native.bf16_heads(x[:t].contiguous(), w), rows[:t])
        # Past 64 rows, a prompt's products (bf16_heads_wide: the products' own outside
        # decode graphs) are oneDNN's batched GEMM; a decode window's (bf16_heads, what
        # Avx512Window traces) stay the kernel's, each row bf16_rows' at any size.
        x = torch.randn(65, 4, 40, generator=g).to(torch.bfloat16)
        rows = torch.ops.mtp_native.bf16_rows(x.reshape(260, 40), torch.arange(4).repeat(65), w).view(65, 4, 24)
        assert torch.equal(torch.ops.mtp_native.bf16_heads(x, w), rows)
        wide = torch.ops.mtp_native.bf16_heads_wide(x, w)
        assert wide.dtype == torch.float32
        assert torch.equal(wide, torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).float())
        torch.testing.assert_close(wide, rows, atol=0.1, rtol=0.02)
        assert torch.equal(torch.ops.mtp_native.bf16_heads_wide(x[:64].contiguous(), w), rows[:64])
        assert torch.equal(avx512.Avx512Window()._heads(x, w), rows)
        assert torch.equal(avx512.Avx512Products()._heads(x, w), wide)
        with pytest.raises(RuntimeError, match="bf16_heads: x is"):
            torch.ops.mtp_native.bf16_heads(x[:, :3].contiguous(), w)


@pytest.mark.parametrize("dim, kvr, ctx_len", [(448, 384, 170), (40, 32, 50), (70, 37, 9)])
def test_a_windows_latent_attention_is_each_rows_own_in_float32(dim, kvr, ctx_len):
    """bf16_attend (a decode window's absorbed attention, traced): the float32 attention of
    the bf16 inputs to float rounding, every row alone (a verify window's rows equal the
    same rows attended one at a time), positions a row cannot see never counted, a batch
    whose shorter sequence has padding; tails past 16 and 32 lanes (dims 70, 37)."""
    _needs("avx512_bf16")
    if not native.native_ops():
        pytest.skip("ops.cpp cannot be built here")
    g = torch.Generator().manual_seed(8)
    heads, rows = 3, 2
    ctx = torch.randn(2, ctx_len, dim, generator=g).to(torch.bfloat16)
    q = torch.randn(2, rows * heads, dim, generator=g).to(torch.bfloat16)
    last = torch.tensor([[ctx_len - 2, ctx_len - 1], [ctx_len // 2 - 1, ctx_len // 2]])   # [B, rows]
    visible = torch.arange(ctx_len)[None, None, :] <= last[:, :, None]                 # [B, rows, S]
    bias = torch.zeros(2, rows, ctx_len).masked_fill(~visible, float("-inf")).repeat_interleave(heads, 1)
    scale = dim ** -0.5
    got = torch.ops.mtp_native.bf16_attend(q, ctx, bias, scale, kvr)
    exact = torch.bmm(torch.baddbmm(bias.double(), q.double(), ctx.double().transpose(1, 2), alpha=scale)
                      .softmax(-1), ctx[:, :, :kvr].double())
    assert got.dtype == torch.float32 and got.shape == (2, rows * heads, kvr)
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
    alone = torch.cat([torch.ops.mtp_native.bf16_attend(q[:, r:r + 1].contiguous(), ctx,
                                                        bias[:, r:r + 1].contiguous(), scale, kvr)
                       for r in range(rows * heads)], dim=1)
    assert torch.equal(alone, got)
    # What a row cannot see does not count, whatever it holds (NaN included).
    hidden = ctx.clone()
    hidden[1, ctx_len // 2 + 1:] = float("nan")
    assert torch.equal(torch.ops.mtp_native.bf16_attend(q, hidden, bias, scale, kvr)[1], got[1])
    hidden = ctx.clone()
    hidden[0, ctx_len - 1] = float("nan")                  # the window's second row's position
    assert torch.equal(torch.ops.mtp_native.bf16_attend(q, hidden, bias, scale, kvr)[0, :heads],
                       got[0, :heads])
    # Traced in a window's form, the decode graphs' attention is this operator's.
    lone = avx512.Avx512Products().window("lone")
    fn = torch.compile(lambda q, ctx, bias: lone.latent_attention(q, ctx, bias, scale, kvr),
                       dynamic=False, fullgraph=True)
    assert torch.equal(fn(q, ctx, bias.to(torch.bfloat16)), got.to(torch.bfloat16))


@pytest.mark.parametrize("dim, kvr, block_size, heads", [(448, 384, 16, 12), (70, 37, 5, 3), (40, 32, 4, 17)])
def test_the_paged_latent_attention_is_the_gathered_ones_numbers(dim, kvr, block_size, heads):
    """bf16_attend_paged reads the cache through the block tables with the causal mask of
    each query's position: value for value what bf16_attend gives over the gathered,
    masked context the step built before (blocks out of order, a shorter sequence, a
    verify window of 3 tokens, blocks of a size not a multiple of 4, NaN in rows no query
    sees; heads scored in one group or several, of sizes the weighted sum splits)."""
    _needs("avx512_bf16")
    if not native.native_ops():
        pytest.skip("ops.cpp cannot be built here")
    from server.model.static_decode import _gathered_context
    g = torch.Generator().manual_seed(9)
    q_len = 3
    cache = torch.randn(12, block_size, dim, generator=g).to(torch.bfloat16)
    cache[0] = float("nan")                                   # padding's block: never read
    tables = torch.tensor([[7, 2, 9, 4], [3, 11, 0, 0]])
    pos = torch.tensor([[3 * block_size + 1, 3 * block_size + 2, 3 * block_size + 3],
                        [block_size - 1, block_size, block_size + 1]])
    cache[4, 4:] = float("nan")                               # past the first sequence's last row
    q = torch.randn(2, q_len * heads, dim, generator=g).to(torch.bfloat16)
    scale = dim ** -0.5
    ctx, bias = _gathered_context(cache, tables, pos, heads, torch.bfloat16)
    want = torch.ops.mtp_native.bf16_attend(q, ctx, bias.float(), scale, kvr)
    got = torch.ops.mtp_native.bf16_attend_paged(q, cache, tables, pos, scale, kvr)
    assert torch.equal(got, want)
    # A lone window traced in a window's form takes it (no gathered context in its graph).
    lone = avx512.Avx512Products().window("lone")
    fn = torch.compile(lambda q, c, t, p: lone.paged_latent_attention(q, c, t, p, scale, kvr),
                       dynamic=False, fullgraph=True)
    assert torch.equal(fn(q, cache, tables, pos), want.to(torch.bfloat16))
    assert lone.paged_latent_attention(q, cache, tables, pos, scale, kvr) is None   # eager: gathered
    op = torch.ops.mtp_native.bf16_attend_paged
    with pytest.raises(RuntimeError, match="block 12 outside the cache's 12"):
        op(q, cache, torch.tensor([[7, 2, 9, 12], [3, 11, 0, 0]]), pos, scale, kvr)
    with pytest.raises(RuntimeError, match="position .* outside the"):
        op(q, cache, tables[:, :2].contiguous(), pos, scale, kvr)
    with pytest.raises(RuntimeError, match="query rows are not 5 tokens"):
        op(q, cache, tables, torch.zeros(2, 5, dtype=torch.long), scale, kvr)
    with pytest.raises(RuntimeError, match="int64"):
        op(q, cache, tables.int(), pos, scale, kvr)


@pytest.mark.parametrize("kvr, rope_dim, block_size, heads", [(384, 64, 16, 12), (37, 33, 5, 3)])
def test_the_paged_attention_of_an_int8_cache_is_the_gathered_ones_numbers(kvr, rope_dim, block_size, heads):
    """bf16_attend_paged_i8 dequantizes the rows a query can see as the step's int8_gather
    does (bf16(int8 x scale), the RoPE part as stored) and attends over them: value for value
    bf16_attend over the gathered int8 context; the traced window form takes it."""
    _needs("avx512_bf16")
    if not native.native_ops():
        pytest.skip("ops.cpp cannot be built here")
    from server.model.layers.latent_cache import Int8LatentCache, int8_write
    from server.model.static_decode import _gathered_context
    g = torch.Generator().manual_seed(10)
    dim, q_len = kvr + rope_dim, 2
    cache = Int8LatentCache(12, block_size, kvr, rope_dim, torch.bfloat16, "cpu").block_tensors()
    int8_write(cache, torch.arange(12 * block_size), torch.randn(12 * block_size, dim, generator=g) * 3)
    tables = torch.tensor([[7, 2, 9, 4], [3, 11, 0, 0]])
    pos = torch.tensor([[3 * block_size + 1, 3 * block_size + 2], [block_size - 1, block_size]])
    q = torch.randn(2, q_len * heads, dim, generator=g).to(torch.bfloat16)
    scale = dim ** -0.5
    ctx, bias = _gathered_context(cache, tables, pos, heads, torch.bfloat16)
    want = torch.ops.mtp_native.bf16_attend(q, ctx, bias.float(), scale, kvr)
    got = torch.ops.mtp_native.bf16_attend_paged_i8(q, *cache, tables, pos, scale, kvr)
    assert torch.equal(got, want)
    lone = avx512.Avx512Products().window("lone")
    fn = torch.compile(lambda q, c, t, p: lone.paged_latent_attention(q, c, t, p, scale, kvr),
                       dynamic=False, fullgraph=True)
    assert torch.equal(fn(q, cache, tables, pos), want.to(torch.bfloat16))
    latent, scales, rope = cache
    with pytest.raises(RuntimeError, match="one value a row"):
        torch.ops.mtp_native.bf16_attend_paged_i8(q, latent, scales[:6].contiguous(), rope, tables, pos, scale, kvr)
    with pytest.raises(RuntimeError, match="features, q"):
        torch.ops.mtp_native.bf16_attend_paged_i8(q, latent, scales, rope[..., 1:].contiguous(), tables, pos,
                                                  scale, kvr)


def test_bf16_attend_checks_its_arguments():
    _needs("avx512_bf16")
    if not native.native_ops():
        pytest.skip("ops.cpp cannot be built here")
    q = torch.zeros(1, 2, 32, dtype=torch.bfloat16)
    ctx = torch.zeros(1, 5, 32, dtype=torch.bfloat16)
    bias = torch.zeros(1, 2, 5)
    op = torch.ops.mtp_native.bf16_attend
    with pytest.raises(RuntimeError, match="kvr 33 outside"):
        op(q, ctx, bias, 1.0, 33)
    with pytest.raises(RuntimeError, match="bias is"):
        op(q, ctx, bias[:, :, :4].contiguous(), 1.0, 16)
    with pytest.raises(RuntimeError, match="Float"):
        op(q, ctx, bias.to(torch.bfloat16), 1.0, 16)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(q, ctx.transpose(1, 2).contiguous().transpose(1, 2), bias, 1.0, 16)
