"""The host KV pool's settings: ``BackendConfig.kvPoolConfig`` plus the file its
``configPath`` names.

MindIE passes ``configPath`` to the pool backend (for mooncake, a client JSON).  For the
"host" backend it is an optional JSON object with snake_case keys, read once at load:

  {"mem_size_gb": 8,        host memory for the pool in GB (default: cpuMemSize)
   "disk_path": "kv-disk",  a folder for the disk tier (relative to the config's folder)
   "disk_size_gb": 50}      its size bound in GB (required with disk_path)

Rules that read files live here (the loader calls ``load_pool_settings`` and
``disk_tier_issue``); the ones that read only config.json fields are in rules.py.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.config.checkpoint.kv_block import checkpoint_kv_block_bytes
from server.config.errors import ConfigIssue, issues_from_validation
from server.config.mindie.sections import MindIEConfig
from server.kvblock.file import file_overhead
from server.kvblock.size import disk_tier_blocks, min_disk_gb

KP = "BackendConfig.kvPoolConfig"


class HostPoolFile(BaseModel):
    """The JSON object at ``configPath`` for the "host" backend (unknown keys refused)."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    mem_size_gb: float | None = Field(None, gt=0, le=1 << 20)
    disk_path: str | None = Field(None, min_length=1)
    disk_size_gb: float | None = Field(None, gt=0, le=1 << 30)


@dataclass(frozen=True, slots=True)
class KvPoolSettings:
    backend: str = ""                  # "" (off) or "host"
    config_file: Path | None = None    # configPath, absolute
    mem_size_gb: float | None = None   # from the file; None: cpuMemSize
    async_write: bool = False
    disk_dir: Path | None = None       # disk tier folder, absolute (None: no disk tier)
    disk_size_gb: float = 0.0


def load_pool_settings(doc: MindIEConfig, base: Path,
                       check_files: bool) -> tuple[KvPoolSettings, list[ConfigIssue]]:
    pool = doc.backend.kv_pool_config
    if not pool.backend:
        return KvPoolSettings(), []
    where = f"{KP}.configPath"
    issues: list[ConfigIssue] = []
    file = (base / pool.config_path).resolve() if pool.config_path else None
    settings = HostPoolFile()
    if file is not None and check_files:
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
            settings = HostPoolFile.model_validate(raw)
        except OSError as exc:
            issues.append(ConfigIssue(where, pool.config_path, "a readable JSON file",
                                      f"KV pool settings not readable: {exc.strerror or exc}"))
        except ValueError as exc:
            if isinstance(exc, ValidationError):
                issues += [ConfigIssue(f"{where} ({file.name}).{i.path}", i.value, i.allowed,
                                       i.message) for i in issues_from_validation(exc)]
            else:
                issues.append(ConfigIssue(where, pool.config_path, "a JSON object",
                                          f"KV pool settings are not JSON: {exc}"))
    disk_dir = None
    if (settings.disk_path is None) != (settings.disk_size_gb is None):
        have, need = ("disk_path", "disk_size_gb") if settings.disk_path else ("disk_size_gb", "disk_path")
        issues.append(ConfigIssue(f"{where} ({file.name}).{need}", None, f"set together with {have}",
                                  f"the disk tier needs both disk_path and disk_size_gb"))
    elif settings.disk_path is not None:
        disk_dir = (file.parent / settings.disk_path).resolve()
        parent = disk_dir if disk_dir.exists() else disk_dir.parent
        if not (parent.is_dir() and os.access(parent, os.W_OK)):
            issues.append(ConfigIssue(f"{where} ({file.name}).disk_path", settings.disk_path,
                                      "a writable folder (or one that can be made in a writable one)",
                                      f"disk tier folder not usable: {disk_dir}"))
    return KvPoolSettings(pool.backend, file, settings.mem_size_gb, pool.async_write, disk_dir,
                          settings.disk_size_gb or 0.0), issues


def disk_tier_issue(settings: KvPoolSettings, weights: Path, block_size: int,
                    kv_cache_dtype: str) -> ConfigIssue | None:
    """A disk tier smaller than one KV block, which start-up refuses (DiskTier).  A block's
    size depends on the model, so this reads its config.json; when that cannot be done
    without loading the weights the check is left to start-up."""
    if settings.disk_dir is None or settings.config_file is None:
        return None
    block = checkpoint_kv_block_bytes(weights, block_size, kv_cache_dtype)
    if block is None or disk_tier_blocks(settings.disk_size_gb, block, block_size) >= 1:
        return None
    return ConfigIssue(f"{KP}.configPath ({settings.config_file.name}).disk_size_gb",
                       settings.disk_size_gb, f">= {min_disk_gb(block, block_size)!r} (GB of 2^30 bytes)",
                       f"the disk tier cannot hold one KV block of this model: a block is "
                       f"{block} bytes and its file adds {file_overhead(block_size)} bytes of "
                       f"header and tokens (cacheBlockSize {block_size}, kv_cache_dtype "
                       f"{kv_cache_dtype})",
                       related=("BackendConfig.ScheduleConfig.cacheBlockSize",))
