"""Products as an object a model holds: torch's own here, a backend per CPU elsewhere.

Why an object: the 16-bit path for CPUs without bf16 instructions once rebound
``torch.nn.functional.linear`` for the whole process, so every ``F.linear`` anywhere, ours
or a library's, went through our dispatch.  Now each layer that multiplies by a weight
asks the ``products`` it was given at load (``use_products``), as a quantized layer asks
its int8 backend: the linear layers (layers/linear.py), MLA's absorbed-attention products
(layers/attention.py), the routed experts (layers/moe.py) and the vocabulary heads.

A compiled graph of a window of the static step takes the form ``products.window(w)``
gives ("lone", "batch" or "prompt"; compile_step.py swaps it in while it traces, and the
graph keeps it): a backend that has no such forms returns itself.  Adding a backend is a
subclass in a file of its own and one line where choice.py makes the choice.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

WINDOWS = ("lone", "batch", "prompt")


class Products:
    """Torch's own products: oneDNN / MKL on a CPU, cuBLAS on CUDA."""

    name = "torch"
    takes_prompts = True           # a lone prompt may run through a compiled prompt graph

    def __init__(self, native_half: bool = True) -> None:
        # Whether the device multiplies 16-bit floats natively (the CPU's AVX512_BF16 / AMX;
        # always on CUDA): there a column-major 16-bit weight stays on the fast path.
        self.native_half = native_half

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def columns_exact(self, weight: torch.Tensor, rows: int) -> bool:
        """Whether ``linear`` of ``rows`` rows through ``weight``, eager, gives every output
        the value it has whichever other weight rows share the call (one chain over K an
        output): a product of a few of the weight's rows then reproduces those outputs
        bit for bit (engine/sample/screened_head.py).  torch's own GEMMs promise no such
        thing (their blocking and threading follow the shape)."""
        return False

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The MoE router's scores before their activation: x [T, H] . weight [E, H]^T in
        float32 (routing runs in float32)."""
        return F.linear(x.float(), weight.float())

    def latent_query(self, q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """The absorbed attention's W_UK product: [T, nH, dn] x [nH, dn, kvr] -> [T, nH, kvr]."""
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def latent_value(self, o: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """The W_UV product: [T, nH, kvr] x [nH, dv, kvr] -> [T, nH, dv]."""
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def latent_attention(self, q: torch.Tensor, ctx: torch.Tensor, bias: torch.Tensor,
                         scale: float, kvr: int) -> torch.Tensor:
        """softmax(q . ctx^T * scale + bias) . ctx[..., :kvr]: the absorbed attention over a
        context of latent rows (q [B, R, D], ctx [B, S, D], bias [B, R, S]) -> [B, R, kvr]."""
        scores = torch.baddbmm(bias.to(q.dtype), q, ctx.transpose(1, 2), alpha=scale)
        return torch.bmm(scores.softmax(-1), ctx[:, :, :kvr])

    def paged_latent_attention(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                               positions: torch.Tensor, scale: float, kvr: int) -> torch.Tensor | None:
        """``latent_attention`` reading the cache in place through the block tables [B, nb],
        each query seeing its sequence's positions up to its own (positions [B, Q]; q [B, Q *
        heads, D], token-major) -> [B, R, kvr] in q's dtype, or None where this backend has no
        such kernel (the step then gathers the context and masks it).  ``cache``: a float
        [blocks, block size, D] tensor or an int8 cache's (latent, scale, rope) tensors."""
        return None

    def experts(self, xs: torch.Tensor, counts: list[int], gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor | None:
        """A routed MoE's float experts over their rows in one call (xs [A, H], expert e's rows
        the e-th ``counts[e]``; gate_up [E, 2I, H], down [E, H, I]) -> float32 [A, H], or
        None where this backend has no such call (the MoE then runs expert by expert)."""
        return None

    def gathered_experts(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                         gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor | None:
        """Each token through its top-k float experts, read by index (x [T, H], weights/idx
        [T, k], stacks as ``experts``) -> [T, H] in x's dtype, or None where this backend
        has no kernel for it (layers/experts.py then writes it as reductions)."""
        return None

    def groups_experts(self, dtype: torch.dtype) -> bool:
        """Whether ``gathered_experts`` on float experts of ``dtype`` reads each chosen
        expert once for all the tokens that chose it (one grouped kernel), so the gathered
        MoE costs no more bytes than the routed one at any number of tokens."""
        return False

    def takes_head_rows(self, weight: torch.Tensor) -> bool:
        """Whether ``head_rows`` runs a kernel for weights like ``weight`` (the absorbed
        attention's W_UK / W_UV then get copies laid out for it: layers/attention.py)."""
        return False

    def head_rows(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, nH, K] . w[h] [N, K]^T for each head h -> [T, nH, N] in x's dtype."""
        return torch.einsum("thk,hnk->thn", x, w)

    def column_major(self, dtype: torch.dtype) -> bool:
        """Whether a weight of ``dtype`` multiplies faster held column-major (layers/linear.py)."""
        return dtype == torch.float32 or (dtype in (torch.bfloat16, torch.float16) and self.native_half)

    def window(self, window: str) -> Products:
        """The form a compiled graph of ``window`` (WINDOWS) takes."""
        if window not in WINDOWS:
            raise ValueError(f"window {window!r}; allowed: {', '.join(WINDOWS)}")
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def window_router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``Products.router_logits`` for a compiled decode window: one float32 reduction per
    token and expert, which Inductor sums alike for a token alone or in a window (the
    product is a GEMV for one row and a GEMM for two, summed in another order: MTP k=1's
    verify windows then weighted experts otherwise than MTP off's steps).  The token's
    activation is its own buffer, so a norm before it is not recomputed per expert."""
    from server.model.kernels.gemm import materialized
    return (materialized(x.float())[:, None, :] * weight.float()[None]).sum(-1)


def native_paged_attention(family: str, q: torch.Tensor, cache, block_tables: torch.Tensor,
                           positions: torch.Tensor, scale: float, kvr: int) -> torch.Tensor | None:
    """``Products.paged_latent_attention`` through our C++ operators ``<family>_attend_paged``
    (a bf16 cache) or ``<family>_attend_paged_i8`` (an int8 cache's tensors): "bf16"
    (avx512_bf16.c) or "half" (mla_avx2.c), in q's dtype; None where the operands are not
    theirs (not bf16, not on the CPU).  The caller says the operator is loaded."""
    int8 = isinstance(cache, tuple)
    stored = cache[2] if int8 else cache                    # bf16 rows (the RoPE part of int8)
    if q.dtype != torch.bfloat16 or stored.dtype != torch.bfloat16 or q.device.type != "cpu":
        return None
    tables, pos = block_tables.long().contiguous(), positions.long().contiguous()
    ops = torch.ops.mtp_native
    if int8:
        latent, scales, rope = cache
        out = getattr(ops, f"{family}_attend_paged_i8")(q.contiguous(), latent, scales, rope, tables, pos,
                                                        scale, kvr)
    else:
        out = getattr(ops, f"{family}_attend_paged")(q.contiguous(), cache, tables, pos, scale, kvr)
    return out.to(q.dtype)


class UsesProducts:
    """A module that multiplies through the ``products`` it is given (``use_products``)."""

    products: Products = Products()


def use_products(modules: Iterable[nn.Module], products: Products) -> None:
    """Give every module under ``modules`` that multiplies (UsesProducts) ``products``."""
    for root in modules:
        for m in root.modules():
            if isinstance(m, UsesProducts):
                m.products = products


@contextlib.contextmanager
def products_for(modules: Iterable[nn.Module], products: Products) -> Iterator[None]:
    """``use_products`` for the context, each module's own products back after it (what a
    graph is traced with: compile_step.py)."""
    modules = list(modules)
    before = [(m, m.products) for root in modules for m in root.modules() if isinstance(m, UsesProducts)]
    use_products(modules, products)
    try:
        yield
    finally:
        for m, p in before:
            m.products = p
