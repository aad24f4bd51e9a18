"""benchmarks.besides_products: the no-op kernels stand in for the real ones and back, and
the timed ones compute the real values while counting each call (the run itself needs the
0.5b checkpoint)."""
from __future__ import annotations

import pytest
import torch

from server.model.kernels.cpu import cpu_caps


@pytest.mark.skipif(not (cpu_caps().avx512f and cpu_caps().avx512bw and cpu_caps().avx512_bf16),
                    reason="the no-op kernels stand in for the AVX-512 BF16 ones")
def test_the_swap_zeroes_the_products_and_puts_the_real_kernels_back():
    from benchmarks.besides_products import KernelSwap
    from server.model.kernels.native import native_ops
    if not native_ops():
        pytest.skip("no C++ operators here (no compiler)")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    heads_x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    heads_w = torch.randn(3, 64, 16, generator=g).to(torch.bfloat16).transpose(1, 2).contiguous()
    want, want_heads = torch.ops.mtp_native.bf16_mm(x, w), torch.ops.mtp_native.bf16_heads(heads_x, heads_w)
    assert want.abs().sum() > 0
    swap = KernelSwap()
    try:
        swap.use("no-op")
        assert torch.equal(torch.ops.mtp_native.bf16_mm(x, w), torch.zeros(3, 40))
        assert not torch.ops.mtp_native.bf16_heads(heads_x, heads_w).any()
        swap.use("timed")
        swap.reset_times()
        for _ in range(4):                          # two "steps" of two products each
            assert torch.equal(torch.ops.mtp_native.bf16_mm(x, w), want)
        assert torch.equal(torch.ops.mtp_native.bf16_heads(heads_x, heads_w), want_heads)
        times = {e["kernel"]: e for e in swap.kernel_times(steps=2)}
    finally:
        swap.use("real")
    mm, heads = times["bf16_mm"], times["bf16_heads"]
    assert (mm["rows"], mm["n"], mm["k"], mm["calls_per_step"]) == (3, 40, 64, 2.0)
    assert mm["mb_per_step"] == pytest.approx(round(2 * 40 * 64 * 2 / 1e6, 2)) and mm["us_per_step"] > 0
    assert (heads["rows"], heads["n"], heads["k"], heads["calls_per_step"]) == (2, 3 * 16, 64, 0.5)
    assert torch.equal(torch.ops.mtp_native.bf16_mm(x, w), want)
    assert torch.equal(torch.ops.mtp_native.bf16_heads(heads_x, heads_w), want_heads)
