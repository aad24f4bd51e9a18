"""MindIE-style ``config.json``: typed, validated once, immutable.

    from server.config import load_config, ConfigError
    cfg = load_config("conf/config.json", env=os.environ)
    cfg.mtp, cfg.model_weight_path, cfg.schedule.max_batch_size, cfg.max_input_len ...

See docs/config.md for every field, default, range and rule.
"""
from server.config.app import AppConfig
from server.config.errors import ConfigError, ConfigIssue
from server.config.loader import (DEFAULT_CONFIG_PATH, SERVED_MODEL_TYPES, check_weight_dir,
                                  default_config_path, load_config, parse_config)
from server.config.plugins import (MAX_PLUGIN_PARAMS_CHARS, SUPPORTED_PLUGIN_TYPES, MtpSettings,
                                   PluginParams)
from server.config.rules import DEEPSEEK_OPTION_KEYS, TOOL_CALL_PARSERS
from server.config.sections import (BackendConfig, HealthCheckConfig, KvPoolConfig, LogConfig,
                                    LoraModule, MindIEConfig, ModelConfig, ModelDeployConfig,
                                    ModelTypeOptions, ScheduleConfig, ServerConfig)

__all__ = [
    "AppConfig", "BackendConfig", "ConfigError", "ConfigIssue", "DEEPSEEK_OPTION_KEYS",
    "DEFAULT_CONFIG_PATH", "HealthCheckConfig", "KvPoolConfig", "LogConfig", "LoraModule",
    "MAX_PLUGIN_PARAMS_CHARS", "MindIEConfig", "ModelConfig", "ModelDeployConfig",
    "ModelTypeOptions", "MtpSettings", "PluginParams", "SERVED_MODEL_TYPES", "SUPPORTED_PLUGIN_TYPES",
    "ScheduleConfig", "ServerConfig", "TOOL_CALL_PARSERS", "check_weight_dir",
    "default_config_path", "load_config", "parse_config",
]
