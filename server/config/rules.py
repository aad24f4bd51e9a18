"""Rules that read more than one field: MTP exclusions, port clashes, per-plane TLS, budget orderings.

Each rule returns ConfigIssues whose ``path`` is the field to change and whose ``related``
lists the other fields it read, so the loader can drop a rule's verdict when one of
those fields was itself invalid (and replaced by its default for this pass).
"""
from __future__ import annotations

import ipaddress
import json
from typing import Iterator

from pydantic import ValidationError

from server.config.errors import ConfigIssue, issues_from_validation
from server.config.mindie.sections import (MODEL_NAME_RULE, MindIEConfig, ModelConfig,
                                           ModelTypeOptions, ServerConfig, is_all_interfaces)
from server.config.pd_link import KeyFileError, parse_peer, read_key_file

SV = "ServerConfig"
MD = "BackendConfig.ModelDeployConfig"
SC = "BackendConfig.ScheduleConfig"
ASYNC_ENV = "$MINDIE_ASYNC_SCHEDULING_ENABLE"

# ModelConfig[i].models keys that configure a DeepSeek checkpoint, most specific first.
# MindIE's docs use "deepseekv2" for DeepSeek-V3/R1 (whose weights say model_type deepseek_v3).
DEEPSEEK_OPTION_KEYS: tuple[str, ...] = ("deepseekv2", "deepseekv3", "deepseek_v3", "deepseek_v2")
# MindIE's registered DeepSeek tool-call parser names -> the parser we run.
TOOL_CALL_PARSERS: dict[str, str] = {
    "deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v3",
    "deepseekv3": "deepseek_v3", "deepseekv2": "deepseek_v3",
    "deepseek_v31": "deepseek_v31", "deepseekv31": "deepseek_v31",
}
DEFAULT_TOOL_CALL_PARSER = "deepseek_v3"
_PARSER_RULE = "deepseek_v3 (or deepseek_v2, deepseekv2, deepseekv3) or deepseek_v31 (or deepseekv31)"


def mc_path(i: int) -> str:
    return f"{MD}.ModelConfig[{i}]"


def check_rules(doc: MindIEConfig, *, async_scheduling: bool = False) -> list[ConfigIssue]:
    """Every cross-field rule, in file order."""
    issues = list(_server_rules(doc))
    issues += _deploy_rules(doc)
    for i, mc in enumerate(doc.backend.model_deploy.model_configs):
        issues += _model_rules(doc, i, mc, async_scheduling)
        issues += model_options(mc, i)[2]
    issues += _schedule_rules(doc)
    issues += _kv_pool_rules(doc)
    return issues


def _kv_pool_rules(doc: MindIEConfig) -> Iterator[ConfigIssue]:
    """kvPoolConfig: the pool is the prefix cache's second level (MindIE: it requires the
    prefix_cache plugin); its other keys mean nothing without a backend."""
    pool, kp = doc.backend.kv_pool_config, "BackendConfig.kvPoolConfig"
    if not pool.backend:
        for key, value in (("configPath", pool.config_path), ("asyncWrite", pool.async_write)):
            if value:
                yield ConfigIssue(f"{kp}.{key}", value, f"unset while {kp}.backend is \"\"",
                                  "a KV pool setting without a KV pool backend",
                                  related=(f"{kp}.backend",))
        return
    for i, mc in enumerate(doc.backend.model_deploy.model_configs):
        if not mc.plugin_params.prefix_cache:
            yield ConfigIssue(f"{kp}.backend", pool.backend,
                              f"\"\" unless {mc_path(i)}.plugin_params.plugin_type has prefix_cache",
                              "the KV pool is the prefix cache's second level: enable the "
                              "prefix_cache plugin", related=(f"{mc_path(i)}.plugin_params",))


def _server_rules(doc: MindIEConfig) -> Iterator[ConfigIssue]:
    s = doc.server
    if s.infer_mode == "dmi":
        yield from _pd_rules(s)
    for key, port in (("managementPort", s.management_port), ("metricsPort", s.metrics_port)):
        if port == s.port:
            yield ConfigIssue(f"{SV}.{key}", port, f"a port other than port ({s.port})",
                              f"{key} must differ from the business port",
                              related=(f"{SV}.port",))
    if not s.allow_all_zero_ip_listening:
        for key, ip in (("ipAddress", s.ip_address), ("managementIpAddress", s.management_ip_address)):
            if ip is not None and is_all_interfaces(ip):
                yield ConfigIssue(f"{SV}.{key}", ip, "a specific address, or allowAllZeroIpListening: true",
                                  "listening on all interfaces needs allowAllZeroIpListening: true",
                                  related=(f"{SV}.allowAllZeroIpListening",))


