"""KV pool sizing and allocation."""
import torch

from server.engine.kv.cache import GIB, KVCacheSpec, allocate_kv_caches, num_blocks_for

SPEC = KVCacheSpec(num_layers=3, block_size=16, kv_cache_dim=40, dtype=torch.float32)


def test_bytes_per_block():
    assert SPEC.bytes_per_block == 3 * 16 * 40 * 4


def test_explicit_count_wins():
    assert num_blocks_for(SPEC, mem_size_gb=5, device="cpu", max_useful_blocks=10, num_blocks=7) == 7


def test_mem_size_in_gib_capped_by_what_can_be_used():
    n = num_blocks_for(SPEC, mem_size_gb=0.001, device="cpu", max_useful_blocks=10**9)
    assert n == int(0.001 * GIB) // SPEC.bytes_per_block
    assert num_blocks_for(SPEC, mem_size_gb=1, device="cpu", max_useful_blocks=123) == 123


def test_auto_on_cpu_uses_a_bounded_share_of_available_memory():
    n = num_blocks_for(SPEC, mem_size_gb=-1, device="cpu", max_useful_blocks=10**12)
    assert 0 < n * SPEC.bytes_per_block <= 4 * GIB


def test_allocate_one_zeroed_cache_per_layer():
    caches = allocate_kv_caches(SPEC, 5, "cpu")
    assert len(caches) == 3 and caches[0].data.shape == (5, 16, 40) and not caches[2].data.any()


def test_int8_layers_are_smaller_and_allocated_as_int8():
    spec = KVCacheSpec(num_layers=3, block_size=16, kv_cache_dim=40, dtype=torch.float32,
                       rope_dim=8, int8_layers=frozenset({1}))
    assert spec.bytes_per_block == 16 * (2 * 40 * 4 + (32 + 8 * 4 + 4))
    caches = allocate_kv_caches(spec, 5, "cpu")
    assert caches[1].latent.dtype == torch.int8 and caches[1].latent.shape == (5, 16, 32)
    assert caches[0].data.dtype == torch.float32
