"""The host KV pool's settings: ``BackendConfig.kvPoolConfig`` plus the file its
``configPath`` names.

MindIE passes ``configPath`` to the pool backend (for mooncake, a client JSON).  For the
"host" backend it is an optional JSON object with snake_case keys, read once at load:

  {"mem_size_gb": 8}        host memory for the pool in GB (default: cpuMemSize)

Rules that read files live here (the loader calls ``load_pool_settings``); the ones that
read only config.json fields are in rules.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.config.errors import ConfigIssue, issues_from_validation
from server.config.sections import MindIEConfig

KP = "BackendConfig.kvPoolConfig"


class HostPoolFile(BaseModel):
    """The JSON object at ``configPath`` for the "host" backend (unknown keys refused)."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    mem_size_gb: float | None = Field(None, gt=0, le=1 << 20)


@dataclass(frozen=True, slots=True)
class KvPoolSettings:
    backend: str = ""                  # "" (off) or "host"
    config_file: Path | None = None    # configPath, absolute
    mem_size_gb: float | None = None   # from the file; None: cpuMemSize
    async_write: bool = False


def load_pool_settings(doc: MindIEConfig, base: Path,
                       check_files: bool) -> tuple[KvPoolSettings, list[ConfigIssue]]:
    pool = doc.backend.kv_pool_config
    if not pool.backend:
        return KvPoolSettings(), []
    where = f"{KP}.configPath"
    issues: list[ConfigIssue] = []
    file = (base / pool.config_path).resolve() if pool.config_path else None
    mem = None
    if file is not None and check_files:
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
            mem = HostPoolFile.model_validate(raw).mem_size_gb
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
    return KvPoolSettings(pool.backend, file, mem, pool.async_write), issues
