"""Pydantic models of MindIE's ``config.json``, one class per section, keyed by MindIE's names.

Field-local checks (types, ranges, enums, patterns) live here as pydantic constraints;
rules that read several fields live in ``rules.py`` so they still run, and are all
reported, when some single field is broken.  Defaults and ranges are MindIE's
(MindIE Service config reference).  What every section shares (strict scalars, unknown
keys kept, frozen models) is in base.py; ``ServerConfig`` in server.py.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (StrictBool, StrictInt, StrictStr, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from server.config.mindie.base import I32, U32, F, Section
from server.config.mindie.plugins import PluginParams, decode_plugin_params
from server.config.mindie.server import (  # noqa: F401
    API_KEY_RULE, HealthCheckConfig, ServerConfig, check_api_key, is_all_interfaces)

MODEL_NAME_RULE = "1-256 of [A-Za-z0-9._-], not starting or ending with '-', '.' or '_'"
_MODEL_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,254}[A-Za-z0-9])?")
_BACKEND_NAME = re.compile(r"[a-z_]{1,50}")


def _not_built(value: int | None, what: str, allowed: str) -> int | None:
    """Refuse a parallel size above 1 for a kind of parallelism MindIE's DeepSeek layouts
    do not use and this daemon does not build (pp): accepting ``pp: 2`` while serving
    without it would mislead.  (worldSize, tp, dp, cp, sp, moe_tp and moe_ep follow
    MindIE's layout rules: config/parallel.py checks them, and says which this build
    serves.)"""
    if value is not None and value > 1:
        raise PydanticCustomError(
            "not_built", "{what} of {value} is not implemented; tensor parallel (tp) and "
            "expert parallel (moe_tp, moe_ep) over worldSize ranks are",
            {"what": what, "value": value, "allowed": allowed})
    return value


KV_POOL_BACKENDS = {"host": "this daemon's host-memory pool (engine/kv/host_tier.py)"}
KV_POOL_RULE = '"" (no KV pool) or "host" (' + KV_POOL_BACKENDS["host"] + ")"


class KvPoolConfig(Section):
    """MindIE's KV cache pool: the second cache level behind the device prefix cache.

    ``backend`` "host" is the one pool this daemon has: evicted prefix blocks go to host
    memory (docs/config.md).  MindIE's external stores (mooncake, memcache, yuanrong)
    need their own services and client libraries, which this daemon does not link:
    naming one is refused rather than silently serving without a pool."""
    backend: StrictStr = F("backend", "")
    config_path: StrictStr = F("configPath", "", doc="JSON settings of the host pool (kv_pool.py)")
    async_write: StrictBool = F("asyncWrite", False)

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value and value not in KV_POOL_BACKENDS:
            raise PydanticCustomError(
                "kv_pool", f"KV cache pooling backend {value!r} is not available here (an "
                "external store this daemon has no client for)", {"allowed": KV_POOL_RULE})
        return value


class LoraModule(Section):
    name: StrictStr | None = F("name")
    path: StrictStr | None = F("path")
    base_model_name: StrictStr | None = F("baseModelName")


def _truncation(value: Any) -> int:
    # bool first: True is an int in Python.  MindIE: true/-1 right, false/0 reject, 1 left.
    if isinstance(value, bool):
        return -1 if value else 0
    if isinstance(value, int) and value in (-1, 0, 1):
        return value
    raise PydanticCustomError("truncation", "invalid truncation mode",
                              {"allowed": "false/0 (reject), true/-1 (truncate right), 1 (truncate left)"})


class ModelConfig(Section):
    model_instance_type: Literal["Standard", "StandardMock", "TargetModel", "AssistantModel"] = F(
        "modelInstanceType", "Standard")
    model_name: StrictStr | None = F("modelName", None, doc=MODEL_NAME_RULE)
    model_weight_path: StrictStr | None = F(
        "modelWeightPath", None, doc="relative paths resolve against the config file's folder")
    world_size: StrictInt = F("worldSize", 1, lo=1, hi=4096, doc="ranks (devices, or CPU processes); MindIE's default is 4")
    cpu_mem_size: StrictInt = F("cpuMemSize", 5, lo=0, hi=U32, doc="GB of host memory for KV: swap space for preemption, and the host pool's default size")
    npu_mem_size: StrictInt = F("npuMemSize", -1, doc="GB for the KV cache; -1 = auto")
    backend_type: Literal["atb", "ms", "torch"] = F("backendType", "torch", doc="MindIE's default is atb")
    trust_remote_code: StrictBool = F("trustRemoteCode", False)
    plugin_params: PluginParams = F("plugin_params", PluginParams())
    models: dict[StrictStr, Any] = F("models", {}, doc="per-model-type options, e.g. deepseekv2")
    async_scheduler_wait_time: StrictInt = F("async_scheduler_wait_time", 120, lo=1, hi=3600)
    kv_trans_timeout: StrictInt = F("kv_trans_timeout", 10, lo=-I32 - 1, hi=I32)
    kv_link_timeout: StrictInt = F("kv_link_timeout", 1080, lo=-I32 - 1, hi=I32)
    tp: StrictInt | None = F("tp", None, lo=1, hi=I32)
    dp: StrictInt = F("dp", -1, lo=-1, hi=I32, doc="-1 (unset) or >= 1; tp * cp * dp == worldSize")
    cp: StrictInt = F("cp", 1, lo=1, hi=2, doc="MindIE's range; > 1 needs sp > 1 and dp 1")
    sp: StrictInt = F("sp", 1, lo=1, hi=I32, doc="1, or equal to tp")
    moe_tp: StrictInt | None = F("moe_tp", None, lo=1, hi=I32)
    moe_ep: StrictInt | None = F("moe_ep", None, lo=1, hi=I32)
    pp: StrictInt | None = F("pp", None, lo=1, hi=I32)

    @field_validator("plugin_params", mode="before")
    @classmethod
    def _plugins(cls, value: Any) -> Any:
        return decode_plugin_params(value)

    @field_validator("model_name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not _MODEL_NAME.fullmatch(value):
            raise PydanticCustomError("model_name", "invalid model name", {"allowed": MODEL_NAME_RULE})
        return value

    @field_validator("npu_mem_size")
    @classmethod
    def _npu_mem(cls, value: int) -> int:
        if value != -1 and not 0 < value <= I32:
            raise PydanticCustomError("npu_mem_size", "invalid npuMemSize",
                                      {"allowed": f"-1 (auto) or [1, {I32}]"})
        return value

    @field_validator("dp")
    @classmethod
    def _dp(cls, value: int) -> int:
        if value == 0:
            raise PydanticCustomError("dp", "dp must not be 0", {"allowed": "-1 (unset) or >= 1"})
        return value

    @field_validator("pp")
    @classmethod
    def _pp(cls, value: int | None) -> int | None:
        return _not_built(value, "pp (pipeline parallelism)", "1 or unset")


class ModelDeployConfig(Section):
    max_seq_len: StrictInt = F("maxSeqLen", 2560, lo=1, hi=U32, doc="input + output tokens")
    max_input_token_len: StrictInt = F("maxInputTokenLen", 2048, lo=1, hi=4194304)
    truncation: StrictInt = F("truncation", 0, doc="0 reject, -1 truncate right, 1 truncate left")
    max_loras: StrictInt | None = F("maxLoras", None, lo=0, hi=U32)
    max_lora_rank: StrictInt | None = F("maxLoraRank", None, lo=0, hi=U32)
    lora_modules: tuple[LoraModule, ...] = F("LoraModules", ())
    model_configs: tuple[ModelConfig, ...] = F("ModelConfig", ())

    @field_validator("truncation", mode="before")
    @classmethod
    def _trunc(cls, value: Any) -> int:
        return _truncation(value)

    @property
    def effective_max_input_len(self) -> int:
        """MindIE: ``min(maxInputTokenLen, maxSeqLen - 1)`` (at least one output token)."""
        return max(1, min(self.max_input_token_len, self.max_seq_len - 1))


class ScheduleConfig(Section):
    template_type: Literal["Standard", "Mix"] = F("templateType", "Standard")
    template_name: Literal["Standard_LLM"] = F("templateName", "Standard_LLM")
    cache_block_size: StrictInt = F("cacheBlockSize", 128, lo=1, hi=128, doc="tokens per KV block")
    max_prefill_batch_size: StrictInt = F("maxPrefillBatchSize", 50, lo=0, hi=819200,
                                          doc="0 = maxBatchSize")
    max_prefill_tokens: StrictInt = F("maxPrefillTokens", 8192, lo=1, hi=4194304)
    prefill_time_ms_per_req: StrictInt = F("prefillTimeMsPerReq", 150, lo=0, hi=1000)
    prefill_policy_type: StrictInt = F("prefillPolicyType", 0, lo=0, hi=3)
    decode_time_ms_per_req: StrictInt = F("decodeTimeMsPerReq", 50, lo=0, hi=1000)
    decode_policy_type: StrictInt = F("decodePolicyType", 0, lo=0, hi=3)
    max_batch_size: StrictInt = F("maxBatchSize", 200, lo=1, hi=819200)
    max_iter_times: StrictInt = F("maxIterTimes", 512, lo=1, hi=U32, doc="<= maxSeqLen")
    max_preempt_count: StrictInt = F("maxPreemptCount", 0, lo=0, hi=U32)
    support_select_batch: StrictBool = F("supportSelectBatch", False)
    max_queue_delay_microseconds: StrictInt = F("maxQueueDelayMicroseconds", 5000, lo=500, hi=1000000)
    max_first_token_wait_time: StrictInt = F("maxFirstTokenWaitTime", 2500, lo=0, hi=3600000)
    max_n: StrictInt = F("maxN", 128, lo=1, hi=8192)
    prefill_chunk_size: StrictInt | None = F("prefillChunkSize", None, lo=1, hi=4194304)
    max_num_partial_prefills: StrictInt = F("maxNumPartialPrefills", 64, lo=1, hi=64)
    long_prefill_token_threshold: StrictInt = F("longPrefillTokenThreshold", 1024, lo=1, hi=8192)
    max_long_partial_prefills: StrictInt = F("maxLongPartialPrefills", 8, lo=1, hi=64)
    enable_prefix_cache: StrictBool | None = F("enablePrefixCache", None, doc="deprecated")
    enable_split: StrictBool | None = F("enableSplit", None, doc="deprecated")
    split_type: Any = F("splitType", None)
    split_start_type: StrictBool | None = F("splitStartType", None)
    split_chunk_tokens: StrictInt = F("splitChunkTokens", 512, lo=0, hi=U32)
    split_start_batch_size: StrictInt = F("splitStartBatchSize", 16, lo=0, hi=U32)
    policy_type: StrictInt = F("policyType", 0, lo=0, hi=U32)
    stage_select_policy: StrictInt = F("stageSelectPolicy", 0, lo=0, hi=2)
    dynamic_batch_size_enable: StrictBool = F("dynamicBatchSizeEnable", False)
    prefill_expected_time: StrictInt = F("prefillExpectedTime", 1500, lo=1, hi=10000)
    decode_expected_time: StrictInt = F("decodeExpectedTime", 50, lo=1, hi=10000)
    buffer_response_enabled: StrictBool = F("bufferResponseEnabled", False)
    distributed_enable: StrictBool = F("distributedEnable", False)
    layerwise_disaggregated: Any = F("layerwiseDisaggregated", None)

    @property
    def effective_max_prefill_batch_size(self) -> int:
        """MindIE treats 0 as 'same as maxBatchSize'."""
        return self.max_prefill_batch_size or self.max_batch_size


class BackendConfig(Section):
    backend_name: StrictStr = F("backendName", "mindieservice_llm_engine")
    model_instance_number: StrictInt = F("modelInstanceNumber", 1, lo=1, hi=10)
    npu_device_ids: tuple[tuple[StrictInt, ...], ...] = F(
        "npuDeviceIds", ((0,),), doc="one inner list of worldSize CUDA device ids; MindIE's default is [[0, 1, 2, 3]]")
    tokenizer_process_number: StrictInt = F("tokenizerProcessNumber", 8, lo=1, hi=32)
    multi_nodes_infer_enabled: StrictBool = F("multiNodesInferEnabled", False)
    multi_nodes_infer_port: StrictInt = F("multiNodesInferPort", 1120, lo=1024, hi=65535)
    inter_node_tls_enabled: StrictBool = F("interNodeTLSEnabled", True)
    inter_node_tls_ca_path: StrictStr = F("interNodeTlsCaPath", "security/grpc/ca/")
    inter_node_tls_ca_files: tuple[StrictStr, ...] = F("interNodeTlsCaFiles", ("ca.pem",))
    inter_node_tls_cert: StrictStr = F("interNodeTlsCert", "security/grpc/certs/server.pem")
    inter_node_tls_pk: StrictStr = F("interNodeTlsPk", "security/grpc/keys/server.key.pem")
    inter_node_tls_pk_pwd: StrictStr | None = F("interNodeTlsPkPwd")
    inter_node_tls_crl_path: StrictStr = F("interNodeTlsCrlPath", "security/grpc/certs/")
    inter_node_tls_crl_files: tuple[StrictStr, ...] = F("interNodeTlsCrlFiles", ("server_crl.pem",))
    inter_node_kmc_ksf_master: StrictStr | None = F("interNodeKmcKsfMaster")
    inter_node_kmc_ksf_standby: StrictStr | None = F("interNodeKmcKsfStandby")
    kv_pool_config: KvPoolConfig = F("kvPoolConfig", KvPoolConfig())
    model_deploy: ModelDeployConfig = F("ModelDeployConfig", ModelDeployConfig())
    schedule: ScheduleConfig = F("ScheduleConfig", ScheduleConfig())

    @model_validator(mode="before")
    @classmethod
    def _clamp_dependent_defaults(cls, data: Any) -> Any:
        """Defaults that must respect another field are clamped to it when left out.

        MindIE's fixed defaults (maxPrefillBatchSize 50, maxN 128, maxIterTimes 512, ...)
        would make a config that only sets maxBatchSize 16 or maxSeqLen 256 invalid
        through keys the operator never wrote; an explicitly written value is still checked.
        """
        if not isinstance(data, dict):
            return data
        sched, deploy = data.get("ScheduleConfig", {}), data.get("ModelDeployConfig", {})
        if not isinstance(sched, dict) or not isinstance(deploy, dict):
            return data

        def num(section: dict, key: str, default: int) -> int | None:
            v = section.get(key, default)
            return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

        batch = num(sched, "maxBatchSize", 200)
        seq = num(deploy, "maxSeqLen", 2560)
        inp = num(deploy, "maxInputTokenLen", 2048)
        partial = num(sched, "maxNumPartialPrefills", 64)
        derived = {
            "maxPrefillBatchSize": batch and min(50, batch),
            "maxN": batch and min(128, batch),
            "maxIterTimes": seq and min(512, seq),
            "maxPrefillTokens": seq and inp and max(8192, min(inp, seq - 1)),
            "maxLongPartialPrefills": partial and min(8, partial),
        }
        missing = {k: v for k, v in derived.items() if k not in sched and v}
        if missing:
            data = {**data, "ScheduleConfig": {**sched, **missing}}
        return data

    @field_validator("model_instance_number")
    @classmethod
    def _instances(cls, value: int) -> int:
        if value > 1:
            raise PydanticCustomError(
                "single_instance", "{value} model instances are not implemented; this daemon "
                "runs one model instance on one device", {"value": value, "allowed": "1"})
        return value

    @field_validator("npu_device_ids")
    @classmethod
    def _one_device_group(cls, value: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        if len(value) != 1 or not value[0]:
            raise PydanticCustomError(
                "single_instance", "{groups} device groups: one model instance is served, so "
                "npuDeviceIds holds exactly one non-empty list (the devices of its worldSize "
                "ranks)", {"groups": len(value), "allowed": "one list, e.g. [[0]] or [[0, 1]]"})
        if len(set(value[0])) != len(value[0]) or min(value[0]) < 0:
            raise PydanticCustomError("device_ids", "device ids must be distinct and >= 0",
                                      {"allowed": "e.g. [[0, 1, 2, 3]]"})
        return value

    @field_validator("backend_name")
    @classmethod
    def _backend(cls, value: str) -> str:
        if not _BACKEND_NAME.fullmatch(value):
            raise PydanticCustomError("backend_name", "invalid backendName",
                                      {"allowed": "1-50 lower-case letters or '_'"})
        return value


class LogConfig(Section):
    dynamic_log_level: StrictStr = F("dynamicLogLevel", "")
    dynamic_log_level_valid_hours: StrictInt = F("dynamicLogLevelValidHours", 2, lo=1, hi=168)
    dynamic_log_level_valid_time: StrictStr = F("dynamicLogLevelValidTime", "")
    # MindIE <= 1.0.x keys; kept for old files.
    log_level: Literal["Verbose", "Info", "Warning", "Error", "None"] | None = F("logLevel")
    log_file_size: StrictInt | None = F("logFileSize", None, lo=0, hi=500)
    log_file_num: StrictInt | None = F("logFileNum", None, lo=0, hi=64)
    log_path: StrictStr | None = F("logPath")


class MindIEConfig(Section):
    """The whole file."""
    version: StrictStr = F("Version", "1.0.0")
    server: ServerConfig = F("ServerConfig", ServerConfig())
    backend: BackendConfig = F("BackendConfig", BackendConfig())
    log: LogConfig = F("LogConfig", LogConfig())
    enable_dynamic_adjust_timeout_config: StrictBool = F("EnableDynamicAdjustTimeoutConfig", False)


class ToolCallOptions(Section):
    tool_call_parser: StrictStr | None = F("tool_call_parser")


class KvCacheOptions(Section):
    enable_nz: StrictBool = F("enable_nz", False)
    # This daemon's switch for an int8 latent cache on a float checkpoint (MindIE turns
    # int8 KV on only through FA3 weights, which are honoured without it).
    kv_cache_dtype: Literal["auto", "int8"] = F("kv_cache_dtype", "auto")


class ModelTypeOptions(Section):
    """One ``ModelConfig[i].models.<model_type>`` object (e.g. ``models.deepseekv2``)."""
    enable_reasoning: StrictBool = F("enable_reasoning", False)
    tool_call_options: ToolCallOptions = F("tool_call_options", ToolCallOptions())
    chat_template: StrictStr | None = F("chat_template")
    early_stopping_text: StrictStr | None = F("early_stopping_text")
    kv_cache_options: KvCacheOptions = F("kv_cache_options", KvCacheOptions())
    ep_level: StrictInt | None = F("ep_level")