def _pd_rules(s: ServerConfig) -> Iterator[ConfigIssue]:
    """inferMode dmi: the KV port must be free of the planes' ports; peers are addresses."""
    for key, port in (("port", s.port), ("managementPort", s.management_port),
                      ("metricsPort", s.metrics_port)):
        if s.inter_comm_port == port:
            yield ConfigIssue(f"{SV}.interCommPort", port, f"a port other than {key}",
                              "the KV transfer port must differ from the HTTP planes' ports",
                              related=(f"{SV}.{key}",))
    for i, peer in enumerate(s.pd_peers):
        try:
            parse_peer(peer)
        except ValueError as exc:
            yield ConfigIssue(f"{SV}.pdPeers[{i}]", peer, "an IPv4 or IPv6 address, optionally "
                              "with its KV port (ip:port, [ipv6]:port)", str(exc))
    if s.pd_transfer_key_file is not None:
        try:
            read_key_file(s.pd_transfer_key_file)
        except KeyFileError as exc:
            yield ConfigIssue(f"{SV}.pdTransferKeyFile", s.pd_transfer_key_file,
                              "a readable file of 64 hex digits", str(exc))
    if s.pd_role == "decode" and not s.pd_peers:
        yield ConfigIssue(f"{SV}.pdPeers", [], "the prefill instances' addresses",
                          "a decode instance pulls KV only from its peers",
                          related=(f"{SV}.pdRole",))


# TLS keys that take effect only with httpsEnabled (server/api/tls.py serves each plane
# with its own); ignored.py warns about them when httpsEnabled is false.
PLANE_TLS_KEYS: tuple[str, ...] = ("tlsCaPath", "tlsCaFile", "tlsCrlPath", "tlsCrlFiles") + tuple(
    f"{plane}{key}" for plane in ("management", "metrics")
    for key in ("TlsCaFile", "TlsCert", "TlsPk", "TlsPkPwd", "TlsCrlPath", "TlsCrlFiles"))


def _deploy_rules(doc: MindIEConfig) -> Iterator[ConfigIssue]:
    n = len(doc.backend.model_deploy.model_configs)
    if n != 1:
        yield ConfigIssue(f"{MD}.ModelConfig", f"{n} entries", "exactly one ModelConfig entry",
                          "the Standard template serves exactly one model")


def _model_rules(doc: MindIEConfig, i: int, mc: ModelConfig, async_on: bool) -> Iterator[ConfigIssue]:
    p = mc_path(i)
    if mc.model_name is None:
        yield ConfigIssue(f"{p}.modelName", None, MODEL_NAME_RULE, "modelName is required")
    if not mc.model_weight_path:
        yield ConfigIssue(f"{p}.modelWeightPath", mc.model_weight_path,
                          "a folder with the checkpoint's config.json", "modelWeightPath is required")

    plugins = mc.plugin_params
    ptype = f"{p}.plugin_params.plugin_type"
    nst = f"{p}.plugin_params.num_speculative_tokens"
    deploy = doc.backend.model_deploy
    lora = []
    if deploy.lora_modules:
        lora.append((f"{MD}.LoraModules", f"{len(deploy.lora_modules)} module(s)"))
    if deploy.max_loras:
        lora.append((f"{MD}.maxLoras", deploy.max_loras))

    if plugins.has("mtp"):
        if plugins.num_speculative_tokens is None:
            yield ConfigIssue(nst, None, "an integer in [0, 5]",
                              "Missing fields for plugin_type 'mtp': num_speculative_tokens",
                              related=(ptype,))
        for other in plugins.parallel_decoding:
            yield ConfigIssue(ptype, ",".join(plugins.plugin_type), "mtp without la/memory_decoding",
                              f"MTP cannot be combined with parallel decoding ({other})")
        if plugins.splitfuse:
            yield ConfigIssue(ptype, ",".join(plugins.plugin_type), "mtp without splitfuse",
                              "MTP cannot be combined with SplitFuse (splitfuse plugin)")
        if doc.backend.schedule.template_type == "Mix":
            yield ConfigIssue(f"{SC}.templateType", "Mix", "Standard while MTP is on",
                              "MTP cannot be combined with SplitFuse (templateType Mix)",
                              related=(ptype,))
        for path, value in lora:
            yield ConfigIssue(path, value, "no LoRA while MTP is on",
                              "MTP cannot be combined with Multi-LoRA", related=(ptype,))
    if plugins.prefix_cache:
        for path, value in lora:
            yield ConfigIssue(path, value, "no LoRA while prefix_cache is on",
                              "prefix cache cannot be combined with Multi-LoRA", related=(ptype,))
    if async_on:
        for other in plugins.parallel_decoding:
            yield ConfigIssue(ptype, ",".join(plugins.plugin_type), "no la/memory_decoding with async scheduling",
                              f"MINDIE_ASYNC_SCHEDULING_ENABLE does not support the plugin_type {other}",
                              related=(ASYNC_ENV,))


