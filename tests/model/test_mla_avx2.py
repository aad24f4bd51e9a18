"""MLA's absorbed attention through mla_avx2.c (server/model/kernels/half_cpu.py): the
per-head products W_UK / W_UV and the paged attention of a decode window, on every CPU
with AVX2 and FMA (skipped, saying why, elsewhere).  Each output is its own row's: a
verify window's tokens equal the same tokens one at a time (MTP stays lossless)."""
from __future__ import annotations

import pytest
import torch

from server.model.kernels import half_cpu, native


def _needs_ops():
    if native.kernel_library("mla_avx2") is None:
        pytest.skip("mla_avx2.c cannot run here (CPU flags or compiler)")
    if not native.native_ops():
        pytest.skip("ops.cpp cannot be built here")


def _lone_window():
    """The AVX2 products' traced "lone" window form, or None without the kernel."""
    products = half_cpu.HalfCpuProducts(native.half_kernel())
    return products.window("lone") if products.uses_kernel else None


def _traced(lone, scale, kvr):
    """``lone.paged_latent_attention`` compiled as a decode graph compiles it."""
    return torch.compile(lambda q, c, t, p: lone.paged_latent_attention(q, c, t, p, scale, kvr),
                         dynamic=False, fullgraph=True)


def _exact_attention(q, ctx, bias, scale, kvr):
    """float64 softmax(q . ctx^T * scale + bias) . ctx[..., :kvr], rows nobody sees zeroed."""
    ctx = torch.nan_to_num(ctx.double())
    return torch.bmm(torch.baddbmm(bias.double(), q.double(), ctx.transpose(1, 2), alpha=scale).softmax(-1),
                     ctx[:, :, :kvr])


@pytest.mark.parametrize("k, n", [(128, 384), (384, 128), (37, 10)])
def test_head_rows_are_each_heads_product_and_each_rows_own(k, n):
    """half_heads: x [T, nH, K] . w[h] [N, K]^T per head, float32 sums of the bf16 values to
    float rounding (K past and short of the 32- and 8-lane steps); the first t rows of a
    window are what those t rows give alone; HalfCpuProducts takes it for bf16 heads."""
    _needs_ops()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 5, k, generator=g).to(torch.bfloat16)
    w = torch.randn(5, n, k, generator=g).to(torch.bfloat16)
    got = torch.ops.mtp_native.half_heads(x, w)
    exact = torch.einsum("thk,hnk->thn", x.double(), w.double())
    assert got.dtype == torch.float32 and got.shape == (9, 5, n)
    torch.testing.assert_close(got.double(), exact, atol=1e-4, rtol=1e-5)
    for t in (1, 2, 3):
        assert torch.equal(torch.ops.mtp_native.half_heads(x[:t].contiguous(), w), got[:t])
    products = half_cpu.HalfCpuProducts(native.half_kernel())
    if products.uses_kernel:
        assert products.takes_head_rows(w) and not products.takes_head_rows(w.float())
        assert torch.equal(products.head_rows(x, w), got.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="half_heads: x is"):
        torch.ops.mtp_native.half_heads(x[:, :3].contiguous(), w)
    with pytest.raises(RuntimeError, match="BFloat16"):
        torch.ops.mtp_native.half_heads(x.float(), w)


@pytest.mark.parametrize("dim, kvr, block_size, heads", [(448, 384, 16, 12), (70, 37, 5, 3), (40, 29, 4, 17)])
def test_the_paged_attention_is_the_exact_attention_and_each_tokens_own(dim, kvr, block_size, heads):
    """half_attend_paged reads the cache through the block tables with the causal mask of
    each query's position: the float64 attention over the gathered, masked context to
    float32 rounding (blocks out of order, a shorter sequence, a verify window of 3 tokens,
    NaN in rows no query sees, heads in one group or several, kvr not a multiple of 8 or
    32); each token of the window alone gives the same numbers; the traced window form of
    the AVX2 products takes it, the eager step not."""
    _needs_ops()
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
    got = torch.ops.mtp_native.half_attend_paged(q, cache, tables, pos, scale, kvr)
    assert got.dtype == torch.float32 and got.shape == (2, q_len * heads, kvr)
    torch.testing.assert_close(got.double(), _exact_attention(q, ctx, bias, scale, kvr), atol=1e-5, rtol=1e-5)
    for t in range(q_len):
        rows = slice(t * heads, (t + 1) * heads)
        alone = torch.ops.mtp_native.half_attend_paged(q[:, rows].contiguous(), cache, tables,
                                                       pos[:, t:t + 1].contiguous(), scale, kvr)
        assert torch.equal(alone, got[:, rows])
    if (lone := _lone_window()) is not None:
        assert torch.equal(_traced(lone, scale, kvr)(q, cache, tables, pos), got.to(torch.bfloat16))
        assert lone.paged_latent_attention(q, cache, tables, pos, scale, kvr) is None   # eager: gathered
    op = torch.ops.mtp_native.half_attend_paged
    with pytest.raises(RuntimeError, match="block 12 outside the cache's 12"):
        op(q, cache, torch.tensor([[7, 2, 9, 12], [3, 11, 0, 0]]), pos, scale, kvr)
    with pytest.raises(RuntimeError, match="position .* outside the"):
        op(q, cache, tables[:, :2].contiguous(), pos, scale, kvr)
    with pytest.raises(RuntimeError, match="query rows are not 5 tokens"):
        op(q, cache, tables, torch.zeros(2, 5, dtype=torch.long), scale, kvr)
    with pytest.raises(RuntimeError, match="int64"):
        op(q, cache, tables.int(), pos, scale, kvr)
    wide = torch.zeros(2, q_len * heads, 1100, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="rows of 1100 features; at most 1024"):
        op(wide, torch.zeros(12, block_size, 1100, dtype=torch.bfloat16), tables, pos, scale, kvr)


@pytest.mark.parametrize("kvr, rope_dim, block_size, heads", [(384, 64, 16, 12), (37, 33, 5, 3)])
def test_the_paged_attention_of_an_int8_cache_dequantizes_as_the_step_does(kvr, rope_dim, block_size, heads):
    """half_attend_paged_i8: the rows a query can see dequantized as the step's int8_gather
    does (bf16(int8 x scale), the RoPE part as stored), then attended: the float64 attention
    over the gathered int8 context to float32 rounding; the traced window form takes it."""
    _needs_ops()
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
    got = torch.ops.mtp_native.half_attend_paged_i8(q, *cache, tables, pos, scale, kvr)
    torch.testing.assert_close(got.double(), _exact_attention(q, ctx, bias, scale, kvr), atol=1e-5, rtol=1e-5)
    alone = torch.ops.mtp_native.half_attend_paged_i8(q[:, :heads].contiguous(), *cache, tables,
                                                      pos[:, :1].contiguous(), scale, kvr)
    assert torch.equal(alone, got[:, :heads])
    if (lone := _lone_window()) is not None:
        assert torch.equal(_traced(lone, scale, kvr)(q, cache, tables, pos), got.to(torch.bfloat16))
    latent, scales, rope = cache
    with pytest.raises(RuntimeError, match="one value a row"):
        torch.ops.mtp_native.half_attend_paged_i8(q, latent, scales[:6].contiguous(), rope, tables, pos, scale, kvr)
