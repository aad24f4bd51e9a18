"""MindIE-style ``config.json``: typed, validated once, immutable.

    from server.config import load_config, ConfigError
    cfg = load_config("conf/config.json", env=os.environ)
    cfg.mtp, cfg.model_weight_path, cfg.schedule.max_batch_size, cfg.max_input_len ...

See docs/config.md for every field, default, range and rule.  No torch anywhere here: the
config sits below server/model and server/engine, which read it.

    loader.py           reading config.json: env overrides, validation, every rule, warnings
    app.py              AppConfig: the validated file plus what is derived from it at load
    errors.py           ConfigIssue (one broken rule, at its key path) and ConfigError
    rules.py            rules that read more than one field (MTP, ports, TLS, budgets)
    parallel.py         MindIE's layout keys: their issues, NodeLayout, what is not served
    parallel_layout.py  ParallelLayout: a layout's sizes and rules, which the model's shard
                        plan and the engine's executor ask too
    kv_pool.py          kvPoolConfig and the file its configPath names (the disk tier)
    pd_link.py          the PD link's values: peers with their KV ports, key files
    kernel_env.py       the CPU kernels' environment variables, checked here
    ignored.py          MindIE fields kept but not acted on: one warning each
    mindie/             the file's sections as frozen pydantic models
    checkpoint/         what the check reads of a checkpoint (its architecture, a KV
                        block's bytes, the weights' fingerprint)
"""
from server.config.app import AppConfig
from server.config.errors import ConfigError, ConfigIssue
from server.config.loader import (DEFAULT_CONFIG_PATH, SERVED_MODEL_TYPES, check_weight_dir,
                                  default_config_path, load_config, parse_config)
from server.config.mindie.plugins import (MAX_PLUGIN_PARAMS_CHARS, SUPPORTED_PLUGIN_TYPES,
                                          MtpSettings, PluginParams)
from server.config.mindie.sections import (BackendConfig, HealthCheckConfig, KvPoolConfig,
                                           LogConfig, LoraModule, MindIEConfig, ModelConfig,
                                           ModelDeployConfig, ModelTypeOptions, ScheduleConfig,
                                           ServerConfig)
from server.config.rules import DEEPSEEK_OPTION_KEYS, TOOL_CALL_PARSERS

__all__ = [
    "AppConfig", "BackendConfig", "ConfigError", "ConfigIssue", "DEEPSEEK_OPTION_KEYS",
    "DEFAULT_CONFIG_PATH", "HealthCheckConfig", "KvPoolConfig", "LogConfig", "LoraModule",
    "MAX_PLUGIN_PARAMS_CHARS", "MindIEConfig", "ModelConfig", "ModelDeployConfig",
    "ModelTypeOptions", "MtpSettings", "PluginParams", "SERVED_MODEL_TYPES", "SUPPORTED_PLUGIN_TYPES",
    "ScheduleConfig", "ServerConfig", "TOOL_CALL_PARSERS", "check_weight_dir",
    "default_config_path", "load_config", "parse_config",
]
