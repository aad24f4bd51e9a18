"""Reading config.json: env overrides, validation, every rule, filesystem checks, warnings.

Validation reports everything in one pass.  Pydantic stops checking a section's
cross-field rules when one of its fields is broken, so we validate, note each broken
field, drop it (its default stands in), validate again, run the cross-field rules on that
repaired tree and discard rule verdicts that read a dropped field.  The operator sees
each broken field once, and every other rule that is broken independently of it.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from server.config import kernel_env
from server.config.app import AppConfig
from server.config.errors import ConfigError, ConfigIssue, issues_from_validation, join_path
from server.config.ignored import ignored_warnings
from server.config.kv_pool import disk_tier_issue, load_pool_settings
from server.config.mindie.plugins import decode_plugin_params
from server.config.mindie.sections import API_KEY_RULE, MindIEConfig, check_api_key
from server.config.parallel import parallel_issues, parallel_layout
from server.config.rules import check_rules, mc_path, model_options

log = logging.getLogger("server.config")

DEFAULT_CONFIG_PATH = Path("conf/config.json")
MAX_FILE_BYTES = 10 * 1024 * 1024           # MindIE: the file must be in (0, 10 MB]
SERVED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
_IP_ENV = {"MIES_CONTAINER_IP": "ipAddress", "MIES_CONTAINER_MANAGEMENT_IP": "managementIpAddress"}
_ON = {"1", "true", "on", "yes"}
_OFF = {"0", "false", "off", "no"}


def default_config_path(env: Mapping[str, str]) -> Path:
    """``$MIES_CONFIG_JSON_PATH`` if set, else conf/config.json (relative to the cwd)."""
    return Path(env.get("MIES_CONFIG_JSON_PATH") or DEFAULT_CONFIG_PATH)


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] = os.environ,
                *, check_files: bool = True) -> AppConfig:
    """Read, validate and freeze a MindIE config.json.  Raises ConfigError listing every
    violation.  ``env`` (the MIES_*/MINDIE_* overrides) defaults to ``os.environ``; pass a
    mapping to control it (tests do; ``python -m server`` passes the process environment)."""
    file = Path(path) if path is not None else default_config_path(env)
    where = str(file)
    try:
        size = file.stat().st_size
        if not 0 < size <= MAX_FILE_BYTES:
            raise ConfigError([ConfigIssue("<file>", f"{size} bytes", "(0, 10 MB]",
                                           "config file size out of range")], where)
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([ConfigIssue("<file>", str(file), "a readable JSON file",
                                       f"cannot read config file: {exc.strerror or exc}")], where) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([ConfigIssue("<file>", str(file), "UTF-8 JSON", str(exc))], where) from None
    return parse_config(text, base_dir=file.resolve().parent, env=env, check_files=check_files,
                        source=file.resolve())


def parse_config(data: str | bytes | Mapping[str, Any], *, base_dir: str | os.PathLike[str] | None = None,
                 env: Mapping[str, str] | None = None, check_files: bool = True,
                 source: Path | None = None) -> AppConfig:
    """Validate a config given as JSON text or a dict.  ``base_dir`` anchors a relative
    modelWeightPath (default: the cwd).  ``check_files=False`` skips every filesystem
    check (weights folder, chat template) and validates everything else."""
    env = env or {}
    where = str(source) if source else None
    raw = _decode(data, where)
    overridden = _apply_env_overrides(raw, env)
    async_on, metrics_on, issues = _env_switches(env)
    compile_mode = _compile_mode(env, issues)
    compile_wait = _compile_wait(env, issues)
    engine_process = _engine_process(env, issues)
    draft_after_emit = _switch(env, "MTP_SERVE_DRAFT_AFTER_EMIT", True, "1 (on) or 0 (off)", issues)
    # Read where the weights are packed (model/loading/arena.py); checked here with the rest.
    _switch(env, "MTP_SERVE_WEIGHT_ARENA", True, "1 (on) or 0 (off)", issues)
    fatal_exit_delay = _fatal_exit_delay(env, issues)
    step_timeout = _step_timeout(env, issues)
    prediction_draft_tokens = _prediction_draft_tokens(env, issues)
    issues += [ConfigIssue(f"${p.variable}", p.value, p.allowed, p.message)
               for p in kernel_env.problems(env)]
    env_keys = _env_api_keys(env, issues)

    doc, field_issues, dropped = _validate_with_repair(raw, where)
    issues += field_issues
    issues += [i for i in check_rules(doc, async_scheduling=async_on)
               if not any(i.involves(d) for d in dropped)]
    issues += [i for i in parallel_issues(doc, env) if not any(i.involves(d) for d in dropped)]

    base = Path(base_dir) if base_dir is not None else Path.cwd()
    key, options, _ = (model_options(doc.backend.model_deploy.model_configs[0], 0)
                       if doc.backend.model_deploy.model_configs else (None, None, []))
    weights = template = model_type = None
    if doc.backend.model_deploy.model_configs:
        mc = doc.backend.model_deploy.model_configs[0]
        if mc.model_weight_path:
            weights = (base / mc.model_weight_path).resolve()
            if check_files:
                model_type, more = check_weight_dir(weights, f"{mc_path(0)}.modelWeightPath")
                issues += more
        if options is not None and options.chat_template:
            template = (base / options.chat_template).resolve()
            if check_files and not template.is_file():
                issues.append(ConfigIssue(f"{mc_path(0)}.models.{key}.chat_template",
                                          options.chat_template, "a readable .jinja file",
                                          f"chat template not found: {template}"))
    kv_pool, more = load_pool_settings(doc, base, check_files)
    issues += more
    if check_files and model_type is not None and options is not None:
        small = disk_tier_issue(kv_pool, weights, doc.backend.schedule.cache_block_size,
                                options.kv_cache_options.kv_cache_dtype)
        if small is not None and not any(small.involves(d) for d in dropped):
            issues.append(small)
    if kv_pool.backend and doc.backend.model_deploy.model_configs and not kv_pool.mem_size_gb \
            and doc.backend.model_deploy.model_configs[0].cpu_mem_size <= 0:
        issues.append(ConfigIssue(f"{mc_path(0)}.cpuMemSize", 0, "> 0 (or mem_size_gb in "
                                  "kvPoolConfig.configPath)", "the host KV pool needs a size",
                                  related=("BackendConfig.kvPoolConfig.backend",)))
    if issues:
        raise ConfigError([_mention_env(i, overridden) for i in issues], where)

    warnings = tuple(collect_warnings(doc, env))
    for w in warnings:
        log.warning("config: %s", w)
    return AppConfig(document=doc, model_weight_path=weights, source=source,
                     checkpoint_model_type=model_type, model_options_key=key,
                     model_options=options, chat_template_path=template,
                     async_scheduling=async_on, metrics_enabled=metrics_on, warnings=warnings,
                     compile_mode=compile_mode, compile_wait=compile_wait, kv_pool=kv_pool,
                     engine_process=engine_process, draft_after_emit=draft_after_emit,
                     fatal_exit_delay_s=fatal_exit_delay, step_timeout_s=step_timeout,
                     prediction_draft_tokens=prediction_draft_tokens,
                     api_keys=tuple(dict.fromkeys(doc.server.api_keys + env_keys)),
                     parallel=parallel_layout(doc, env))


def _decode(data: str | bytes | Mapping[str, Any], where: str | None) -> dict[str, Any]:
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise ConfigError([ConfigIssue("<file>", f"line {exc.lineno} column {exc.colno}",
                                           "a JSON object", f"not valid JSON: {exc.msg}")], where) from None
    if not isinstance(data, Mapping):
        raise ConfigError([ConfigIssue("<root>", type(data).__name__, "a JSON object",
                                       "the config must be a JSON object")], where)
    raw = copy.deepcopy(dict(data))
    # Decode string plugin_params up front so errors inside it get their own paths and a
    # bad num_speculative_tokens does not hide the other MTP rules.
    backend = raw.get("BackendConfig")
    deploy = backend.get("ModelDeployConfig") if isinstance(backend, dict) else None
    models = deploy.get("ModelConfig") if isinstance(deploy, dict) else None
    for entry in models if isinstance(models, list) else ():
        if isinstance(entry, dict) and isinstance(entry.get("plugin_params"), str):
            try:
                entry["plugin_params"] = decode_plugin_params(entry["plugin_params"])
            except Exception:               # noqa: BLE001 - reported by validation below
                pass
    return raw


def _apply_env_overrides(raw: dict[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """MIES_CONTAINER_IP / MIES_CONTAINER_MANAGEMENT_IP replace the bind IPs.  Returns
    {json path: env var name} so issues about those values can say where they came from."""
    done = {}
    for var, key in _IP_ENV.items():
        value = env.get(var)
        if value:
            server = raw.setdefault("ServerConfig", {})
            if isinstance(server, dict):
                server[key] = value
                done[f"ServerConfig.{key}"] = var
    return done


def _env_switches(env: Mapping[str, str]) -> tuple[bool, bool, list[ConfigIssue]]:
    # MindIE: async scheduling is on only for "1"; here also true/on/yes (docs/config.md).
    async_on = env.get("MINDIE_ASYNC_SCHEDULING_ENABLE", "").strip().lower() in _ON
    # MindIE defaults metrics off; this daemon defaults them on (a demo should be observable).
    issues: list[ConfigIssue] = []
    metrics_on = _switch(env, "MIES_SERVICE_MONITOR_MODE", True, "1 (metrics on) or 0 (off)", issues)
    return async_on, metrics_on, issues


def _switch(env: Mapping[str, str], name: str, default: bool, expected: str,
            issues: list[ConfigIssue]) -> bool:
    """A 1/0 environment switch (true/on/yes and false/off/no too); unset or unrecognised
    gives ``default``, and an unrecognised value is reported."""
    raw = env.get(name, "").strip().lower()
    if raw and raw not in _ON | _OFF:
        issues.append(ConfigIssue(f"${name}", raw, expected, "unrecognised value"))
    return raw not in _OFF if default else raw in _ON


def _compile_mode(env: Mapping[str, str], issues: list[ConfigIssue]) -> str:
    """$MTP_SERVE_COMPILE: auto (default) | on | off (server/engine/worker/compile_step.py)."""
    raw = env.get("MTP_SERVE_COMPILE", "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in _ON | _OFF:
        return "on" if raw in _ON else "off"
    issues.append(ConfigIssue("$MTP_SERVE_COMPILE", raw, "auto, 1 (on) or 0 (off)",
                              "unrecognised value"))
    return "auto"


def _compile_wait(env: Mapping[str, str], issues: list[ConfigIssue]) -> bool:
    """$MTP_SERVE_COMPILE_WAIT: 1 = start-up waits for the compiled graphs; 0 (default) = the
    daemon serves at once and adopts them when ready (server/engine/worker/compile_step.py)."""
    return _switch(env, "MTP_SERVE_COMPILE_WAIT", False, "1 (wait) or 0 (compile in the background)",
                   issues)


def _engine_process(env: Mapping[str, str], issues: list[ConfigIssue]) -> bool:
    """$MTP_SERVE_ENGINE_PROCESS: 1 (default) = the daemon runs its engine in a process of its
    own (server/engine/front/engine_process.py); 0 = on a thread of the serving process."""
    return _switch(env, "MTP_SERVE_ENGINE_PROCESS", True,
                   "1 (a process of its own) or 0 (a thread of the serving process)", issues)


def _fatal_exit_delay(env: Mapping[str, str], issues: list[ConfigIssue]) -> float:
    """$MTP_SERVE_FATAL_EXIT_DELAY: seconds /health answers 503 after the worker group
    failed, before the daemon exits 1 (default 5: long enough for a probe to see it)."""
    return _seconds(env, "MTP_SERVE_FATAL_EXIT_DELAY", 5.0, 0, 3600, issues)


def _step_timeout(env: Mapping[str, str], issues: list[ConfigIssue]) -> float:
    """$MTP_SERVE_STEP_TIMEOUT: seconds the engine process may go without finishing a step
    while it has requests, before the daemon takes it for hung (stopped, or stuck in a
    kernel) and fails as for a dead rank (default 300: far above any real step)."""
    return _seconds(env, "MTP_SERVE_STEP_TIMEOUT", 300.0, 1, 86400, issues)


def _seconds(env: Mapping[str, str], name: str, default: float, low: float, high: float,
             issues: list[ConfigIssue]) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not low <= value <= high:
        issues.append(ConfigIssue(f"${name}", raw, f"seconds, {low:g} to {high:g}",
                                  "not a number of seconds in range"))
        return default
    return value


PREDICTION_TOKENS_DEFAULT = 64
PREDICTION_TOKENS_MAX = 64


def _prediction_draft_tokens(env: Mapping[str, str], issues: list[ConfigIssue]) -> int:
    """$MTP_SERVE_PREDICTION_TOKENS: most tokens of a request's ``prediction`` (OpenAI
    Predicted Outputs) verified as drafts per step, 0 to 64 (default 16); 0 = predictions
    are accepted in requests but never used as drafts."""
    raw = env.get("MTP_SERVE_PREDICTION_TOKENS", "").strip()
    if not raw:
        return PREDICTION_TOKENS_DEFAULT
    value = int(raw) if raw.isascii() and raw.isdigit() else -1
    if not 0 <= value <= PREDICTION_TOKENS_MAX:
        issues.append(ConfigIssue("$MTP_SERVE_PREDICTION_TOKENS", raw,
                                  f"an integer, 0 to {PREDICTION_TOKENS_MAX}",
                                  "not a token count in range"))
        return PREDICTION_TOKENS_DEFAULT
    return value


def _env_api_keys(env: Mapping[str, str], issues: list[ConfigIssue]) -> tuple[str, ...]:
    """$MTP_SERVE_API_KEY: one key or several, comma-separated (the value is never echoed)."""
    raw = env.get("MTP_SERVE_API_KEY", "")
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    for i, key in enumerate(keys):
        try:
            check_api_key(key)
        except PydanticCustomError:
            issues.append(ConfigIssue("$MTP_SERVE_API_KEY", f"<key {i + 1} of {len(keys)}>",
                                      API_KEY_RULE, "not a usable API key"))
    return keys


def _validate_with_repair(raw: dict[str, Any], where: str | None
                          ) -> tuple[MindIEConfig, list[ConfigIssue], list[str]]:
    issues: list[ConfigIssue] = []
    dropped: list[str] = []
    for _ in range(10):
        try:
            return MindIEConfig.model_validate_json(json.dumps(raw, default=str)), issues, dropped
        except ValidationError as err:
            issues += issues_from_validation(err, MindIEConfig)
            progress = False
            for e in err.errors():
                loc = _drop(raw, e["loc"])
                if loc is not None:
                    dropped.append(join_path(loc))
                    progress = True
            if not progress:
                break
    raise ConfigError(issues, where)


def _drop(raw: Any, loc: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Delete the deepest dict key on ``loc`` (so its default applies); return its loc."""
    node, best = raw, None
    for depth, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            best = (node, part, loc[:depth + 1])
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            break
    if best is None:
        return None
    parent, key, where = best
    del parent[key]
    return where


