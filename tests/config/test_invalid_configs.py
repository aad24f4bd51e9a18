"""Every rule refuses a bad config, naming the JSON path, the value and what is allowed."""
from __future__ import annotations

import json

import pytest

from server.config import ConfigError, ConfigIssue, load_config, parse_config
from tests.config.cfgkit import DELETE, MC0, edited, fixture, minimal, write_weights

SV, MD, SC = "ServerConfig", "BackendConfig.ModelDeployConfig", "BackendConfig.ScheduleConfig"
PP = f"{MC0}.plugin_params"
NST = f"{PP}.num_speculative_tokens"
PTYPE = f"{PP}.plugin_type"
MTP1 = '{"plugin_type":"mtp","num_speculative_tokens":1}'

# (id, edits, expected issue path, text that must appear in message or allowed)
INVALID = [
    ("port-low", {f"{SV}.port": 80}, f"{SV}.port", "[1024, 65535]"),
    ("port-high", {f"{SV}.managementPort": 70000}, f"{SV}.managementPort", "[1024, 65535]"),
    ("port-string", {f"{SV}.port": "1025"}, f"{SV}.port", "integer"),
    ("management-port-clash", {f"{SV}.managementPort": 1025}, f"{SV}.managementPort", "business port"),
    ("metrics-port-clash", {f"{SV}.metricsPort": 1025}, f"{SV}.metricsPort", "business port"),
    ("all-zero-ip", {f"{SV}.ipAddress": "0.0.0.0"}, f"{SV}.ipAddress", "allowAllZeroIpListening"),
    ("all-zero-management-ip", {f"{SV}.managementIpAddress": "0.0.0.0"},
     f"{SV}.managementIpAddress", "allowAllZeroIpListening"),
    ("ip-not-an-address", {f"{SV}.ipAddress": "localhost"}, f"{SV}.ipAddress", "IPv4 or IPv6"),
    ("max-link-num", {f"{SV}.maxLinkNum": 4097}, f"{SV}.maxLinkNum", "[1, 4096]"),
    ("token-timeout", {f"{SV}.tokenTimeout": 0}, f"{SV}.tokenTimeout", "[1, 3600]"),
    ("e2e-timeout", {f"{SV}.e2eTimeout": 65536}, f"{SV}.e2eTimeout", "[1, 65535]"),
    ("max-request-length", {f"{SV}.maxRequestLength": 101}, f"{SV}.maxRequestLength", "[1, 100]"),
    ("infer-mode", {f"{SV}.inferMode": "pd"}, f"{SV}.inferMode", "'standard' or 'dmi'"),
    ("https-not-bool", {f"{SV}.httpsEnabled": "false"}, f"{SV}.httpsEnabled", "true or false"),
    ("max-seq-len-zero", {f"{MD}.maxSeqLen": 0}, f"{MD}.maxSeqLen", "[1, 4294967295]"),
    ("max-input-too-big", {f"{MD}.maxInputTokenLen": 4194305}, f"{MD}.maxInputTokenLen", "[1, 4194304]"),
    ("truncation-2", {f"{MD}.truncation": 2}, f"{MD}.truncation", "true/-1"),
    ("truncation-string", {f"{MD}.truncation": "left"}, f"{MD}.truncation", "false/0"),
    ("cache-block-size", {f"{SC}.cacheBlockSize": 256}, f"{SC}.cacheBlockSize", "[1, 128]"),
    ("prefill-batch-over-batch", {f"{SC}.maxPrefillBatchSize": 300}, f"{SC}.maxPrefillBatchSize",
     "maxBatchSize = 200"),
    ("prefill-tokens-under-input", {f"{SC}.maxPrefillTokens": 1024}, f"{SC}.maxPrefillTokens", ">= 2048"),
    ("iter-times-over-seq-len", {f"{SC}.maxIterTimes": 3000}, f"{SC}.maxIterTimes", "maxSeqLen = 2560"),
    ("preempt-over-batch", {f"{SC}.maxPreemptCount": 300, f"{MC0}.cpuMemSize": 5},
     f"{SC}.maxPreemptCount", "maxBatchSize = 200"),
    ("preempt-needs-cpu-mem", {f"{SC}.maxPreemptCount": 2, f"{MC0}.cpuMemSize": 0},
     f"{MC0}.cpuMemSize", "> 0"),
    ("template-name", {f"{SC}.templateName": "Standard_MM"}, f"{SC}.templateName", "Standard_LLM"),
    ("template-type", {f"{SC}.templateType": "Split"}, f"{SC}.templateType", "'Standard' or 'Mix'"),
    ("max-n-over-batch", {f"{SC}.maxN": 300}, f"{SC}.maxN", "maxBatchSize"),
    ("queue-delay", {f"{SC}.maxQueueDelayMicroseconds": 100}, f"{SC}.maxQueueDelayMicroseconds",
     "[500, 1000000]"),
    ("model-name-leading-dash", {f"{MC0}.modelName": "-tiny"}, f"{MC0}.modelName", "not starting"),
    ("model-name-space", {f"{MC0}.modelName": "tiny model"}, f"{MC0}.modelName", "[A-Za-z0-9._-]"),
    ("model-name-too-long", {f"{MC0}.modelName": "a" * 257}, f"{MC0}.modelName", "1-256"),
    ("model-name-missing", {f"{MC0}.modelName": DELETE}, f"{MC0}.modelName", "required"),
    ("weight-path-missing", {f"{MC0}.modelWeightPath": DELETE}, f"{MC0}.modelWeightPath", "required"),
    ("world-size-zero", {f"{MC0}.worldSize": 0}, f"{MC0}.worldSize", "[1, "),
    ("dp-zero", {f"{MC0}.dp": 0}, f"{MC0}.dp", "must not be 0"),
    # parallel layouts that do not fit together, and pipeline parallelism (not built), are
    # refused (an operator would be misled about where and how it runs); MindIE's dp, cp,
    # sp rules and what this build serves: test_parallel_layout.py
    ("world-size-four-one-device", {f"{MC0}.worldSize": 4}, "BackendConfig.npuDeviceIds",
     "one list of worldSize (4) device ids"),
    ("tp-two", {f"{MC0}.tp": 2}, f"{MC0}.tp", "tp * cp * dp == worldSize (1)"),
    ("dp-two-on-one-rank", {f"{MC0}.dp": 2}, f"{MC0}.dp", "tp * cp * dp == worldSize (1)"),
    ("sp-two-on-one-rank", {f"{MC0}.sp": 2}, f"{MC0}.sp", "must equal tp (1)"),
    ("moe-tp-two", {f"{MC0}.moe_tp": 2}, f"{MC0}.moe_tp", "moe_tp * moe_ep == worldSize (1)"),
    ("moe-ep-eight", {f"{MC0}.moe_ep": 8}, f"{MC0}.moe_ep", "moe_tp * moe_ep == worldSize (1)"),
    ("moe-ep-three-of-four", {f"{MC0}.worldSize": 4, f"{MC0}.moe_ep": 3,
                              "BackendConfig.npuDeviceIds": [[0, 1, 2, 3]]},
     f"{MC0}.moe_ep", "moe_tp * moe_ep == worldSize (4)"),
    ("pp-two", {f"{MC0}.pp": 2}, f"{MC0}.pp", "pipeline parallelism"),
    ("npu-device-ids-four-for-one-rank", {"BackendConfig.npuDeviceIds": [[0, 1, 2, 3]]},
     "BackendConfig.npuDeviceIds", "worldSize (1)"),
    ("npu-device-ids-two-groups", {"BackendConfig.npuDeviceIds": [[0], [1]]},
     "BackendConfig.npuDeviceIds", "exactly one"),
    ("npu-device-ids-repeated", {f"{MC0}.worldSize": 2, "BackendConfig.npuDeviceIds": [[1, 1]]},
     "BackendConfig.npuDeviceIds", "distinct"),
    ("model-instances-two", {"BackendConfig.modelInstanceNumber": 2},
     "BackendConfig.modelInstanceNumber", "one model instance"),
    ("multi-node-without-saying-tls-is-off", {"BackendConfig.multiNodesInferEnabled": True},
     "BackendConfig.interNodeTLSEnabled", "not encrypted"),
    ("kv-pool-backend", {"BackendConfig.kvPoolConfig": {"backend": "mooncake", "configPath": ""}},
     "BackendConfig.kvPoolConfig.backend", "KV cache pooling"),
    ("kv-pool-config-path", {"BackendConfig.kvPoolConfig.configPath": "/etc/pool.json"},
     "BackendConfig.kvPoolConfig.configPath", "without a KV pool backend"),
    ("cp-three", {f"{MC0}.cp": 3}, f"{MC0}.cp", "[1, 2]"),
    ("npu-mem-zero", {f"{MC0}.npuMemSize": 0}, f"{MC0}.npuMemSize", "-1 (auto)"),
    ("model-config-empty", {f"{MD}.ModelConfig": []}, f"{MD}.ModelConfig", "exactly one"),
    ("model-config-two", {f"{MD}.ModelConfig": [{"modelName": "a", "modelWeightPath": "tiny-model"},
                                                {"modelName": "b", "modelWeightPath": "tiny-model"}]},
     f"{MD}.ModelConfig", "exactly one"),
    ("section-not-object", {SV: [1, 2]}, SV, "object"),
    ("model-entry-not-object", {f"{MD}.ModelConfig": ["tiny"]}, MC0, "object"),
    # plugin_params
    ("plugin-unknown-type", {PP: '{"plugin_type":"eagle"}'}, PTYPE,
     "la, memory_decoding, prefix_cache, mtp, splitfuse"),
    ("plugin-unknown-among-known", {PP: '{"plugin_type":"mtp,medusa","num_speculative_tokens":1}'},
     PTYPE, "'medusa'"),
    ("mtp-missing-drafts", {PP: '{"plugin_type":"mtp"}'}, NST, "Missing fields"),
    ("mtp-six-drafts", {PP: '{"plugin_type":"mtp","num_speculative_tokens":6}'}, NST, "[0, 5]"),
    ("mtp-negative-drafts", {PP: '{"plugin_type":"mtp","num_speculative_tokens":-1}'}, NST, "[0, 5]"),
    ("mtp-drafts-string", {PP: '{"plugin_type":"mtp","num_speculative_tokens":"1"}'}, NST, "integer"),
    ("mtp-adaptive-not-bool",
     {PP: '{"plugin_type":"mtp","num_speculative_tokens":1,"adaptive_speculation":"no"}'},
     f"{PP}.adaptive_speculation", "boolean"),
    ("mtp-drafts-float", {PP: {"plugin_type": "mtp", "num_speculative_tokens": 1.5}}, NST, "integer"),
    ("plugin-params-too-long", {PP: json.dumps({"plugin_type": "prefix_cache", "pad": "x" * 1100})},
     PP, "at most 1024"),
    ("plugin-params-object-too-long", {PP: {"plugin_type": "prefix_cache", "pad": "x" * 1100}},
     PP, "at most 1024"),
    ("plugin-params-bad-json", {PP: '{"plugin_type": mtp}'}, PP, "JSON format"),
    ("plugin-params-number", {PP: 5}, PP, "JSON object"),
    ("mtp-with-lookahead", {PP: '{"plugin_type":"mtp,la","num_speculative_tokens":1}'}, PTYPE,
     "parallel decoding (la)"),
    ("mtp-with-memory-decoding", {PP: '{"plugin_type":"mtp,memory_decoding","num_speculative_tokens":1}'},
     PTYPE, "parallel decoding (memory_decoding)"),
    ("mtp-with-splitfuse-plugin", {PP: '{"plugin_type":"mtp,splitfuse","num_speculative_tokens":1}'},
     PTYPE, "SplitFuse"),
    ("mtp-with-mix-template", {PP: MTP1, f"{SC}.templateType": "Mix"}, f"{SC}.templateType", "SplitFuse"),
    ("mtp-with-lora-modules", {PP: MTP1, f"{MD}.LoraModules": [{"name": "a", "path": "/a",
                                                                "baseModelName": "tiny"}]},
     f"{MD}.LoraModules", "Multi-LoRA"),
    ("mtp-with-max-loras", {PP: MTP1, f"{MD}.maxLoras": 2}, f"{MD}.maxLoras", "Multi-LoRA"),
    ("prefix-cache-with-lora", {PP: '{"plugin_type":"prefix_cache"}', f"{MD}.maxLoras": 1},
     f"{MD}.maxLoras", "Multi-LoRA"),
    # DeepSeek per-model options
    ("tool-call-parser-unknown", {f"{MC0}.models": {"deepseekv2": {"tool_call_options":
                                                                   {"tool_call_parser": "qwen3"}}}},
     f"{MC0}.models.deepseekv2.tool_call_options.tool_call_parser", "deepseek_v31"),
    ("enable-reasoning-not-bool", {f"{MC0}.models": {"deepseekv2": {"enable_reasoning": "yes"}}},
     f"{MC0}.models.deepseekv2.enable_reasoning", "true or false"),
    ("deepseek-options-not-object", {f"{MC0}.models": {"deepseekv2": 1}}, f"{MC0}.models.deepseekv2",
     "object"),
    ("chat-template-missing", {f"{MC0}.models": {"deepseekv2": {"chat_template": "t.jinja"}}},
     f"{MC0}.models.deepseekv2.chat_template", "not found"),
    ("kv-cache-dtype-unknown", {f"{MC0}.models": {"deepseekv2": {"kv_cache_options":
                                                                 {"kv_cache_dtype": "fp8"}}}},
     f"{MC0}.models.deepseekv2.kv_cache_options.kv_cache_dtype", "int8"),
]


