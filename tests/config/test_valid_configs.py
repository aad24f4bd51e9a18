"""Configs MindIE accepts load, with MindIE's defaults and the derived values components read."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pydantic
import pytest

from server.config import AppConfig, MtpSettings, load_config, parse_config
from tests.config.cfgkit import DATA, MC0, edited, fixture, minimal, write_weights

SV, MD, SC = "ServerConfig", "BackendConfig.ModelDeployConfig", "BackendConfig.ScheduleConfig"
PP = f"{MC0}.plugin_params"
ONE_DEVICE = {f"{MC0}.worldSize": 1, "BackendConfig.npuDeviceIds": [[0]]}
REPO = Path(__file__).resolve().parents[2]

# (id, base, edits, {attribute path on AppConfig: expected value})
VALID = [
    ("minimal-defaults", minimal(), {}, {
        "server.port": 1025, "server.management_port": 1026, "server.metrics_port": 1027,
        "server.ip_address": "127.0.0.1", "management_ip": "127.0.0.1", "server.https_enabled": True,
        "server.max_link_num": 1000, "max_seq_len": 2560, "max_input_len": 2048, "truncation": 0,
        "schedule.cache_block_size": 128, "schedule.max_batch_size": 200,
        "max_prefill_batch_size": 50, "schedule.max_iter_times": 512, "mtp": None,
        "prefix_cache_enabled": False, "reasoning_enabled": False, "tool_call_parser": "deepseek_v3",
        "model_name": "tiny", "model_config.world_size": 1, "model_config.npu_mem_size": -1,
        "backend.npu_device_ids": ((0,),), "model_config.backend_type": "torch", "max_n": 128,
        "async_scheduling": False, "metrics_enabled": True, "warnings": ()}),
    # MindIE's multi-device examples, cut down to one device (verbatim, they load as rank
    # groups: test_invalid_configs.py::test_multi_device_files_load_with_their_layout)
    ("mindie-shipped-example", fixture("mindie_shipped.json"), ONE_DEVICE, {
        "model_name": "llama_65b", "server.https_enabled": True, "management_ip": "127.0.0.2",
        "server.health_check.npu_usage_threshold": 0, "schedule.max_queue_delay_microseconds": 5000,
        "schedule.max_first_token_wait_time": 2500, "model_config.models":
        {"layerwiseDisaggregatedMasterDeviceNum": 2, "layerwiseDisaggregatedSlaveDeviceNum": 8},
        "backend.npu_device_ids": ((0,),), "mtp": None, "warnings": (
            f"{SV}.layerwiseDisaggregatedMasterIpAddress: \"127.0.0.3\" is ignored: "
            "layer-wise disaggregation is not implemented",
            f"{SV}.layerwiseDisaggregatedSlaveIpAddress: [\"127.0.0.4\"] is ignored: "
            "layer-wise disaggregation is not implemented",
            f"{SV}.layerwiseDisaggregatedDataPort: 10024 is ignored: "
            "layer-wise disaggregation is not implemented",
            f"{SV}.layerwiseDisaggregatedCrtlPort: [10001, 10002] is ignored: "
            "layer-wise disaggregation is not implemented",
            f"{MC0}.backendType: \"atb\" is ignored: the model runs on PyTorch (backendType torch)")}),
    ("deepseek-mtp-prefix-cache", fixture("deepseek_mtp_prefix.json"), {**ONE_DEVICE, f"{MC0}.tp": 1}, {
        "mtp": MtpSettings(1), "prefix_cache_enabled": True, "reasoning_enabled": True,
        "tool_call_parser": "deepseek_v3", "model_options.kv_cache_options.enable_nz": True,
        "model_options_key": "deepseekv2", "max_input_len": 6144, "truncation": 0,
        "server.metrics_port": 1026, "max_n": 64, "warnings": (
            f"{MC0}.backendType: \"atb\" is ignored: the model runs on PyTorch (backendType torch)",
            f"{MC0}.models.deepseekv2.kv_cache_options.enable_nz: true is ignored: "
            "the KV cache has one layout (NZ is Ascend's)")}),
    ("plugin-params-object", minimal(), {PP: {"plugin_type": "mtp", "num_speculative_tokens": 2}},
     {"mtp": MtpSettings(2), "num_speculative_tokens": 2}),
    ("mtp-adaptive-off", minimal(),
     {PP: '{"plugin_type":"mtp","num_speculative_tokens":2,"adaptive_speculation":false}'},
     {"mtp": MtpSettings(2, adaptive_speculation=False)}),
    ("plugin-params-string", minimal(), {PP: '{"plugin_type":"mtp","num_speculative_tokens":2}'},
     {"mtp": MtpSettings(2), "plugins.plugin_type": ("mtp",)}),
    ("plugin-type-spaces", minimal(), {PP: '{"plugin_type":"mtp, prefix_cache","num_speculative_tokens":1}'},
     {"plugins.plugin_type": ("mtp", "prefix_cache"), "prefix_cache_enabled": True}),
    ("prefix-cache-only", minimal(), {PP: '{"plugin_type":"prefix_cache"}'},
     {"mtp": None, "prefix_cache_enabled": True}),
    ("mtp-zero-drafts-means-unused", minimal(), {PP: '{"plugin_type":"mtp","num_speculative_tokens":0}'},
     {"mtp": None, "num_speculative_tokens": 0}),
    ("mtp-five-drafts", minimal(), {PP: '{"plugin_type":"mtp","num_speculative_tokens":5}'},
     {"mtp": MtpSettings(5)}),
    ("empty-plugin-params", minimal(), {PP: ""}, {"plugins.plugin_type": ()}),
    ("null-plugin-params", minimal(), {PP: None}, {"plugins.plugin_type": (), "mtp": None}),
    ("truncation-true-is-right", minimal(), {f"{MD}.truncation": True}, {"truncation": -1}),
    ("truncation-false-is-reject", minimal(), {f"{MD}.truncation": False}, {"truncation": 0}),
    ("truncation-left", minimal(), {f"{MD}.truncation": 1}, {"truncation": 1}),
    ("input-len-capped-by-seq-len", minimal(),
     {f"{MD}.maxSeqLen": 1024, f"{MD}.maxInputTokenLen": 4096, f"{SC}.maxIterTimes": 100},
     {"max_input_len": 1023, "schedule.max_prefill_tokens": 8192}),
    ("metrics-port-may-equal-management", minimal(), {f"{SV}.metricsPort": 1026},
     {"server.metrics_port": 1026}),
    ("all-zero-ip-allowed", minimal(), {f"{SV}.ipAddress": "0.0.0.0", f"{SV}.allowAllZeroIpListening": True},
     {"server.ip_address": "0.0.0.0", "management_ip": "0.0.0.0"}),
    ("ipv6", minimal(), {f"{SV}.ipAddress": "::1"}, {"server.ip_address": "::1"}),
    ("parallel-sizes-of-one", minimal(),
     {f"{MC0}.worldSize": 1, f"{MC0}.tp": 1, f"{MC0}.dp": 1, f"{MC0}.cp": 1, f"{MC0}.sp": 1,
      f"{MC0}.moe_tp": 1, f"{MC0}.moe_ep": 1, f"{MC0}.pp": 1, "BackendConfig.npuDeviceIds": [[0]],
      "BackendConfig.modelInstanceNumber": 1, "BackendConfig.multiNodesInferEnabled": False,
      "BackendConfig.kvPoolConfig": {"backend": "", "configPath": ""},
      PP: '{"plugin_type":"mtp","num_speculative_tokens":2}'},
     {"model_config.tp": 1, "mtp": MtpSettings(2), "warnings": ()}),
    ("max-n-honoured", minimal(), {f"{SC}.maxN": 4}, {"max_n": 4, "warnings": ()}),
    ("preemption-with-swap", minimal(), {f"{SC}.maxPreemptCount": 4, f"{MC0}.cpuMemSize": 2},
     {"schedule.max_preempt_count": 4}),
    ("small-batch-clamps-defaults", minimal(), {f"{SC}.maxBatchSize": 16},
     {"max_prefill_batch_size": 16, "schedule.max_n": 16, "max_n": 16}),
    ("small-seq-len-clamps-iter-times", minimal(), {f"{MD}.maxSeqLen": 256},
     {"schedule.max_iter_times": 256, "max_input_len": 255}),
    ("prefill-batch-zero-means-max-batch", minimal(),
     {f"{SC}.maxPrefillBatchSize": 0, f"{SC}.maxBatchSize": 32}, {"max_prefill_batch_size": 32}),
    ("old-log-config", minimal(),
     {"LogConfig": {"logLevel": "Info", "logFileSize": 20, "logFileNum": 20, "logPath": "logs/x.log"},
      "Version": "1.1.0"}, {"log.log_level": "Info", "document.version": "1.1.0"}),
    ("deepseek-v3-key-and-v31-parser", minimal(),
     {f"{MC0}.models": {"deepseek_v3": {"enable_reasoning": True,
                                        "tool_call_options": {"tool_call_parser": "deepseekv31"}}}},
     {"reasoning_enabled": True, "tool_call_parser": "deepseek_v31", "model_options_key": "deepseek_v3"}),
    ("absolute-weight-path", minimal(), {}, {}),   # path made absolute in the test below
    ("int8-kv-cache", minimal(),
     {f"{MC0}.models": {"deepseekv2": {"kv_cache_options": {"kv_cache_dtype": "int8"}}}},
     {"kv_cache_dtype": "int8"}),
]


def attr(obj: object, dotted: str) -> object:
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


@pytest.mark.parametrize("case_id,base,edits,expect", VALID, ids=[c[0] for c in VALID])
def test_valid_config_loads(case_id, base, edits, expect, build, weights):
    doc = edited(base, edits)
    if case_id == "absolute-weight-path":
        set_abs = doc["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
        set_abs["modelWeightPath"] = str(weights)
    cfg = load_config(build(base=doc), env={})
    assert isinstance(cfg, AppConfig)
    assert cfg.model_weight_path == weights.resolve()
    assert cfg.checkpoint_model_type == "deepseek_v3"
    for key, value in expect.items():
        assert attr(cfg, key) == value, key
    json.dumps(cfg.to_dict())          # the effective config is always JSON-serialisable


def test_relative_weight_path_resolves_against_config_folder(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    write_weights(tmp_path / "models" / "m")
    doc = edited(minimal(), {f"{MC0}.modelWeightPath": "../models/m"})
    (tmp_path / "conf" / "config.json").write_text(json.dumps(doc))
    monkeypatch.chdir(tmp_path / "models")       # the cwd must not matter
    cfg = load_config(tmp_path / "conf" / "config.json", env={})
    assert cfg.model_weight_path == (tmp_path / "models" / "m").resolve()
    assert cfg.source == (tmp_path / "conf" / "config.json").resolve()


def test_plugin_params_string_and_object_are_equivalent(tmp_path):
    write_weights(tmp_path / "tiny-model")
    as_text = '{"plugin_type":"mtp,prefix_cache","num_speculative_tokens":2}'
    a = parse_config(edited(minimal(), {PP: as_text}), base_dir=tmp_path)
    b = parse_config(edited(minimal(), {PP: json.loads(as_text)}), base_dir=tmp_path)
    assert a.plugins == b.plugins
    assert a.to_dict()["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"] == \
        {"plugin_type": "mtp,prefix_cache", "num_speculative_tokens": 2}


def test_config_is_immutable(tmp_path):
    write_weights(tmp_path / "tiny-model")
    cfg = parse_config(minimal(), base_dir=tmp_path)
    with pytest.raises(pydantic.ValidationError):
        cfg.server.port = 2000
    with pytest.raises(pydantic.ValidationError):
        cfg.plugins.num_speculative_tokens = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.metrics_enabled = False
    assert isinstance(cfg.model_deploy.model_configs, tuple)


def test_unknown_keys_are_kept_and_warned(tmp_path, caplog):
    write_weights(tmp_path / "tiny-model")
    doc = edited(minimal(), {"Extra": {"a": 1}, f"{SV}.futureKnob": 3, f"{MC0}.someBackendKey": "x",
                             PP: {"plugin_type": "prefix_cache", "future": 1},
                             f"{MC0}.models": {"deepseekv2": {"enable_reasoning": True, "ep_level": 2,
                                                              "newOpt": 1}},
                             f"{SC}.enablePrefixCache": True})
    with caplog.at_level(logging.WARNING, logger="server.config"):
        cfg = parse_config(doc, base_dir=tmp_path)
    text = "\n".join(cfg.warnings)
    for path in ("Extra", "ServerConfig.futureKnob", f"{MC0}.someBackendKey", f"{PP}.future",
                 f"{MC0}.models.deepseekv2.newOpt", f"{SC}.enablePrefixCache"):
        assert path in text
        assert path in caplog.text
    assert cfg.document.model_extra["Extra"] == {"a": 1}            # kept
    assert cfg.server.model_extra["futureKnob"] == 3
    assert cfg.reasoning_enabled is True


def test_pd_mode_loads_and_inter_comm_keys_warn_only_outside_it(tmp_path):
    write_weights(tmp_path / "tiny-model")
    pd = {f"{SV}.interCommPort": 1300, f"{SV}.pdRole": "decode", f"{SV}.pdPeers": ["127.0.0.1"]}
    cfg = parse_config(edited(minimal(), {f"{SV}.inferMode": "dmi", **pd}), base_dir=tmp_path)
    assert not cfg.warnings
    cfg = parse_config(edited(minimal(), pd), base_dir=tmp_path)
    assert {w.split(":")[0] for w in cfg.warnings} == {f"{SV}.interCommPort", f"{SV}.pdRole",
                                                       f"{SV}.pdPeers"}


def test_check_files_false_skips_only_filesystem(tmp_path):
    doc = edited(minimal(), {f"{MC0}.modelWeightPath": "nowhere"})
    cfg = parse_config(doc, base_dir=tmp_path, check_files=False)
    assert cfg.model_weight_path == (tmp_path / "nowhere").resolve()
    assert cfg.checkpoint_model_type is None


def test_shipped_fixture_differs_from_mindie_only_in_weight_path():
    text = (DATA / "mindie_shipped.json").read_text()
    assert '"modelWeightPath" : "tiny-model"' in text
    assert json.loads(text)["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] == 200


def test_repo_default_config(tmp_path):
    """conf/config.json: MTP with one draft, plain HTTP on 127.0.0.1:1025/1026/1027."""
    (tmp_path / "conf").mkdir()
    shutil.copy(REPO / "conf" / "config.json", tmp_path / "conf" / "config.json")
    write_weights(tmp_path / "models" / "deepseek-v3-tiny-mtp")
    cfg = load_config(tmp_path / "conf" / "config.json", env={})
    assert cfg.mtp == MtpSettings(1)
    assert (cfg.server.port, cfg.server.management_port, cfg.server.metrics_port) == (1025, 1026, 1027)
    assert cfg.server.ip_address == cfg.management_ip == "127.0.0.1"
    assert cfg.server.https_enabled is False
    assert cfg.model_name == "deepseek-v3-tiny-mtp"
    assert cfg.model_weight_path == (tmp_path / "models" / "deepseek-v3-tiny-mtp").resolve()
    assert cfg.reasoning_enabled and cfg.tool_call_parser == "deepseek_v3"
    assert 2048 <= cfg.max_seq_len <= 4096 and cfg.schedule.max_batch_size == 64
    assert cfg.warnings == ()
