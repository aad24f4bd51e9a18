"""A few rows through a 16-bit weight on a CPU without 16-bit float instructions.

Why: on an AVX2-only CPU (no AVX512_BF16, no AMX) oneDNN's bf16 product converts the
weight to float32 once per row, so a verify window's k+1 rows cost k+1 single-row
products: the 0.5b model's [32000, 1536] head took 5.1 / 9.5 / 14.3 ms for 1 / 2 / 3 rows
(2 threads, AMD EPYC), and a k=1 step 2.4x a plain one, which made MTP slower than no MTP.
Written as one reduction per row over a weight converted once (``rows_linear``), Inductor
fuses the rows into one kernel that loads and converts each weight vector once for all of
them: 5.2 / 6.9 / 9.8 ms for the same head, a [1536 -> 8192 -> 1536] MLP at 2 rows
3.4 ms against 5.1.  One row stays oneDNN's (it already streams at the memory limit).

``traced`` applies it while a graph with a constant row count is traced (worker/
compile_step.py: a lone sequence's verify window); batch graphs, whose row count is
symbolic, are traced without it and keep ``F.linear``.  Outputs
are bf16 rounding apart from ``F.linear``'s (a float32 sum in another order); float32
models never take it, so the lossless float32 checks are untouched.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from server.model.quant import materialized

MAX_ROWS = 8        # unrolled per row in the graph: beyond a verify window's rows, no gain measured


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-d ``x`` of a few rows, as one float32 reduction
    per row over the converted weight (for Inductor to fuse; slow uncompiled)."""
    w = weight.float()
    xf = materialized(x.float())        # not recomputed for every output column
    out = torch.stack([(w * xf[i]).sum(-1) for i in range(x.shape[0])]).to(x.dtype)
    return out if bias is None else out + bias


@functools.lru_cache(maxsize=None)
def pays(dtype: torch.dtype, device_type: str) -> bool:
    """Whether a graph of ``dtype`` weights on ``device_type`` takes ``rows_linear``."""
    from server.model.layers import cpu_has_native_bf16
    return device_type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not cpu_has_native_bf16()


def latent_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)``: [T, nH, dn] x [nH, dn, kvr]
    -> [T, nH, kvr], as a reduction over dn.  A head's W_UK (the 0.5b model: 12 x 128 x 384,
    1.2 MB) stays in cache across rows, so any row count takes it."""
    return (materialized(q_nope.float())[..., None] * w_uk.float()).sum(2).to(q_nope.dtype)


def latent_value(o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)``: [T, nH, kvr] x
    [nH, dv, kvr] -> [T, nH, dv], as a reduction over kvr."""
    return (materialized(o.float())[:, :, None, :] * w_uv.float()).sum(-1).to(o.dtype)


def reducing() -> bool:
    """Whether the graph being traced takes the reduction forms of this module (under
    ``traced``): attention's per-head products always, linears with constant rows."""
    return _mode is not None and torch.compiler.is_compiling()


@contextlib.contextmanager
def traced(constant_rows: bool) -> Iterator[None]:
    """Trace a graph in this context to take this module's forms: ``latent_query`` and
    ``latent_value`` (static_decode.attend asks ``reducing()``), and, when the graph's row
    count is a constant (``constant_rows``: a lone sequence's window), each ``F.linear`` of
    2..MAX_ROWS rows through a 16-bit weight as ``rows_linear``.

    ``F.linear`` is swapped for the context (what ``nn.Linear.forward`` looks up when
    traced; a TorchFunctionMode would route every tensor method too, and Dynamo cannot
    trace some of them through one).  Calls outside a trace, from any thread, still run
    ``F.linear`` itself and the bmm forms: both checks ask ``torch.compiler.is_compiling()``.
    One traced graph at a time (the lock).  Under Dynamo a symbolic row count would also
    pass ``isinstance(rows, int)`` and be specialised, hence the caller's ``constant_rows``."""
    global _mode
    with _lock:
        _mode = "rows" if constant_rows else "heads"
        F.linear = _linear
        try:
            yield
        finally:
            F.linear = _F_LINEAR
            _mode = None


_F_LINEAR = F.linear
_lock = threading.Lock()
_mode: str | None = None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _mode == "rows" and torch.compiler.is_compiling() and _takes(x, weight):
        return rows_linear(x, weight, bias)
    return _F_LINEAR(x, weight, bias)


def _takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS
            and weight.dtype in (torch.bfloat16, torch.float16) and weight.dim() == 2)
