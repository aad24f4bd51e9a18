"""The slice of AppConfig the HTTP layer needs, read once at start-up.

The config package owns the schema; this module only reads it.  Attribute names are
looked up in snake_case first and MindIE camelCase second, so the API layer does not
break if the config models keep the JSON spelling as attribute names.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MISSING = object()


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def pick(obj: Any, *names: str, default: Any = _MISSING) -> Any:
    """First attribute (or mapping key) of ``obj`` found under any spelling of ``names``."""
    for name in names:
        for spelled in (name, _snake(name)):
            if isinstance(obj, dict) and spelled in obj:
                return obj[spelled]
            if obj is not None and hasattr(obj, spelled):
                return getattr(obj, spelled)
    if default is _MISSING:
        raise AttributeError(f"config has none of {names}")
    return default


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """``ModelConfig.models.<model_type>`` switches that change the HTTP output."""
    enable_reasoning: bool = False
    tool_call_parser: str | None = None


@dataclass(frozen=True, slots=True)
class ApiSettings:
    model_name: str
    model_path: str
    max_seq_len: int
    max_input_len: int               # min(maxInputTokenLen, maxSeqLen - 1)
    truncation: int                  # 0 reject, -1 truncate right (keep head), 1 truncate left
    max_iter_times: int
    cache_block_size: int
    max_link_num: int
    token_timeout_s: float
    e2e_timeout_s: float
    max_request_bytes: int
    full_text: bool
    num_speculative_tokens: int      # 0: MTP off
    options: ModelOptions
    raw: dict                        # for GET /v1/config

    @property
    def mtp(self) -> bool:
        return self.num_speculative_tokens > 0


def _truncation(value: Any) -> int:
    if value is True:
        return -1
    if value is False or value is None:
        return 0
    return int(value)


def model_options(models: Any, model_type: str | None) -> ModelOptions:
    """Find ``models.<model_type>``; MindIE keys DeepSeek as ``deepseekv2`` so compare loosely."""
    if hasattr(models, "model_dump"):
        models = models.model_dump()
    if isinstance(models, str):
        import json
        models = json.loads(models or "{}")
    models = dict(models or {})
    norm = lambda s: re.sub(r"[^a-z0-9]", "", str(s).lower())
    entry = models.get(model_type) if model_type else None
    if entry is None and model_type:
        entry = next((v for k, v in models.items() if norm(k) == norm(model_type)), None)
    if entry is None and model_type and norm(model_type).startswith("deepseek"):
        entry = next((v for k, v in models.items() if norm(k).startswith("deepseek")), None)
    if entry is None and len(models) == 1:
        entry = next(iter(models.values()))
    entry = entry or {}
    if hasattr(entry, "model_dump"):
        entry = entry.model_dump()
    tco = entry.get("tool_call_options") or {}
    return ModelOptions(enable_reasoning=bool(entry.get("enable_reasoning", False)),
                        tool_call_parser=tco.get("tool_call_parser"))


def settings_from_config(cfg: Any, model_type: str | None = None) -> ApiSettings:
    server = pick(cfg, "server")
    backend = pick(cfg, "backend")
    deploy = pick(backend, "model_deploy", "ModelDeployConfig")
    mcfg = pick(deploy, "model_config", "ModelConfig")[0]
    sched = pick(backend, "schedule", "ScheduleConfig")
    mtp = pick(cfg, "mtp", default=None)
    max_seq = int(pick(deploy, "maxSeqLen"))
    max_in = min(int(pick(deploy, "maxInputTokenLen")), max_seq - 1)
    return ApiSettings(
        model_name=str(pick(cfg, "model_name", default=None) or pick(mcfg, "modelName")),
        model_path=str(pick(cfg, "model_weight_path", default=None) or pick(mcfg, "modelWeightPath")),
        max_seq_len=max_seq,
        max_input_len=max_in,
        truncation=_truncation(pick(deploy, "truncation", default=0)),
        max_iter_times=int(pick(sched, "maxIterTimes", default=max_seq)),
        cache_block_size=int(pick(sched, "cacheBlockSize", default=128)),
        max_link_num=int(pick(server, "maxLinkNum", default=1000)),
        token_timeout_s=float(pick(server, "tokenTimeout", default=600)),
        e2e_timeout_s=float(pick(server, "e2eTimeout", default=600)),
        max_request_bytes=int(pick(server, "maxRequestLength", default=40)) * 1024 * 1024,
        full_text=bool(pick(server, "fullTextEnabled", default=False)),
        num_speculative_tokens=int(pick(mtp, "num_speculative_tokens", default=0) or 0) if mtp else 0,
        options=model_options(pick(mcfg, "models", default=None), model_type),
        raw={
            "modelName": str(pick(mcfg, "modelName", default="")),
            "maxSeqLen": max_seq,
            "npuMemSize": pick(mcfg, "npuMemSize", default=-1),
            "cpuMemSize": pick(mcfg, "cpuMemSize", default=0),
            "worldSize": pick(mcfg, "worldSize", default=1),
            "maxOutputLen": int(pick(sched, "maxIterTimes", default=max_seq)),
            "cacheBlockSize": int(pick(sched, "cacheBlockSize", default=128)),
        },
    )


def resolve_relative(path: str | Path, base: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else (base / p)