def _mention_env(issue: ConfigIssue, overridden: dict[str, str]) -> ConfigIssue:
    var = overridden.get(issue.path)
    if var is None:
        return issue
    return ConfigIssue(issue.path, issue.value, issue.allowed,
                       f"{issue.message} (value from ${var})", issue.related)


def check_weight_dir(folder: Path, path: str) -> tuple[str | None, list[ConfigIssue]]:
    """The weights folder must exist and hold a config.json whose model_type we serve."""
    allowed = "a folder holding config.json with model_type " + " or ".join(SERVED_MODEL_TYPES)
    if not folder.exists():
        return None, [ConfigIssue(path, str(folder), allowed, f"folder does not exist: {folder}")]
    if not folder.is_dir():
        return None, [ConfigIssue(path, str(folder), allowed, f"not a folder: {folder}")]
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        return None, [ConfigIssue(path, str(folder), allowed, f"missing file: {cfg_file}")]
    try:
        hf = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, [ConfigIssue(path, str(cfg_file), allowed, f"cannot read {cfg_file}: {exc}")]
    model_type = hf.get("model_type") if isinstance(hf, dict) else None
    if model_type not in SERVED_MODEL_TYPES:
        return None, [ConfigIssue(path, model_type, "model_type " + " or ".join(SERVED_MODEL_TYPES),
                                  f"{cfg_file} has model_type {model_type!r}, which this daemon does not serve")]
    return model_type, []


