"""The slice of AppConfig the HTTP layer needs, read once at start-up (immutable)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ApiSettings:
    model_name: str
    model_path: str
    max_seq_len: int
    max_input_len: int               # min(maxInputTokenLen, maxSeqLen - 1)
    vocab_size: int                  # the model's (config.json): token ids are [0, vocab_size)
    truncation: int                  # 0 reject, -1 truncate right (keep head), 1 truncate left
    max_iter_times: int
    max_link_num: int
    token_timeout_s: float
    e2e_timeout_s: float
    max_request_bytes: int
    full_text: bool
    num_speculative_tokens: int      # effective k (engine RuntimeInfo); 0: MTP off
    enable_reasoning: bool
    tool_call_parser: str            # deepseek_v3 | deepseek_v31
    raw: dict                        # GET /v1/config
    max_n: int = 128                 # ScheduleConfig.maxN: choices per request (n)
    header_timeout_s: float = 10.0   # clientHeaderTimeout: headers complete within it (408)
    body_timeout_s: float = 60.0     # clientBodyTimeout: body complete within it (408)

    @property
    def mtp(self) -> bool:
        return self.num_speculative_tokens > 0


def settings_from_config(cfg: Any, runtime: Any) -> ApiSettings:
    """``runtime``: the engine's RuntimeInfo, the truth about k (a checkpoint without MTP
    weights runs with k = 0 whatever the config asked for) and about the model's
    vocabulary: token ids are valid in [0, vocab_size) of the model, not of the tokenizer,
    whose added tokens (DeepSeek's ``<｜User｜>``, placeholders) and padding rows can lie
    above its base vocabulary."""
    server, mc, sched = cfg.server, cfg.model_config, cfg.schedule
    return ApiSettings(
        model_name=cfg.model_name,
        model_path=str(cfg.model_weight_path),
        max_seq_len=cfg.max_seq_len,
        max_input_len=cfg.max_input_len,
        vocab_size=runtime.vocab_size,
        max_n=cfg.max_n,
        truncation=int(cfg.truncation),
        max_iter_times=sched.max_iter_times,
        max_link_num=server.max_link_num,
        token_timeout_s=float(server.token_timeout),
        e2e_timeout_s=float(server.e2e_timeout),
        max_request_bytes=server.max_request_length * 1024 * 1024,
        header_timeout_s=float(server.client_header_timeout),
        body_timeout_s=float(server.client_body_timeout),
        full_text=server.full_text_enabled,
        num_speculative_tokens=runtime.num_speculative_tokens,
        enable_reasoning=cfg.reasoning_enabled,
        tool_call_parser=cfg.tool_call_parser,
        raw={"modelName": cfg.model_name, "maxSeqLen": cfg.max_seq_len,
             "npuMemSize": mc.npu_mem_size, "cpuMemSize": mc.cpu_mem_size,
             "worldSize": mc.world_size, "maxOutputLen": sched.max_iter_times,
             "cacheBlockSize": sched.cache_block_size},
    )


def resolve_relative(path: str | Path, base: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else (base / p)
