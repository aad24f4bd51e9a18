"""MindIE fields this daemon keeps but does not act on: one warning line per field set.

A MindIE operator's file must load here (same keys, same ranges), but a value that does
nothing must not pass silently: each field below that the file sets to something other
than its default gives one line, ``<JSON path>: <value> is ignored: <why>``, logged at
start-up and by ``--check`` and kept in ``AppConfig.warnings``.  A field left at its
default says nothing (the operator asked for nothing).  Fields whose being ignored would
mislead (parallel sizes not built, unavailable KV pool backends) are refused instead, by
the validators in mindie/sections.py and the rules in rules.py; fields that take effect are in
neither place.  When a field starts to take effect, its entry here goes.
"""
from __future__ import annotations

import json
from typing import Any, Iterator, Mapping

from pydantic import BaseModel

from server.config.mindie.sections import MindIEConfig
from server.config.rules import PLANE_TLS_KEYS, mc_path, model_options

SV = "ServerConfig"
BC = "BackendConfig"
MD = "BackendConfig.ModelDeployConfig"
SC = "BackendConfig.ScheduleConfig"

_NO_PD = "it is used only with inferMode \"dmi\" (PD disaggregation)"
_NO_INTER_NODE_TLS = "inter-node TLS is not implemented (ranks talk torch.distributed over TCP)"
_SCHEDULER = "the scheduler does not read it (docs/config.md lists the keys it does)"
_NO_CHUNKED = "chunked prefill is not implemented (a prompt is prefilled in one step)"
_LOGS = "logs go to stderr at the level of --log-level"

SERVER: dict[str, str] = {
    "openAiSupport": "the OpenAI endpoints always follow vLLM's dialect",
    "maxJsonDepth": "request bodies are not depth-limited beyond maxRequestLength",
    "distDPServerEnabled": "there is no data-parallel server",
    "kmcKsfMaster": "tlsPkPwd is read as plain text (no KMC)",
    "kmcKsfStandby": "tlsPkPwd is read as plain text (no KMC)",
    **{k: "layer-wise disaggregation is not implemented" for k in (
        "layerwiseDisaggregated", "layerwiseDisaggregatedRoleType",
        "layerwiseDisaggregatedMasterIpAddress", "layerwiseDisaggregatedSlaveIpAddress",
        "layerwiseDisaggregatedDataPort", "layerwiseDisaggregatedCrtlPort")},
}
INTER_COMM: dict[str, str] = {k: _NO_PD for k in (
    "interCommTLSEnabled", "interCommPort", "interCommTlsCaPath", "interCommTlsCaFiles",
    "interCommTlsCert", "interCommPk", "interCommPkPwd", "interCommTlsCrlPath",
    "interCommTlsCrlFiles", "pdRole", "pdPeers")}
HEALTH_CHECK: dict[str, str] = {
    "npuUsageThreshold": "/health reports the engine's state, not device usage",
}
BACKEND: dict[str, str] = {
    "backendName": "there is one built-in engine",
    "tokenizerProcessNumber": "tokenizing runs in the daemon's own process",
    **{k: _NO_INTER_NODE_TLS for k in (
        "interNodeTLSEnabled", "interNodeTlsCaPath", "interNodeTlsCaFiles", "interNodeTlsCert",
        "interNodeTlsPk", "interNodeTlsPkPwd", "interNodeTlsCrlPath", "interNodeTlsCrlFiles",
        "interNodeKmcKsfMaster", "interNodeKmcKsfStandby")},
}
DEPLOY: dict[str, str] = {
    "maxLoras": "LoRA adapters are not served", "maxLoraRank": "LoRA adapters are not served",
    "LoraModules": "LoRA adapters are not served",
}
MODEL: dict[str, str] = {
    "backendType": "the model runs on PyTorch (backendType torch)",
    "trustRemoteCode": "no checkpoint code is run; the DeepSeek model is built in",
    "async_scheduler_wait_time": "the asynchronous scheduler has no wait timeout",
}
SCHEDULE: dict[str, str] = {
    "prefillPolicyType": "requests are scheduled first come, first served",
    "decodePolicyType": "requests are scheduled first come, first served",
    "maxFirstTokenWaitTime": _SCHEDULER,
    "prefillChunkSize": _NO_CHUNKED, "maxNumPartialPrefills": _NO_CHUNKED,
    "longPrefillTokenThreshold": _NO_CHUNKED, "maxLongPartialPrefills": _NO_CHUNKED,
    "stageSelectPolicy": _SCHEDULER, "dynamicBatchSizeEnable": _SCHEDULER,
    "prefillExpectedTime": _SCHEDULER, "decodeExpectedTime": _SCHEDULER,
    "bufferResponseEnabled": "responses are sent as tokens are produced",
    "distributedEnable": _SCHEDULER, "layerwiseDisaggregated": _SCHEDULER,
    "splitType": _SCHEDULER, "splitStartType": _SCHEDULER, "splitChunkTokens": _SCHEDULER,
    "splitStartBatchSize": _SCHEDULER, "policyType": _SCHEDULER,
}
LOG: dict[str, str] = {
    "dynamicLogLevel": _LOGS, "dynamicLogLevelValidHours": _LOGS,
    "dynamicLogLevelValidTime": _LOGS, "logLevel": _LOGS, "logFileSize": _LOGS,
    "logFileNum": _LOGS, "logPath": _LOGS,
}
TOP: dict[str, str] = {
    "EnableDynamicAdjustTimeoutConfig": "tokenTimeout and e2eTimeout are fixed at start-up",
}
MODEL_OPTIONS: dict[str, str] = {
    "early_stopping_text": "generation stops only on stop strings, stop ids and EOS",
    "ep_level": "experts are partitioned by moe_ep and combined with one all-reduce",
}
ENV: dict[str, str] = {
    "NPU_MEMORY_FRACTION": "the KV cache pool is sized by npuMemSize "
                           "(-1: from the device's free memory)",
}
_PLUGINS = {"la": "lookahead decoding is not implemented",
            "memory_decoding": "memory decoding is not implemented",
            "splitfuse": "SplitFuse is not implemented (a prompt is prefilled in one step)"}