def issues_of(doc: dict, tmp_path, env: dict | None = None) -> list[ConfigIssue]:
    write_weights(tmp_path / "tiny-model")
    with pytest.raises(ConfigError) as info:
        parse_config(doc, base_dir=tmp_path, env=env or {})
    err = info.value
    assert isinstance(err, ValueError) and err.issues and err.errors is err.issues
    return err.issues


@pytest.mark.parametrize("case_id,edits,path,text", INVALID, ids=[c[0] for c in INVALID])
def test_rule_refuses_with_path(case_id, edits, path, text, tmp_path):
    issues = issues_of(edited(minimal(), edits), tmp_path)
    hits = [i for i in issues if i.path == path]
    assert hits, f"no issue at {path}: {[str(i) for i in issues]}"
    assert any(text in i.message or text in i.allowed for i in hits), [str(i) for i in hits]
    assert len(issues) == 1, [str(i) for i in issues]      # one mistake, one report


@pytest.mark.parametrize("name,layout", [
    ("mindie_shipped.json", (4, 4, 4, 1, (0, 1, 2, 3))),
    ("deepseek_mtp_prefix.json", (8, 8, 8, 1, tuple(range(8)))),
])
def test_multi_device_files_load_with_their_layout(name, layout, tmp_path):
    """MindIE's own 4- and 8-device examples load verbatim: worldSize ranks, tp = worldSize,
    the MoE layers split moe_tp = worldSize ways, one device id per rank."""
    write_weights(tmp_path / "tiny-model")
    lay = parse_config(fixture(name), base_dir=tmp_path, env={}).parallel
    assert (lay.world_size, lay.tp, lay.moe_tp, lay.moe_ep, lay.device_ids) == layout


