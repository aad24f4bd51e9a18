"""``AppConfig``: the validated file plus the values derived from it at load.

The pydantic tree (``document``) mirrors config.json; what components actually ask
("is MTP on, with how many drafts?", "where are the weights?", "how long may an input
be?") is answered by the properties here, computed from it once and never mutated.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.config.errors import ConfigIssue
from server.config.kv_pool import KvPoolSettings
from server.config.mindie.plugins import MtpSettings, PluginParams
from server.config.mindie.sections import (BackendConfig, LogConfig, MindIEConfig, ModelConfig,
                                           ModelDeployConfig, ModelTypeOptions, ScheduleConfig,
                                           ServerConfig)
from server.config.parallel import NodeLayout, unserved_parallel, unserved_with_striped_kv
from server.config.rules import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS


@dataclass(frozen=True, slots=True)
class AppConfig:
    document: MindIEConfig                  # the file, validated, env overrides applied
    model_weight_path: Path                 # ModelConfig[0].modelWeightPath, absolute
    source: Path | None = None              # the file it came from (None: built in memory)
    checkpoint_model_type: str | None = None  # from <weights>/config.json; None if not read
    model_options_key: str | None = None    # which ModelConfig[0].models key configured us
    model_options: ModelTypeOptions = ModelTypeOptions()
    chat_template_path: Path | None = None  # models.<key>.chat_template, absolute
    async_scheduling: bool = False          # $MINDIE_ASYNC_SCHEDULING_ENABLE == 1
    metrics_enabled: bool = True            # $MIES_SERVICE_MONITOR_MODE (default on)
    compile_mode: str = "auto"              # $MTP_SERVE_COMPILE: auto | on | off
    compile_wait: bool = False              # $MTP_SERVE_COMPILE_WAIT: start-up waits for the graphs
    engine_process: bool = True             # $MTP_SERVE_ENGINE_PROCESS: the daemon's engine in its own process
    draft_after_emit: bool = True           # $MTP_SERVE_DRAFT_AFTER_EMIT: a step's MTP passes after its tokens go out
    fatal_exit_delay_s: float = 5.0         # $MTP_SERVE_FATAL_EXIT_DELAY: /health 503 this long, then exit 1
    step_timeout_s: float = 300.0           # $MTP_SERVE_STEP_TIMEOUT: an engine step longer than this is a hang
    prediction_draft_tokens: int = 64       # $MTP_SERVE_PREDICTION_TOKENS: prediction tokens verified per step
    warnings: tuple[str, ...] = ()          # unknown/deprecated/ignored keys, already logged
    api_keys: tuple[str, ...] = ()          # ServerConfig.apiKeys + $MTP_SERVE_API_KEY
    parallel: NodeLayout = NodeLayout()     # worldSize/tp/dp/cp/sp/moe_tp/moe_ep, nodes ($NNODES...)
    kv_pool: KvPoolSettings = KvPoolSettings()  # kvPoolConfig + its configPath file

    # ---- sections -------------------------------------------------------------------
    @property
    def server(self) -> ServerConfig:
        return self.document.server

    @property
    def backend(self) -> BackendConfig:
        return self.document.backend

    @property
    def log(self) -> LogConfig:
        return self.document.log

    @property
    def model_deploy(self) -> ModelDeployConfig:
        return self.document.backend.model_deploy

    @property
    def model_config(self) -> ModelConfig:
        """The served model's entry (the loader guarantees exactly one)."""
        return self.document.backend.model_deploy.model_configs[0]

    @property
    def schedule(self) -> ScheduleConfig:
        return self.document.backend.schedule

    # ---- features -------------------------------------------------------------------
    @property
    def plugins(self) -> PluginParams:
        return self.model_config.plugin_params

    @property
    def mtp(self) -> MtpSettings | None:
        """None: plain decoding (no mtp plugin, or num_speculative_tokens 0)."""
        return self.plugins.mtp

    @property
    def num_speculative_tokens(self) -> int:
        return self.mtp.num_speculative_tokens if self.mtp else 0

    @property
    def prefix_cache_enabled(self) -> bool:
        return self.plugins.prefix_cache

    @property
    def host_kv_tier_gb(self) -> float:
        """Host memory for the KV tier: the "host" pool's size (its file, else cpuMemSize),
        or cpuMemSize as swap space when preemption is on; 0 when neither asks for it."""
        if self.kv_pool.backend:
            return self.kv_pool.mem_size_gb or float(self.model_config.cpu_mem_size)
        if self.schedule.max_preempt_count > 0:
            return float(self.model_config.cpu_mem_size)
        return 0.0

    @property
    def reasoning_enabled(self) -> bool:
        return self.model_options.enable_reasoning

    @property
    def kv_cache_dtype(self) -> str:
        """"auto" (the model dtype, or int8 where an FA3 checkpoint says so) or "int8"."""
        return self.model_options.kv_cache_options.kv_cache_dtype

    @property
    def tool_call_parser(self) -> str:
        """``deepseek_v3`` or ``deepseek_v31`` (MindIE aliases normalised)."""
        name = self.model_options.tool_call_options.tool_call_parser
        return TOOL_CALL_PARSERS[name] if name else DEFAULT_TOOL_CALL_PARSER

    @property
    def unserved(self) -> list[ConfigIssue]:
        """Parts of the (rule-abiding) parallel layout this build does not serve, alone or
        with the features asked for; the daemon refuses to start unless this is empty
        (config/parallel.py)."""
        return unserved_parallel(self.parallel) + unserved_with_striped_kv(
            self.parallel, kv_pool_backend=self.kv_pool.backend,
            max_preempt_count=self.schedule.max_preempt_count)

    # ---- names and limits -----------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.model_config.model_name or ""

    @property
    def max_seq_len(self) -> int:
        return self.model_deploy.max_seq_len

    @property
    def max_input_len(self) -> int:
        """Longest accepted prompt: ``min(maxInputTokenLen, maxSeqLen - 1)``."""
        return self.model_deploy.effective_max_input_len

    @property
    def truncation(self) -> int:
        """0 reject over-long input, -1 keep its head (cut right), 1 keep its tail (cut left)."""
        return self.model_deploy.truncation

    @property
    def max_prefill_batch_size(self) -> int:
        return self.schedule.effective_max_prefill_batch_size

    @property
    def management_ip(self) -> str:
        return self.server.effective_management_ip

    @property
    def max_n(self) -> int:
        """Most choices one request may ask for (``n``): ScheduleConfig.maxN, at most
        maxBatchSize (MindIE's default 128 is clamped to it when the key is left out)."""
        return self.schedule.max_n

    def derived(self) -> dict[str, Any]:
        """Values computed at load, as printed under ``Derived`` by ``--check``."""
        return {
            "sourceFile": str(self.source) if self.source else None,
            "modelWeightPath": str(self.model_weight_path),
            "checkpointModelType": self.checkpoint_model_type,
            "effectiveMaxInputTokenLen": self.max_input_len,
            "effectiveMaxPrefillBatchSize": self.max_prefill_batch_size,
            "managementIpAddress": self.management_ip,
            "mtp": ({"num_speculative_tokens": self.mtp.num_speculative_tokens,
                     "adaptive_speculation": self.mtp.adaptive_speculation} if self.mtp else None),
            "prefixCache": self.prefix_cache_enabled,
            "reasoningEnabled": self.reasoning_enabled,
            "toolCallParser": self.tool_call_parser,
            "chatTemplatePath": str(self.chat_template_path) if self.chat_template_path else None,
            "modelOptionsKey": self.model_options_key,
            "asyncScheduling": self.async_scheduling,
            "kvCacheDtype": self.kv_cache_dtype,
            "hostKvTierGB": self.host_kv_tier_gb,
            "kvPoolBackend": self.kv_pool.backend,
            "parallel": {"worldSize": self.parallel.world_size, "tp": self.parallel.tp,
                         "dp": self.parallel.dp, "cp": self.parallel.cp, "sp": self.parallel.sp,
                         "moe_tp": self.parallel.moe_tp, "moe_ep": self.parallel.moe_ep,
                         "followsMindIERules": True,     # a config that loaded passed them
                         "notServed": [i.message for i in self.unserved]},
            "metricsEnabled": self.metrics_enabled,
            "predictionDraftTokens": self.prediction_draft_tokens,
            "apiKeys": len(self.api_keys),
            "warnings": list(self.warnings),
        }

    def to_dict(self) -> dict[str, Any]:
        """The effective config: MindIE-shaped, defaults filled, plugin_params as an object,
        modelWeightPath absolute, plus a ``Derived`` section.  JSON-serialisable."""
        out = self.document.model_dump(mode="json", by_alias=True, exclude_none=True)
        server = out["ServerConfig"]
        server["managementIpAddress"] = self.management_ip
        if server.get("apiKeys"):               # printed by --check: never the keys themselves
            server["apiKeys"] = ["<redacted>"] * len(server["apiKeys"])
        for entry in out["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]:
            if entry.get("plugin_params") == {"plugin_type": ""}:
                del entry["plugin_params"]       # MindIE: no plugin = no key
        out["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = \
            str(self.model_weight_path)
        out["Derived"] = self.derived()
        return out
