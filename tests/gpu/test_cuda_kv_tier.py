"""The host KV tier on a CUDA device (skipped without one): pinned host rows, the staged
device-to-host and host-to-device copies, asyncWrite's deferred saves, and the engine's
outputs with the tier on and off.  The CPU versions are in tests/engine/test_kv_tier.py."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

from server.engine.kv.transfer.host_pool import HostKVPool
from server.engine.protocol import SamplingParams
from server.model.layers.latent_cache import Int8LatentCache, LatentCache
from tests.engine.helpers import make_engine, prompts, requests, run_tokens, tiny_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, temperature=0.8, ignore_eos=True, seed=3)


@functools.lru_cache(maxsize=None)
def cuda_model():
    return copy.deepcopy(tiny_model()).to("cuda").eval()


def check_pool_round_trip(device: str, kind: str, async_write: bool) -> None:
    g = torch.Generator().manual_seed(0)
    if kind == "float":
        caches = [LatentCache(torch.randn(6, 4, 8, generator=g).to(device)) for _ in range(3)]
    else:
        caches = [Int8LatentCache(6, 4, 6, 2, torch.bfloat16, device) for _ in range(3)]
        for c in caches:
            c.write(torch.arange(24, device=device), torch.randn(24, 8, generator=g).to(device))
    pool = HostKVPool(caches, 4, torch.device(device), async_write=async_write)
    assert pool.data.is_pinned() == (device == "cuda")
    before = [[t.clone() for t in c.block_tensors()] for c in caches]
    pool.apply([(1, 0), (2, 1)], [])
    pool.apply([(3, 0)], [(0, 3), (1, 5)])      # slot 0 read and reused, block 3 saved and reused
    for c, old in zip(caches, before):
        for t, o in zip(c.block_tensors(), old):
            assert torch.equal(t[3], o[1]) and torch.equal(t[5], o[2])
            t[1:4].zero_()                      # as a forward reusing blocks 1-3 would
    pool.apply([], [(0, 4)])                    # slot 0 holds the old block 3 (deferred or not)
    for c, old in zip(caches, before):
        for t, o in zip(c.block_tensors(), old):
            assert torch.equal(t[4], o[3])


@pytest.mark.parametrize("async_write", [False, True])
@pytest.mark.parametrize("kind", ["float", "int8"])
def test_pinned_pool_moves_blocks_whole(kind, async_write):
    check_pool_round_trip("cuda", kind, async_write)


def check_engine(device: str, model) -> None:
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(2, 500, (40,), generator=g).tolist() for _ in range(6)]

    def run(**tier):
        eng = make_engine(model, k=1, num_blocks=24, block_size=8, max_batch_size=2,
                          enable_prefix_cache=True, device=device, **tier)
        out = {}
        for r in range(3):
            for i, p in enumerate(prefixes):
                out.update(run_tokens(eng, requests([p + [7, 8, r]], GREEDY, prefix=f"r{r}-{i}")))
        return out, eng.stats()

    plain, _ = run()
    for async_write in (False, True):
        tiered, st = run(host_cache_blocks=64, host_cache_prefix=True, kv_pool_async_write=async_write)
        assert tiered == plain and st.host_cache_hits > 0
    ps = prompts(6, seed=2, lo=10, hi=30)
    kw = dict(device=device, async_scheduling=True, async_executor="thread")
    ref = run_tokens(make_engine(model, k=2, num_blocks=512, **kw), requests(ps, SEEDED))
    eng = make_engine(model, k=2, num_blocks=22, max_batch_size=6, max_preempt_count=100,
                      host_cache_blocks=200, swap_preemption=True, kv_pool_async_write=True, **kw)
    assert run_tokens(eng, requests(ps, SEEDED)) == ref
    st = eng.stats()
    assert st.num_swapped_out > 0 and st.num_preemptions_recomputed == 0


def test_engine_outputs_unchanged_by_the_tier_on_cuda():
    check_engine("cuda", cuda_model())
