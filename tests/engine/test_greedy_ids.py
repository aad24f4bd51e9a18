"""Greedy tokens through ops.cpp's argmax_rows: torch.argmax's ids on every kind of row
(ties, -inf, +inf, NaN, signed zeros, strided rows), and a clear error on what it refuses."""
from __future__ import annotations

import pytest
import torch

from server.engine.sample.greedy import _native, greedy_ids


def _rows(g: torch.Generator):
    for rows, width in [(1, 32000), (3, 129280), (8, 1000), (2, 17), (5, 7), (1, 1), (0, 9)]:
        x = torch.randn(rows, width, generator=g)
        yield x
        yield (x * 3).round()                                  # ties: the first one
        y = x.clone()
        y[:, ::3] = float("-inf")
        yield y
        if rows and width > 2:
            y = x.clone()
            y[0, width // 2] = float("nan")                    # a NaN above any number
            y[-1, -1] = float("nan")
            y[-1, 0] = float("inf")
            yield y
        yield torch.full((rows, width), float("-inf"))
        yield torch.full((rows, width), float("nan"))
        z = torch.full((rows, width), -0.0)
        if width > 1:
            z[:, -1] = 0.0                                      # equal to -0.0: the first
        yield z
        yield x[:, : max(1, width // 2)]                       # rows with a stride


@pytest.mark.skipif(not _native(), reason="ops.cpp is not loaded here")
def test_argmax_rows_gives_torchs_ids():
    g = torch.Generator().manual_seed(0)
    op = torch.ops.mtp_native.argmax_rows
    for x in _rows(g):
        assert torch.equal(op(x), x.argmax(-1)), x.shape
        assert torch.equal(greedy_ids(x), x.argmax(-1))


@pytest.mark.skipif(not _native(), reason="ops.cpp is not loaded here")
def test_argmax_rows_refuses_what_it_does_not_read():
    op = torch.ops.mtp_native.argmax_rows
    for bad in (torch.zeros(2, 4, dtype=torch.float64), torch.zeros(4), torch.zeros(2, 0),
                torch.zeros(4, 2).t()):
        with pytest.raises(RuntimeError, match="argmax_rows: logits must be"):
            op(bad)
    # ... which greedy_ids hands to torch instead.
    for x in (torch.randn(2, 4, dtype=torch.float64), torch.randn(4, 3).t(), torch.randn(3)):
        assert torch.equal(greedy_ids(x), x.argmax(-1))
