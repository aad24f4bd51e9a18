"""Environment overrides (MindIE names) and the ``python -m server`` command line."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from server.__main__ import main, serve
from server.config import ConfigError, default_config_path, load_config, parse_config
from tests.config.cfgkit import MC0, edited, minimal, run_cli, write_weights

PP = f"{MC0}.plugin_params"

# (id, env, {attribute: expected})
ENV_CASES = [
    ("no-env", {}, {"async_scheduling": False, "metrics_enabled": True}),
    ("container-ip", {"MIES_CONTAINER_IP": "10.0.0.5"},
     {"server.ip_address": "10.0.0.5", "management_ip": "10.0.0.5"}),
    ("container-management-ip", {"MIES_CONTAINER_MANAGEMENT_IP": "10.0.0.6"},
     {"server.ip_address": "127.0.0.1", "management_ip": "10.0.0.6"}),
    ("async-on", {"MINDIE_ASYNC_SCHEDULING_ENABLE": "1"}, {"async_scheduling": True}),
    ("async-other-is-off", {"MINDIE_ASYNC_SCHEDULING_ENABLE": "2"}, {"async_scheduling": False}),
    ("monitor-off", {"MIES_SERVICE_MONITOR_MODE": "0"}, {"metrics_enabled": False}),
    ("monitor-on", {"MIES_SERVICE_MONITOR_MODE": "1"}, {"metrics_enabled": True}),
    ("empty-ip-ignored", {"MIES_CONTAINER_IP": ""}, {"server.ip_address": "127.0.0.1"}),
    ("compile-defaults", {}, {"compile_mode": "auto", "compile_wait": False, "engine_process": True,
                              "draft_after_emit": True, "fatal_exit_delay_s": 5.0,
                              "step_timeout_s": 300.0, "prediction_draft_tokens": 64}),
    ("step-timeout", {"MTP_SERVE_STEP_TIMEOUT": "2.5"}, {"step_timeout_s": 2.5}),
    ("prediction-tokens", {"MTP_SERVE_PREDICTION_TOKENS": "8"}, {"prediction_draft_tokens": 8}),
    ("prediction-tokens-off", {"MTP_SERVE_PREDICTION_TOKENS": "0"}, {"prediction_draft_tokens": 0}),
    ("prediction-tokens-max", {"MTP_SERVE_PREDICTION_TOKENS": " 64 "},
     {"prediction_draft_tokens": 64}),
    ("prediction-tokens-empty", {"MTP_SERVE_PREDICTION_TOKENS": ""}, {"prediction_draft_tokens": 64}),
    ("fatal-exit-delay", {"MTP_SERVE_FATAL_EXIT_DELAY": "1.5"}, {"fatal_exit_delay_s": 1.5}),
    ("draft-inside-the-step", {"MTP_SERVE_DRAFT_AFTER_EMIT": "0"}, {"draft_after_emit": False}),
    ("engine-on-a-thread", {"MTP_SERVE_ENGINE_PROCESS": "off"}, {"engine_process": False}),
    ("engine-process", {"MTP_SERVE_ENGINE_PROCESS": "1"}, {"engine_process": True}),
    ("compile-wait", {"MTP_SERVE_COMPILE": "1", "MTP_SERVE_COMPILE_WAIT": "yes"},
     {"compile_mode": "on", "compile_wait": True}),
]


def attr(obj, dotted):
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


@pytest.mark.parametrize("case_id,env,expect", ENV_CASES, ids=[c[0] for c in ENV_CASES])
def test_env_override(case_id, env, expect, tmp_path):
    write_weights(tmp_path / "tiny-model")
    cfg = parse_config(minimal(), base_dir=tmp_path, env=env)
    for key, value in expect.items():
        assert attr(cfg, key) == value, key
    assert cfg.to_dict()["Derived"]["metricsEnabled"] == cfg.metrics_enabled


def test_env_ip_is_validated_and_blamed(tmp_path):
    write_weights(tmp_path / "tiny-model")
    with pytest.raises(ConfigError) as info:
        parse_config(minimal(), base_dir=tmp_path, env={"MIES_CONTAINER_IP": "0.0.0.0"})
    (issue,) = info.value.issues
    assert issue.path == "ServerConfig.ipAddress" and "$MIES_CONTAINER_IP" in issue.message


def test_async_scheduling_refuses_parallel_decoding(tmp_path):
    write_weights(tmp_path / "tiny-model")
    doc = edited(minimal(), {PP: '{"plugin_type":"la"}'})
    parse_config(doc, base_dir=tmp_path, env={})                      # fine without async
    with pytest.raises(ConfigError) as info:
        parse_config(doc, base_dir=tmp_path, env={"MINDIE_ASYNC_SCHEDULING_ENABLE": "1"})
    (issue,) = info.value.issues
    assert issue.path == f"{PP}.plugin_type" and "MINDIE_ASYNC_SCHEDULING_ENABLE" in issue.message


def test_bad_monitor_mode(tmp_path):
    write_weights(tmp_path / "tiny-model")
    with pytest.raises(ConfigError) as info:
        parse_config(minimal(), base_dir=tmp_path, env={"MIES_SERVICE_MONITOR_MODE": "maybe"})
    assert info.value.issues[0].path == "$MIES_SERVICE_MONITOR_MODE"


@pytest.mark.parametrize("name", ["MTP_SERVE_COMPILE", "MTP_SERVE_COMPILE_WAIT", "MTP_SERVE_ENGINE_PROCESS",
                                  "MTP_SERVE_DRAFT_AFTER_EMIT", "MTP_SERVE_FATAL_EXIT_DELAY",
                                  "MTP_SERVE_STEP_TIMEOUT", "MTP_SERVE_WEIGHT_ARENA"])
def test_bad_compile_switch_is_blamed(name, tmp_path):
    write_weights(tmp_path / "tiny-model")
    with pytest.raises(ConfigError) as info:
        parse_config(minimal(), base_dir=tmp_path, env={name: "sometimes"})
    assert info.value.issues[0].path == f"${name}"


@pytest.mark.parametrize("value", ["65", "-1", "abc", "1.5", "8 tokens", "²", "1e3"])
def test_bad_prediction_tokens_is_blamed(value, tmp_path):
    write_weights(tmp_path / "tiny-model")
    with pytest.raises(ConfigError) as info:
        parse_config(minimal(), base_dir=tmp_path, env={"MTP_SERVE_PREDICTION_TOKENS": value})
    (issue,) = info.value.issues
    assert issue.path == "$MTP_SERVE_PREDICTION_TOKENS" and issue.value == value
    assert "0 to 64" in issue.allowed


def test_prediction_tokens_reach_the_engine_config(tmp_path):
    from server.engine.config import EngineConfig, engine_config_from_app
    write_weights(tmp_path / "tiny-model")
    cfg = parse_config(minimal(), base_dir=tmp_path, env={"MTP_SERVE_PREDICTION_TOKENS": "5"})
    assert engine_config_from_app(cfg).prediction_draft_tokens == 5
    assert cfg.to_dict()["Derived"]["predictionDraftTokens"] == 5
    default = parse_config(minimal(), base_dir=tmp_path, env={})
    assert engine_config_from_app(default).prediction_draft_tokens == \
        EngineConfig().prediction_draft_tokens == 64


def test_config_path_from_env(tmp_path):
    assert default_config_path({}) == Path("conf/config.json")
    assert default_config_path({"MIES_CONFIG_JSON_PATH": "/x/c.json"}) == Path("/x/c.json")
    write_weights(tmp_path / "tiny-model")
    (tmp_path / "c.json").write_text(json.dumps(minimal()))
    cfg = load_config(None, env={"MIES_CONFIG_JSON_PATH": str(tmp_path / "c.json")})
    assert cfg.model_name == "tiny"


# ---- CLI ---------------------------------------------------------------------------------

def test_check_valid_prints_effective_json(build):
    path = build({PP: '{"plugin_type":"mtp,prefix_cache","num_speculative_tokens":1}'})
    proc = run_cli("--config-file", str(path), "--check")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    model = out["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    assert model["plugin_params"] == {"plugin_type": "mtp,prefix_cache", "num_speculative_tokens": 1}
    assert model["modelWeightPath"] == str(path.parent / "tiny-model")
    assert out["ServerConfig"]["port"] == 1025                       # defaults resolved
    assert out["BackendConfig"]["ScheduleConfig"]["cacheBlockSize"] == 128
    assert out["Derived"]["mtp"] == {"num_speculative_tokens": 1, "adaptive_speculation": True}
    assert out["Derived"]["effectiveMaxInputTokenLen"] == 2048


def test_check_invalid_lists_every_violation(build):
    path = build({"ServerConfig.port": 80, "BackendConfig.ScheduleConfig.cacheBlockSize": 512,
                  PP: '{"plugin_type":"mtp"}'})
    proc = run_cli("--config-file", str(path), "--check")
    assert proc.returncode == 2
    assert proc.stdout == ""
    for text in ("ServerConfig.port", "[1024, 65535]", "BackendConfig.ScheduleConfig.cacheBlockSize",
                 f"{PP}.num_speculative_tokens", "3 config violation(s)"):
        assert text in proc.stderr


def test_check_uses_env_config_path(build, tmp_path):
    path = build()
    proc = run_cli("--check", env={"MIES_CONFIG_JSON_PATH": str(path)}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["Derived"]["sourceFile"] == str(path.resolve())


def test_unknown_argument_exits_2_with_usage():
    proc = run_cli("--expert-parallel", "1")
    assert proc.returncode == 2
    assert "usage:" in proc.stderr and "--config-file" in proc.stderr


def test_missing_config_file_exits_2(tmp_path):
    proc = run_cli("--config-file", str(tmp_path / "none.json"), "--check")
    assert proc.returncode == 2 and "cannot read config file" in proc.stderr


def test_a_daemon_that_cannot_import_is_an_error_not_a_notice(build, monkeypatch):
    """The daemon always ships: failing to import it is a broken install, shown as the
    import error, not a start-up notice that the engine is "not available yet"."""
    monkeypatch.setitem(sys.modules, "server.daemon", None)          # import fails as if absent
    with pytest.raises(ImportError):
        main(["--config-file", str(build())], env={})


def test_start_hands_config_to_daemon(build, monkeypatch):
    seen = []
    fake = types.ModuleType("server.daemon")
    fake.run_daemon = lambda cfg: seen.append(cfg) or 0
    monkeypatch.setitem(sys.modules, "server.daemon", fake)
    assert main(["--config-file", str(build())], env={}) == 0
    assert seen and seen[0].model_name == "tiny"


def test_start_with_bad_config_exits_2(build, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "server.daemon", None)
    assert main(["--config-file", str(build({"ServerConfig.port": 1}))], env={}) == 2
    assert "ServerConfig.port" in capsys.readouterr().err


def test_serve_surfaces_real_import_errors(build, monkeypatch):
    """A daemon module that exists but fails to import must not be mistaken for 'absent'."""
    cfg = load_config(build(), env={})
    broken = ModuleNotFoundError("No module named 'uvicorn_x'", name="uvicorn_x")
    monkeypatch.setattr("builtins.__import__", _importer_raising(broken))
    with pytest.raises(ModuleNotFoundError):
        serve(cfg)


def _importer_raising(exc):
    real = __import__

    def fake(name, *args, **kwargs):
        if name == "server.daemon":
            raise exc
        return real(name, *args, **kwargs)
    return fake


@pytest.mark.parametrize("variable, bad, allowed, setting", [
    ("MTP_SERVE_DRAFT_HEAD", "fp4", "auto, model, int8", "draft_head"),
    ("MTP_SERVE_DRAFT_LAYER", "int4", "auto, model, int8", "draft_layer"),
    ("MTP_SERVE_GREEDY_HEAD", "int8", "auto, model", None),
])
def test_a_bad_kernel_setting_is_refused_naming_the_variable(variable, bad, allowed, setting):
    """The draft head, the draft layer and the greedy head's settings
    (server/config/kernel_env.py): a value outside their list is refused before anything
    loads, naming the variable and the values it takes; unset is "auto"."""
    from server.config import kernel_env
    found = kernel_env.problems({variable: bad})
    assert [p.variable for p in found] == [variable]
    assert allowed in str(found[0])
    if setting is not None:
        assert getattr(kernel_env.parse({}), setting) == "auto"
