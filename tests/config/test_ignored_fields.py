"""MindIE fields that have no effect here are never silent: one warning line per field.

A MindIE operator must see exactly which of their fields are ignored: each field below,
set away from its default, gives exactly one line ``<JSON path>: <value> is ignored:
<why>`` in ``cfg.warnings``, in the start-up log and on ``--check``'s stderr (and in
``--check``'s ``Derived.warnings``).  The same field written at its default says nothing,
so conf/config.json and MindIE's defaults load without noise.  Fields that would mislead
if ignored (parallel sizes, pools, per-plane TLS) are refused instead:
test_invalid_configs.py.
"""
from __future__ import annotations

import json
import logging
import sys
import types

import pytest

from server.__main__ import main
from server.config import parse_config
from tests.config.cfgkit import MC0, edited, minimal, run_cli, write_weights

SV, BC = "ServerConfig", "BackendConfig"
MD, SC = "BackendConfig.ModelDeployConfig", "BackendConfig.ScheduleConfig"
PP = f"{MC0}.plugin_params"
DS = f"{MC0}.models.deepseekv2"

# (JSON path, a value with no effect, the field's default); issue 18 item 3 lists most of them
IGNORED = [
    (f"{SV}.openAiSupport", "openai", "vllm"),
    (f"{SV}.HealthCheckConfig.npuUsageThreshold", 80, 0),
    (f"{SV}.interCommTLSEnabled", False, True),
    (f"{SV}.interCommPort", 2000, 1121),
    (f"{SV}.interCommTlsCert", "grpc.pem", "security/grpc/certs/server.pem"),
    (f"{SV}.interCommPkPwd", "pwd.txt", None),
    (f"{SV}.maxJsonDepth", 10, None),
    (f"{SV}.distDPServerEnabled", True, False),
    (f"{SV}.layerwiseDisaggregated", True, False),
    (f"{BC}.backendName", "other_engine", "mindieservice_llm_engine"),
    (f"{BC}.tokenizerProcessNumber", 4, 8),
    (f"{BC}.interNodeTLSEnabled", False, True),
    (f"{BC}.interNodeTlsCert", "node.pem", "security/grpc/certs/server.pem"),
    (f"{BC}.npuDeviceIds", [[3]], [[0]]),
    (f"{MD}.maxLoraRank", 8, None),
    (f"{MC0}.backendType", "atb", "torch"),
    (f"{MC0}.backendType", "ms", "torch"),
    (f"{MC0}.trustRemoteCode", True, False),
    (f"{MC0}.async_scheduler_wait_time", 60, 120),
    (f"{MC0}.kv_trans_timeout", 20, 10),
    (f"{MC0}.kv_link_timeout", 100, 1080),
    (f"{DS}.ep_level", 2, None),
    (f"{DS}.early_stopping_text", "</answer>", None),
    (f"{DS}.kv_cache_options.enable_nz", True, False),
    (f"{SC}.prefillPolicyType", 1, 0),
    (f"{SC}.decodePolicyType", 2, 0),
    (f"{SC}.maxFirstTokenWaitTime", 1000, 2500),
    (f"{SC}.prefillChunkSize", 512, None),
    (f"{SC}.maxNumPartialPrefills", 4, 64),    # maxLongPartialPrefills' default follows it
    (f"{SC}.longPrefillTokenThreshold", 2048, 1024),
    (f"{SC}.maxLongPartialPrefills", 4, 8),
    (f"{SC}.stageSelectPolicy", 1, 0),
    (f"{SC}.dynamicBatchSizeEnable", True, False),
    (f"{SC}.bufferResponseEnabled", True, False),
    (f"{SC}.distributedEnable", True, False),
    ("LogConfig.dynamicLogLevel", "debug", ""),
    ("LogConfig.dynamicLogLevelValidHours", 4, 2),
    ("LogConfig.logPath", "logs/mindie.log", None),
    ("EnableDynamicAdjustTimeoutConfig", True, False),
]
IDS = [f"{p.rsplit('.', 1)[-1]}={json.dumps(v)}" for p, v, _ in IGNORED]


def load(edits: dict, tmp_path, env: dict | None = None):
    write_weights(tmp_path / "tiny-model")
    return parse_config(edited(minimal(), edits), base_dir=tmp_path, env=env or {})