def test_plane_tls_keys_are_accepted_with_https(tmp_path):
    """MindIE's shipped file writes the management/metrics TLS keys; they are served
    (server/api/tls.py; the files are checked when the daemon starts, before any port)."""
    write_weights(tmp_path / "tiny-model")
    doc = edited(minimal(), {f"{SV}.managementTlsCert": "security/certs/management/server.pem",
                             f"{SV}.metricsTlsCaFile": ["metrics_ca.pem"],
                             f"{SV}.managementTlsPkPwd": "pwd.txt"})
    cfg = parse_config(doc, base_dir=tmp_path, check_files=True)
    assert cfg.server.https_enabled and cfg.warnings == ()


def test_mtp_exclusion_names_both_features(tmp_path):
    issues = issues_of(edited(minimal(), {PP: MTP1, f"{SC}.templateType": "Mix",
                                          f"{MD}.maxLoras": 4}), tmp_path)
    assert {i.path for i in issues} == {f"{SC}.templateType", f"{MD}.maxLoras"}
    for issue in issues:
        assert "MTP" in issue.message
        assert "SplitFuse" in issue.message or "LoRA" in issue.message


@pytest.mark.parametrize("content,text", [
    (None, "folder does not exist"),
    ("file", "not a folder"),
    ({}, "missing file"),
    ({"config.json": "{not json"}, "cannot read"),
    ({"config.json": json.dumps({"model_type": "llama"})}, "'llama'"),
    ({"config.json": json.dumps({"vocab_size": 3})}, "None"),
])
def test_weight_folder_rule(content, text, tmp_path):
    target = tmp_path / "w"
    if content == "file":
        target.write_text("x")
    elif isinstance(content, dict):
        target.mkdir()
        for name, body in content.items():
            (target / name).write_text(body)
    doc = edited(minimal(), {f"{MC0}.modelWeightPath": "w"})
    with pytest.raises(ConfigError) as info:
        parse_config(doc, base_dir=tmp_path)
    (issue,) = info.value.issues
    assert issue.path == f"{MC0}.modelWeightPath"
    assert text in issue.message
    if content == {}:
        assert str(target / "config.json") in issue.message      # names the missing file


