"""kvPoolConfig and cpuMemSize: the host KV tier they configure, and what is refused."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from server.config import ConfigError, parse_config
from server.engine.config import engine_config_from_app
from tests.config.cfgkit import MC0, edited, minimal, write_weights

KP = "BackendConfig.kvPoolConfig"
SC = "BackendConfig.ScheduleConfig"
PREFIX = {f"{MC0}.plugin_params": json.dumps({"plugin_type": "mtp,prefix_cache",
                                               "num_speculative_tokens": 1})}


def load(edits: dict, tmp_path):
    write_weights(tmp_path / "tiny-model")
    return parse_config(edited(minimal(), edits), base_dir=tmp_path, env={})


def issues(edits: dict, tmp_path):
    with pytest.raises(ConfigError) as info:
        load(edits, tmp_path)
    return info.value.issues


def test_no_pool_and_no_preemption_means_no_tier(tmp_path):
    cfg = load({f"{MC0}.cpuMemSize": 5}, tmp_path)
    assert cfg.host_kv_tier_gb == 0 and cfg.warnings == ()
    ec = engine_config_from_app(cfg)
    assert (ec.host_cache_gb, ec.host_cache_prefix, ec.swap_preemption) == (0, False, False)


def test_preemption_swaps_into_cpu_mem_size(tmp_path):
    cfg = load({f"{MC0}.cpuMemSize": 3, f"{SC}.maxPreemptCount": 2}, tmp_path)
    assert cfg.warnings == ()                 # cpuMemSize takes effect: no "ignored" line
    ec = engine_config_from_app(cfg)
    assert (ec.host_cache_gb, ec.host_cache_prefix, ec.swap_preemption) == (3.0, False, True)


def test_host_backend_is_the_prefix_caches_second_level(tmp_path):
    cfg = load({**PREFIX, f"{KP}": {"backend": "host", "asyncWrite": True},
                f"{MC0}.cpuMemSize": 2}, tmp_path)
    ec = engine_config_from_app(cfg)
    assert (ec.host_cache_gb, ec.host_cache_prefix, ec.kv_pool_async_write) == (2.0, True, True)
    assert cfg.derived()["kvPoolBackend"] == "host"


def test_config_path_file_sizes_the_pool(tmp_path):
    (tmp_path / "pool.json").write_text(json.dumps({"mem_size_gb": 0.5}))
    cfg = load({**PREFIX, f"{KP}": {"backend": "host", "configPath": "pool.json"},
                f"{MC0}.cpuMemSize": 0}, tmp_path)
    assert cfg.host_kv_tier_gb == 0.5
    assert cfg.kv_pool.config_file == (tmp_path / "pool.json").resolve()


@pytest.mark.parametrize("backend", ["mooncake", "memcache", "yuanrong"])
def test_unavailable_backend_refused_with_path(backend, tmp_path):
    (issue,) = issues({**PREFIX, f"{KP}": {"backend": backend, "configPath": "m.json"}}, tmp_path)
    assert issue.path == f"{KP}.backend"
    assert repr(backend) in issue.message and "not available" in issue.message
    assert '"host"' in issue.allowed


def test_host_backend_needs_prefix_cache(tmp_path):
    (issue,) = issues({f"{KP}.backend": "host"}, tmp_path)
    assert issue.path == f"{KP}.backend" and "prefix_cache" in issue.message


@pytest.mark.parametrize("key,value", [("configPath", "pool.json"), ("asyncWrite", True)])
def test_pool_settings_without_backend_refused(key, value, tmp_path):
    (issue,) = issues({f"{KP}.{key}": value}, tmp_path)
    assert issue.path == f"{KP}.{key}" and "without a KV pool backend" in issue.message


@pytest.mark.parametrize("body,text", [
    (None, "not readable"),
    ("{not json", "not JSON"),
    (json.dumps({"mem_size_gb": -1}), "greater than 0"),
    (json.dumps({"segment_size": 1}), "no such key"),
])
def test_bad_pool_file_refused(body, text, tmp_path):
    if body is not None:
        (tmp_path / "pool.json").write_text(body)
    found = issues({**PREFIX, f"{KP}": {"backend": "host", "configPath": "pool.json"}}, tmp_path)
    assert len(found) == 1 and found[0].path.startswith(f"{KP}.configPath"), [str(i) for i in found]
    assert text in str(found[0]), str(found[0])


def test_host_pool_needs_a_size(tmp_path):
    (issue,) = issues({**PREFIX, f"{KP}.backend": "host", f"{MC0}.cpuMemSize": 0}, tmp_path)
    assert issue.path == f"{MC0}.cpuMemSize" and "size" in issue.message


def test_disk_tier_settings(tmp_path):
    (tmp_path / "pool.json").write_text(json.dumps({"disk_path": "kv-disk", "disk_size_gb": 2}))
    cfg = load({**PREFIX, f"{KP}": {"backend": "host", "configPath": "pool.json"},
                f"{MC0}.cpuMemSize": 1}, tmp_path)
    ec = engine_config_from_app(cfg)
    assert ec.disk_cache_dir == str((tmp_path / "kv-disk").resolve()) and ec.disk_cache_gb == 2
    assert not (tmp_path / "kv-disk").exists()          # made when the engine starts, not by --check


@pytest.mark.parametrize("body,key", [({"disk_path": "kv-disk"}, "disk_size_gb"),
                                      ({"disk_size_gb": 1}, "disk_path"),
                                      ({"disk_path": "no/such/parent", "disk_size_gb": 1}, "disk_path")])
def test_disk_tier_settings_refused(body, key, tmp_path):
    (tmp_path / "pool.json").write_text(json.dumps(body))
    (issue,) = issues({**PREFIX, f"{KP}": {"backend": "host", "configPath": "pool.json"},
                       f"{MC0}.cpuMemSize": 1}, tmp_path)
    assert issue.path == f"{KP}.configPath (pool.json).{key}", str(issue)


# ---- a disk tier smaller than one KV block ------------------------------------------
# Start-up refuses it (DiskTier needs room for one block file), so --check must too.  A
# block's bytes depend on the model: every cache layer (main layers and the MTP layer the
# weights hold) x cacheBlockSize tokens x the cache row; a file adds a 72-byte header and
# the block's key content (parent digest 32, next token 8, 8 per token: kvblock/key.py).
# The tiny checkpoint: 2 layers + 1 MTP, float32, kv_lora_rank 32 + qk_rope_head_dim 8.
DISK = {**PREFIX, f"{KP}": {"backend": "host", "configPath": "pool.json"},
        f"{MC0}.cpuMemSize": 1, f"{SC}.cacheBlockSize": 16}
INT8 = {f"{MC0}.models": {"deepseekv2": {"kv_cache_options": {"kv_cache_dtype": "int8"}}}}
HEADER = 72 + 32 + 8 + 8 * 16


def _tiny(tmp_path, with_mtp=True):
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path / "tiny-model", seed=0, with_mtp=with_mtp)


def _disk_config(tmp_path, size_gb, edits=()):
    (tmp_path / "pool.json").write_text(json.dumps({"disk_path": "kv-disk", "disk_size_gb": size_gb}))
    return parse_config(edited(minimal(), {**DISK, **dict(edits)}), base_dir=tmp_path, env={})


@pytest.mark.parametrize("with_mtp,edits,block", [
    (True, {}, 3 * 16 * 40 * 4),                        # the MTP layer's cache rows count
    (False, {}, 2 * 16 * 40 * 4),
    (True, INT8, 3 * 16 * (32 + 8 * 4 + 4)),            # int8 latent, float32 scale, fp32 RoPE
])
def test_disk_tier_below_one_block_refused_with_its_minimum(with_mtp, edits, block, tmp_path):
    _tiny(tmp_path, with_mtp)
    least = (block + HEADER) / (1 << 30)
    with pytest.raises(ConfigError) as info:
        _disk_config(tmp_path, (block + HEADER - 1) / (1 << 30), edits)
    (issue,) = info.value.issues
    assert issue.path == f"{KP}.configPath (pool.json).disk_size_gb", str(issue)
    assert f"{block} bytes and its file adds {HEADER} bytes of header and tokens" in issue.message, \
        str(issue)
    assert issue.allowed.startswith(f">= {least!r}"), str(issue)
    assert _disk_config(tmp_path, least, edits).kv_pool.disk_size_gb == least


def test_disk_tier_minimum_is_what_start_up_counts(tmp_path):
    # The same bytes as the running engine, or --check would pass a config start-up refuses.
    from server.engine.front.async_engine import build_engine
    from server.model.loading import load_checkpoint
    model, _ = load_checkpoint(_tiny(tmp_path))
    block = 3 * 16 * 40 * 4
    least = (block + HEADER) / (1 << 30)
    cfg = _disk_config(tmp_path, least)
    ec = engine_config_from_app(cfg, num_blocks=64, max_batch_size=2, compile="off")
    engine = build_engine(cfg, model, engine_config=ec)
    try:
        assert engine.runtime.kv_block_bytes == block
        assert engine.blocks.disk.capacity_blocks == 1
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="room for one block"):
        build_engine(cfg, model, engine_config=replace(ec, disk_cache_gb=least - 2 ** -30))


def test_disk_tier_check_skipped_without_a_readable_model_config(tmp_path):
    # cfgkit's weights folder has only model_type: the size cannot be told, start-up will.
    (tmp_path / "pool.json").write_text(json.dumps({"disk_path": "kv-disk", "disk_size_gb": 1e-9}))
    cfg = load({**DISK, f"{KP}": {"backend": "host", "configPath": "pool.json"}}, tmp_path)
    assert cfg.kv_pool.disk_size_gb == 1e-9