@pytest.mark.parametrize("path,value,default", IGNORED, ids=IDS)
def test_ignored_field_gives_one_warning_naming_it(path, value, default, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="server.config"):
        cfg = load({path: value}, tmp_path)
    assert len(cfg.warnings) == 1, cfg.warnings
    (line,) = cfg.warnings
    assert line.startswith(f"{path}: {json.dumps(value)} is ignored: "), line
    assert line in caplog.text                                         # logged at load
    assert cfg.to_dict()["Derived"]["warnings"] == [line]


@pytest.mark.parametrize("path,value,default", IGNORED, ids=IDS)
def test_ignored_field_at_its_default_is_quiet(path, value, default, tmp_path):
    assert load({path: default}, tmp_path).warnings == ()


def test_plane_tls_keys_warn_without_https(tmp_path):
    """With httpsEnabled true they take effect (server/api/tls.py); without TLS they do
    nothing, and say so."""
    cfg = load({f"{SV}.httpsEnabled": False, f"{SV}.managementTlsCert": "m.pem",
                f"{SV}.metricsTlsCaFile": ["ca2.pem"], f"{SV}.tlsCaFile": ["my_ca.pem"]},
               tmp_path)
    assert sorted(w.split(":")[0] for w in cfg.warnings) == [
        f"{SV}.managementTlsCert", f"{SV}.metricsTlsCaFile", f"{SV}.tlsCaFile"]
    assert all("httpsEnabled is false" in w for w in cfg.warnings)


def test_cpu_swap_space_is_not_ignored(tmp_path):
    # It sizes the host tier preempted requests swap to (test_kv_pool_config.py).
    assert load({f"{MC0}.cpuMemSize": 5}, tmp_path).warnings == ()
    assert load({f"{MC0}.cpuMemSize": 5, f"{SC}.maxPreemptCount": 2}, tmp_path).warnings == ()


@pytest.mark.parametrize("plugin", ["la", "memory_decoding", "splitfuse"])
def test_plugins_without_effect_warn(plugin, tmp_path):
    (line,) = load({PP: json.dumps({"plugin_type": plugin})}, tmp_path).warnings
    assert line.startswith(f"{PP}.plugin_type: '{plugin}' is ignored: "), line


def test_npu_memory_fraction_warns(tmp_path):
    (line,) = load({}, tmp_path, env={"NPU_MEMORY_FRACTION": "0.9"}).warnings
    assert line.startswith("$NPU_MEMORY_FRACTION: '0.9' is ignored: ") and "npuMemSize" in line


def test_async_scheduling_switch_is_not_reported(tmp_path):
    """MINDIE_ASYNC_SCHEDULING_ENABLE takes effect (docs/config.md): no warning for it."""
    cfg = load({}, tmp_path, env={"MINDIE_ASYNC_SCHEDULING_ENABLE": "1"})
    assert cfg.async_scheduling and cfg.warnings == ()


def test_check_prints_one_stderr_line_per_ignored_field(build):
    path = build({f"{MC0}.async_scheduler_wait_time": 60, f"{SC}.prefillPolicyType": 1,
                  "LogConfig.dynamicLogLevel": "debug"})
    proc = run_cli("--config-file", str(path), "--check")
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if " is ignored: " in line]
    assert len(warned) == 3, proc.stderr
    for key in (f"{MC0}.async_scheduler_wait_time: 60", f"{SC}.prefillPolicyType: 1",
                'LogConfig.dynamicLogLevel: "debug"'):
        assert sum(key in line for line in warned) == 1, key
    assert len(json.loads(proc.stdout)["Derived"]["warnings"]) == 3


def test_start_up_logs_each_ignored_field(build, monkeypatch, caplog):
    fake = types.ModuleType("server.daemon")
    fake.run_daemon = lambda cfg: 0
    monkeypatch.setitem(sys.modules, "server.daemon", fake)
    with caplog.at_level(logging.WARNING):
        assert main(["--config-file", str(build({f"{BC}.tokenizerProcessNumber": 2}))], env={}) == 0
    assert f"{BC}.tokenizerProcessNumber: 2 is ignored: " in caplog.text