def ignored_warnings(doc: MindIEConfig, env: Mapping[str, str] | None = None) -> list[str]:
    """One line per field (or variable) set to a value that has no effect, in file order."""
    s, b = doc.server, doc.backend
    out = list(_set_fields(doc, "", TOP))
    out += _set_fields(s, SV, SERVER)
    if not s.https_enabled:       # with httpsEnabled true they take effect (api/tls.py)
        out += _set_fields(s, SV, {k: "httpsEnabled is false" for k in PLANE_TLS_KEYS})
    out += _set_fields(s.health_check, f"{SV}.HealthCheckConfig", HEALTH_CHECK)
    if s.infer_mode != "dmi":
        out += _set_fields(s, SV, INTER_COMM)
    out += _set_fields(b, BC, BACKEND)
    if b.npu_device_ids != ((0,),) and sum(map(len, b.npu_device_ids)) == 1:
        out.append(f"{BC}.npuDeviceIds: {_show(b.npu_device_ids)} is ignored: the daemon runs on "
                   "the first visible GPU, else the CPU (choose the GPU with CUDA_VISIBLE_DEVICES)")
    out += _set_fields(b.model_deploy, MD, DEPLOY)
    sched = b.schedule
    for i, mc in enumerate(b.model_deploy.model_configs):
        out += _set_fields(mc, mc_path(i), MODEL)
        if s.infer_mode != "dmi":
            out += _set_fields(mc, mc_path(i), {"kv_trans_timeout": _NO_PD, "kv_link_timeout": _NO_PD})
        for plugin in mc.plugin_params.plugin_type:
            if plugin in _PLUGINS:
                out.append(f"{mc_path(i)}.plugin_params.plugin_type: {plugin!r} is ignored: "
                           f"{_PLUGINS[plugin]}")
        key, opts, _ = model_options(mc, i)
        if key is not None:
            where = f"{mc_path(i)}.models.{key}"
            out += _set_fields(opts, where, MODEL_OPTIONS)
            out += _set_fields(opts.kv_cache_options, f"{where}.kv_cache_options",
                               {"enable_nz": "the KV cache has one layout (NZ is Ascend's)"})
    out += _set_fields(sched, SC, SCHEDULE, defaults={
        # a default clamped by sections.BackendConfig when the key is left out
        "maxLongPartialPrefills": min(8, sched.max_num_partial_prefills)})
    out += _set_fields(doc.log, "LogConfig", LOG)
    for var, why in ENV.items():
        if (env or {}).get(var):
            out.append(f"${var}: {env[var]!r} is ignored: {why}")
    return out


def _set_fields(node: BaseModel, where: str, table: Mapping[str, str],
                defaults: Mapping[str, Any] | None = None) -> Iterator[str]:
    """``where.<key>: <value> is ignored: <why>`` for each key of ``table`` off its default."""
    by_alias = {(info.alias or name): (name, info) for name, info in type(node).model_fields.items()}
    for alias, why in table.items():
        name, info = by_alias[alias]
        value = getattr(node, name)
        default = (defaults or {}).get(alias, info.default)
        if value != default:
            path = f"{where}.{alias}" if where else alias
            yield f"{path}: {_show(value)} is ignored: {why}"


def _show(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", by_alias=True, exclude_none=True)
    elif isinstance(value, tuple) and value and isinstance(value[0], BaseModel):
        value = [v.model_dump(mode="json", by_alias=True, exclude_none=True) for v in value]
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
