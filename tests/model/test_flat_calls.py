"""model/flat_calls.py: a compiled graph called with its flat inputs gives what the ordinary
call gives, learns only what it can place, and leaves everything else on the ordinary call."""
from __future__ import annotations

import pytest
import torch

from server.model.flat_calls import FlatCalls

pytestmark = pytest.mark.slow


class _Block(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = torch.nn.Linear(8, 8, bias=False)
        self.proj.weight.data = torch.randn(8, 8, generator=g)
        self.register_buffer("gain", torch.rand(8, generator=g))


def _layer(block, x, cache, pair, n=2):
    """A layer function's shape: a module, a window, a cache written in place, a tuple of
    tensors, a number; two outputs; the cache's rows a symbolic size."""
    y = block.proj(x) * block.gain + pair[0].sum() - pair[1].mean()
    cache[: x.shape[0]] = y
    return y, cache.sum(0) + cache.shape[0] + cache[:n].sum()


def _graph(blocks, x, cache, pair, n=2):
    torch._dynamo.mark_dynamic(cache, 0)
    return torch.compile(_layer, dynamic=False, fullgraph=True).aot_compile(((blocks[0], x, cache, pair, n), {}))


def _steps_match_the_ordinary_calls(graph, blocks, calls: FlatCalls, g: torch.Generator) -> None:
    """Three steps over the layers: each learned call's outputs and cache writes are the
    ordinary call's, bit for bit, while the cache's rows (a symbolic size) change."""
    for step in range(3):
        for layer, block in enumerate(blocks):
            xs = torch.randn(3, 8, generator=g)
            rows = 6 + step
            ps = (torch.randn(4, generator=g), torch.randn(5, generator=g))
            want_cache, got_cache = torch.zeros(rows, 8), torch.zeros(rows, 8)
            want = graph(block, xs, want_cache, ps, 3)
            got = calls.call(graph, layer, (block, xs, got_cache, ps, 3))
            assert isinstance(got, tuple) and len(got) == 2
            for w, o in zip(want, got):
                torch.testing.assert_close(o, w, rtol=0, atol=0)
            torch.testing.assert_close(got_cache, want_cache, rtol=0, atol=0)


def test_learned_calls_give_the_ordinary_calls_results_layer_by_layer():
    torch._dynamo.reset()
    blocks = [_Block(1), _Block(2)]
    g = torch.Generator().manual_seed(0)
    x, pair = torch.randn(3, 8, generator=g), (torch.randn(4, generator=g), torch.randn(5, generator=g))
    graph = _graph(blocks, x, torch.zeros(6, 8), pair, 3)
    graph.disable_guard_check()
    calls = FlatCalls()
    _steps_match_the_ordinary_calls(graph, blocks, calls, g)
    assert (calls.learned, calls.refused) == (2, 0)       # one per (graph, layer)
    # A layer's weights are its own: layer 1's call did not reuse layer 0's.
    assert not torch.equal(calls.call(graph, 0, (blocks[0], x, torch.zeros(6, 8), pair, 3))[0],
                           calls.call(graph, 1, (blocks[1], x, torch.zeros(6, 8), pair, 3))[0])


def test_a_call_passing_one_tensor_twice_or_switched_off_stays_ordinary(monkeypatch):
    torch._dynamo.reset()
    block = _Block(3)
    x = torch.randn(3, 8)
    graph = _graph([block], x, torch.zeros(6, 8), (torch.randn(8), torch.randn(8)))
    graph.disable_guard_check()
    calls = FlatCalls()
    one = torch.randn(8)
    args = (block, x, torch.zeros(6, 8), (one, torch.randn(8)))
    twice = (block, x, torch.zeros(6, 8), (one, one))       # which input is which, later?
    want = graph(*twice)
    got = calls.call(graph, 0, twice)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert (calls.learned, calls.refused) == (0, 1)
    calls.call(graph, 0, args)                                  # stays ordinary for that pair
    assert (calls.learned, calls.refused) == (0, 1)
    monkeypatch.setenv("MTP_SERVE_FLAT_CALLS", "0")
    calls.call(graph, 1, args)
    assert (calls.learned, calls.refused) == (0, 2)
    calls.clear()
    monkeypatch.delenv("MTP_SERVE_FLAT_CALLS")
    calls.call(graph, 1, args)
    assert (calls.learned, calls.refused) == (1, 2)


def test_a_plain_call_is_never_learned():
    """A function with no compiled graph under it (the uncompiled step's) stays ordinary."""
    calls = FlatCalls()
    block, x = _Block(4), torch.randn(3, 8)
    got = calls.call(_layer, 0, (block, x, torch.zeros(6, 8), (x[0], x[1])))
    assert got[0].shape == (3, 8)
    assert (calls.learned, calls.refused) == (0, 1)


def test_an_inference_graph_is_called_below_its_wrappers_with_the_same_results():
    """A graph made without autograd (as the decoder's are) is learned as a call of its
    generated code: the wrappers above it only pass its inputs and outputs through."""
    torch._dynamo.reset()
    blocks = [_Block(5), _Block(6)]
    g = torch.Generator().manual_seed(1)
    x, pair = torch.randn(3, 8, generator=g), (torch.randn(4, generator=g), torch.randn(5, generator=g))
    with torch.inference_mode():
        graph = _graph(blocks, x, torch.zeros(6, 8), pair, 3)
        graph.disable_guard_check()
        calls = FlatCalls()
        _steps_match_the_ordinary_calls(graph, blocks, calls, g)
    learned = [c for c in calls._calls.values() if c is not None]
    assert len(learned) == 2 and all(c.direct is not None for c in learned)
    # This graph's wrapper is Python: it takes its numbers as numbers.
    assert not any(c.scalars for c in learned)