def test_many_violations_reported_at_once(tmp_path):
    doc = edited(minimal(), {
        f"{SV}.port": 80,
        f"{SV}.metricsPort": 1026,                                   # equal to management: fine
        f"{SV}.ipAddress": "0.0.0.0",
        f"{SV}.maxLinkNum": 0,
        f"{MD}.truncation": 7,
        f"{MC0}.modelName": "_x",
        f"{MC0}.modelWeightPath": "missing-dir",
        PP: '{"plugin_type":"mtp,la","num_speculative_tokens":9}',
        f"{SC}.cacheBlockSize": 0,
        f"{SC}.maxPrefillBatchSize": 500,
        f"{SC}.templateType": "Mix",
        f"{SC}.templateName": "x",
    })
    issues = issues_of(doc, tmp_path)
    paths = [i.path for i in issues]
    assert set(paths) == {
        f"{SV}.port", f"{SV}.ipAddress", f"{SV}.maxLinkNum", f"{MD}.truncation", f"{MC0}.modelName",
        f"{MC0}.modelWeightPath", NST, PTYPE, f"{SC}.cacheBlockSize", f"{SC}.maxPrefillBatchSize",
        f"{SC}.templateType", f"{SC}.templateName"}, paths
    # templateType is reported both as 'Mix with MTP' and nothing else; one report per cause
    assert len(paths) == 12
    for issue in issues:
        assert str(issue).startswith(issue.path + ": ")
        assert "allowed:" in str(issue) and "got" in str(issue)


