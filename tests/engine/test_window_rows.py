"""A row of a compiled window gets the same numbers in a one-token window as in a two-token
one: what keeps MTP k=1's verify windows lossless against MTP off's steps.

Why: on the 0.5b bf16 model with 2 threads, greedy tokens of MTP k=1 parted from MTP off's
at a chat prompt's 12th token.  Inductor had split a lone row's RMSNorm over 1536 into a
partial sum per thread (a two-token window gives each thread a row), and the router's
float32 product was a GEMV for one row and a GEMM for two: both sum a row in another order.
"""
from __future__ import annotations

import pytest
import torch

from server.engine.worker.compile_step import compile_settings
from server.model.kernels import avx512, half_cpu, native

HIDDEN, EXPERTS = 1536, 16


def _window_step(products):
    """An RMSNorm (a reduction over HIDDEN) and the router's scores through ``products``."""
    gain = torch.linspace(0.5, 1.5, HIDDEN)
    router = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(3))

    def step(x):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * gain
        return normed, products.router_logits(normed.to(x.dtype), router).sigmoid()
    return step


def _half_cpu_window():
    return half_cpu.HalfCpuProducts(native.half_kernel()).window("lone")


@pytest.mark.slow
@pytest.mark.parametrize("window", [_half_cpu_window, avx512.Avx512Window], ids=["avx2", "avx512"])
def test_a_rows_norm_and_routing_are_the_same_in_a_window_of_one_or_two(window):
    """Graphs made under compile_settings for 2 threads, one for a 1-token window and one
    for a 2-token window (static sizes, as the compiled step makes them): each of 16 rows
    gets the same norm and router scores, bit for bit, alone as in a pair.  (With the
    reductions split, about one row in four rounded apart.)  So does the 1-token window
    made for one thread, as a lone sequence's graphs are (compile_step._graph_threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        products = window()                 # its router form is torch's: runs on any CPU
        g = torch.Generator().manual_seed(1)
        # magnitudes over four decades: partial sums of the squares round apart
        x = (torch.randn(16, HIDDEN, generator=g) * 10 ** (4 * torch.rand(16, HIDDEN, generator=g))).to(torch.bfloat16)
        runs = {}
        for rows, made_for in ((1, 2), (2, 2), (1, 1)):
            torch._dynamo.reset()
            with compile_settings(made_for):    # a copy each: an offset row would recompile
                graph = torch.compile(_window_step(products), dynamic=False, fullgraph=True)
                runs[rows, made_for] = [graph(x[i:i + rows].clone()) for i in range(0, 16, rows)]
        alone, pairs, lone = runs[1, 2], runs[2, 2], runs[1, 1]
    finally:
        torch.set_num_threads(threads)
    for i in range(16):
        (norm1, scores1), (norm2, scores2) = alone[i], pairs[i // 2]
        assert torch.equal(norm1[0], norm2[i % 2]), i
        assert torch.equal(scores1[0], scores2[i % 2]), i
        assert torch.equal(lone[i][0][0], norm2[i % 2]), i
        assert torch.equal(lone[i][1][0], scores2[i % 2]), i
    eager_norm, eager_scores = _window_step(half_cpu.HalfCpuProducts(None))(x[:2])
    torch.testing.assert_close(pairs[0][0], eager_norm)
    torch.testing.assert_close(pairs[0][1], eager_scores, atol=0.02, rtol=0)   # the norm's bf16 rounding


def test_only_windows_whose_weights_our_operators_read_are_made_single_threaded():
    """compile_step._graph_threads: a lone decode window's graph gets one thread only where
    no weight is streamed by an Inductor reduction (products without our kernels, MLA's heads
    without theirs, int8 layers on another backend keep every thread); batch and prompt
    graphs always keep them."""
    from types import SimpleNamespace

    from server.engine.worker import compile_step
    from server.model.quant.linear import QuantLinear

    class Model(torch.nn.Module):
        def __init__(self, name, mla, backend=None):
            super().__init__()
            self.products = SimpleNamespace(name=name, mla=mla)
            if backend:
                self.proj = QuantLinear(8, 8, "w8a8_dynamic", backend=backend)

    def threads(model, lone=True, static=True):
        return compile_step._graph_threads(model, lone, static, 2)

    for model in (Model("float32", False), Model("torch", False), Model("avx2", False),
                  Model("avx2", True, backend="float"), Model("avx512", True, backend="int_mm")):
        assert threads(model) == 2, model.products
    ours = Model("avx2", True, backend="avx2")
    assert threads(ours, lone=False) == 2 and threads(ours, static=False) == 2
    assert threads(ours) == (1 if native.native_ops() else 2)
    assert threads(Model("avx512", False, backend="vnni")) == (1 if native.native_ops() else 2)