def _schedule_rules(doc: MindIEConfig) -> Iterator[ConfigIssue]:
    s, d = doc.backend.schedule, doc.backend.model_deploy
    if s.max_prefill_batch_size > s.max_batch_size:
        yield ConfigIssue(f"{SC}.maxPrefillBatchSize", s.max_prefill_batch_size,
                          f"[0, maxBatchSize = {s.max_batch_size}]",
                          "maxPrefillBatchSize must not exceed maxBatchSize",
                          related=(f"{SC}.maxBatchSize",))
    if s.max_prefill_tokens < d.effective_max_input_len:
        yield ConfigIssue(f"{SC}.maxPrefillTokens", s.max_prefill_tokens,
                          f">= {d.effective_max_input_len} (min(maxInputTokenLen, maxSeqLen - 1))",
                          "maxPrefillTokens must hold the longest allowed input",
                          related=(f"{MD}.maxInputTokenLen", f"{MD}.maxSeqLen"))
    if s.max_iter_times > d.max_seq_len:
        yield ConfigIssue(f"{SC}.maxIterTimes", s.max_iter_times, f"[1, maxSeqLen = {d.max_seq_len}]",
                          "maxIterTimes must not exceed maxSeqLen", related=(f"{MD}.maxSeqLen",))
    if s.max_preempt_count > s.max_batch_size:
        yield ConfigIssue(f"{SC}.maxPreemptCount", s.max_preempt_count,
                          f"[0, maxBatchSize = {s.max_batch_size}]",
                          "maxPreemptCount must not exceed maxBatchSize", related=(f"{SC}.maxBatchSize",))
    if s.max_preempt_count > 0:
        for i, mc in enumerate(d.model_configs):
            if mc.cpu_mem_size <= 0:
                yield ConfigIssue(f"{mc_path(i)}.cpuMemSize", mc.cpu_mem_size,
                                  "> 0 when maxPreemptCount > 0",
                                  "preemption (maxPreemptCount > 0) needs host memory to swap "
                                  "preempted requests to, as in MindIE",
                                  related=(f"{SC}.maxPreemptCount",))
    if s.max_n > s.max_batch_size:
        yield ConfigIssue(f"{SC}.maxN", s.max_n, f"[1, maxBatchSize = {s.max_batch_size}]",
                          "maxN must not exceed maxBatchSize", related=(f"{SC}.maxBatchSize",))
    if s.prefill_chunk_size is not None and s.prefill_chunk_size > s.max_prefill_tokens:
        yield ConfigIssue(f"{SC}.prefillChunkSize", s.prefill_chunk_size,
                          f"[1, maxPrefillTokens = {s.max_prefill_tokens}]",
                          "prefillChunkSize must not exceed maxPrefillTokens",
                          related=(f"{SC}.maxPrefillTokens",))
    if s.max_long_partial_prefills > s.max_num_partial_prefills:
        yield ConfigIssue(f"{SC}.maxLongPartialPrefills", s.max_long_partial_prefills,
                          f"[1, maxNumPartialPrefills = {s.max_num_partial_prefills}]",
                          "maxLongPartialPrefills must not exceed maxNumPartialPrefills",
                          related=(f"{SC}.maxNumPartialPrefills",))


def model_options(mc: ModelConfig, i: int) -> tuple[str | None, ModelTypeOptions, list[ConfigIssue]]:
    """The DeepSeek section of ``mc.models`` (key, typed options, issues).

    The first of DEEPSEEK_OPTION_KEYS present wins; absent -> defaults (no reasoning
    parser, default tool-call parser).
    """
    key = next((k for k in DEEPSEEK_OPTION_KEYS if k in mc.models), None)
    if key is None:
        return None, ModelTypeOptions(), []
    path = f"{mc_path(i)}.models.{key}"
    value = mc.models[key]
    if not isinstance(value, dict):
        return key, ModelTypeOptions(), [ConfigIssue(path, value, "an object", "must be an object")]
    try:
        opts = ModelTypeOptions.model_validate_json(json.dumps(value))
    except ValidationError as err:
        prefix = (*path.split(".")[:2], "ModelConfig", i, "models", key)
        return key, ModelTypeOptions(), issues_from_validation(err, ModelTypeOptions, prefix)
    parser = opts.tool_call_options.tool_call_parser
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        return key, ModelTypeOptions(), [ConfigIssue(
            f"{path}.tool_call_options.tool_call_parser", parser, _PARSER_RULE,
            "tool-call parser not available for DeepSeek checkpoints")]
    return key, opts, []
