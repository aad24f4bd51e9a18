"""The whole-MoE int8 operators' case (kernels/int8_moe.h: half_avx2.c int8_moe, avx512_vnni.c
i8_moe), shared by the tests of both ISAs: a window's routed int8 experts through one
operator, against quant.experts.gathered_int8_experts' torch path on the same backend."""
from __future__ import annotations

import pytest
import torch


def moe_window(tokens: int, k: int, h: int, i: int, all_on_one: bool) -> tuple:
    """(x bf16 [tokens, h], weights, idx, gate_up, gate_up_scale, down, down_scale) over 9
    experts: a zero row past 2 tokens; an expert two tokens share (``all_on_one``: every
    token's first)."""
    g = torch.Generator().manual_seed(tokens)
    E = 9
    gate_up = torch.randint(-128, 128, (E, 2 * i, h), dtype=torch.int8, generator=g)
    down = torch.randint(-128, 128, (E, h, i), dtype=torch.int8, generator=g)
    gus, ds = torch.rand(E, 2 * i, generator=g) / 300, torch.rand(E, h, generator=g) / 300
    x = (torch.randn(tokens, h, generator=g) * 3).to(torch.bfloat16)
    if tokens > 2:
        x[1] = 0.0
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    if all_on_one:
        idx[:, 0] = idx[0, 0]
    else:
        idx[-1, 0] = idx[0, 0]
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1)
    return x, w, idx, gate_up, gus, down, ds


def check_one_operator(backend: str, op, case: tuple) -> torch.Tensor:
    """The operator's window equals the torch path bit for bit, each token's row alone
    equals its row in the window, and an expert id outside the experts is refused; returns
    the window's output."""
    from server.model.quant import experts
    x, w, idx, gate_up, gus, down, ds = case
    got = experts.gathered_int8_experts(x, w, idx, gate_up, gus, down, ds, backend)
    real = experts.native_moe
    experts.native_moe = lambda backend: False
    try:
        want = experts.gathered_int8_experts(x, w, idx, gate_up, gus, down, ds, backend)
    finally:
        experts.native_moe = real
    assert torch.equal(got, want)
    alone = torch.cat([op(x[t:t + 1].float(), w[t:t + 1].contiguous(), idx[t:t + 1].contiguous(),
                          gate_up, gus, down, ds) for t in range(x.shape[0])])
    assert torch.equal(alone, got)
    bad = idx.clone()
    bad[0, 0] = gate_up.shape[0]
    with pytest.raises(RuntimeError, match="outside"):
        op(x.float(), w, bad, gate_up, gus, down, ds)
    return got