def test_broken_field_does_not_cause_spurious_rule_reports(tmp_path):
    """port 80 is replaced by its default while checking the other rules; the default (1025)
    must not then be reported as clashing with managementPort 1025."""
    issues = issues_of(edited(minimal(), {f"{SV}.port": 80, f"{SV}.managementPort": 1025}), tmp_path)
    assert [i.path for i in issues] == [f"{SV}.port"]


def test_error_str_lists_every_issue(tmp_path):
    write_weights(tmp_path / "tiny-model")
    with pytest.raises(ConfigError) as info:
        parse_config(edited(minimal(), {f"{SV}.port": 1, f"{SC}.cacheBlockSize": 999}), base_dir=tmp_path)
    text = str(info.value)
    assert text.startswith("2 config violation(s)")
    assert "ServerConfig.port" in text and "BackendConfig.ScheduleConfig.cacheBlockSize" in text
    assert "[1, 128]" in text and "999" in text


@pytest.mark.parametrize("body,path", [
    ("{not json", "<file>"),
    ("[1, 2]", "<root>"),
    ("", "<file>"),
])
def test_unreadable_file(body, path, tmp_path):
    file = tmp_path / "config.json"
    file.write_text(body)
    with pytest.raises(ConfigError) as info:
        load_config(file, env={})
    assert info.value.issues[0].path == path


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.json", env={})
    assert "cannot read" in info.value.issues[0].message


MULTI_NODE = {f"{MC0}.worldSize": 4, "BackendConfig.multiNodesInferEnabled": True,
              "BackendConfig.interNodeTLSEnabled": False}


@pytest.mark.parametrize("env,path,text", [
    ({"NNODES": "3"}, "$NNODES", "a divisor of worldSize (4)"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "$NODE_RANK", "0 .. NNODES - 1 (1)"),
    ({"NNODES": "two"}, "$NNODES", "non-negative integer"),
    ({"NNODES": "2", "MASTER_PORT": "80"}, "$MASTER_PORT", "1024..65535"),
])
def test_multi_node_environment_is_checked(env, path, text, tmp_path):
    issues = issues_of(edited(minimal(), MULTI_NODE), tmp_path, env)
    assert [i.path for i in issues] == [path], [str(i) for i in issues]
    assert text in issues[0].allowed or text in issues[0].message


def test_multi_node_layout_from_the_environment(tmp_path):
    """npuDeviceIds is ignored for multi-node (as in MindIE); the master port defaults to
    multiNodesInferPort."""
    write_weights(tmp_path / "tiny-model")
    doc = edited(minimal(), {**MULTI_NODE, "BackendConfig.multiNodesInferPort": 2345})
    lay = parse_config(doc, base_dir=tmp_path,
                       env={"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.5"}).parallel
    assert (lay.world_size, lay.nnodes, lay.node_rank, lay.master_addr, lay.master_port) == \
        (4, 2, 1, "10.0.0.5", 2345)