def collect_warnings(doc: MindIEConfig, env: Mapping[str, str] | None = None) -> list[str]:
    """Keys we keep but do not understand, deprecated switches, modes we do not implement,
    and MindIE fields (or variables) set to a value that has no effect here (ignored.py)."""
    out = [f"{path}: unknown key, kept and ignored" for path in _unknown_keys(doc, ())]
    sched = doc.backend.schedule
    for key, value in (("enablePrefixCache", sched.enable_prefix_cache), ("enableSplit", sched.enable_split)):
        if value is not None:
            out.append(f"BackendConfig.ScheduleConfig.{key}: deprecated and ignored; "
                       "use ModelConfig[].plugin_params")
    for i, mc in enumerate(doc.backend.model_deploy.model_configs):
        if mc.model_instance_type != "Standard":
            out.append(f"{mc_path(i)}.modelInstanceType: {mc.model_instance_type!r} treated as 'Standard'")
        key, opts, _ = model_options(mc, i)
        present = [k for k in mc.models if k != key and k.startswith("deepseek")]
        for other in present:
            out.append(f"{mc_path(i)}.models.{other}: ignored; models.{key} takes precedence")
        if key is not None:
            out += [f"{p}: unknown key, kept and ignored"
                    for p in _unknown_keys(opts, (*mc_path(i).split("."), "models", key))]
    sv = doc.server
    if sv.infer_mode == "dmi" and sv.pd_role is None and sv.pd_transfer_key_file is None \
            and not sv.api_keys and not (env or {}).get("MTP_SERVE_API_KEY"):
        out.append("ServerConfig.inferMode: \"dmi\" without pdRole, pdTransferKeyFile or apiKeys: "
                   "no caller can assign this instance a role (the role API takes calls only "
                   "with the deployment's KV transfer key or an API key), so every business "
                   "request gets 503")
    return out + ignored_warnings(doc, env)


def _unknown_keys(node: BaseModel, loc: tuple[Any, ...]) -> list[str]:
    found = [join_path((*loc, key)) for key in (node.model_extra or {})]
    for name, info in type(node).model_fields.items():
        value = getattr(node, name)
        alias = info.alias or name
        if isinstance(value, BaseModel):
            found += _unknown_keys(value, (*loc, alias))
        elif isinstance(value, tuple):
            for j, item in enumerate(value):
                if isinstance(item, BaseModel):
                    found += _unknown_keys(item, (*loc, alias, j))
    return found
