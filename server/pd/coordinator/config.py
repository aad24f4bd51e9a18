"""The coordinator's config file (``conf/pd/coordinator.json``) and its instances.

Every key is checked at load; a config with errors is refused as a whole, each error
naming its key (``python -m server.pd`` prints them and exits 2).  Unknown keys are
errors too: a misspelt limit (``maxRequestLenght``) would otherwise silently leave the
default in force.

The coordinator needs a credential the instances accept for their role and KV calls
(server/api/planes/pd_routes.py): the deployment's KV transfer key (``kvTransferKeyFile``, the
file the instances read as ``pdTransferKeyFile``: the coordinator signs each call with it)
or an API key the instances hold (``apiKey``: then the coordinator may hand them a key of
its own with the role).  With neither, no instance would take a role from it, so the
config is refused.  The config file and the key file are read as small regular files
(server/config/pd_link.py: a FIFO is refused, not waited on).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from server.config.pd_link import read_small_file
from server.pd.trust import read_key_file

MB = 1024 * 1024
KNOWN_KEYS = ("ipAddress", "port", "prefill", "decode", "assignRoles", "timeouts", "apiKey",
              "maxRequestLength", "clientHeaderTimeout", "clientBodyTimeout", "healthInterval",
              "kvTransferKeyFile")
TIMEOUT_KEYS = {"connect": 10.0, "request": 600.0, "start": 300.0}


class CoordinatorConfigError(ValueError):
    pass


@dataclass
class Instance:
    role: str                       # "prefill" | "decode"
    index: int
    business: str                   # http://host:port
    management: str
    in_flight: int = 0
    # Health (fleet.py): ``up`` is set by the health loop once the instance
    # answers its /v1/status with the right role and KV transfer key id; a failed request
    # clears it (and bumps ``epoch``, so a health check that started before the failure
    # does not set it again).
    up: bool = True
    epoch: int = 0
    kv_port: int | None = None      # a prefill instance's KV port (its /v1/status pd.kv_port)
    last_role_body: dict | None = None
    # The instance's role version (its /v1/status pd.role_version) after this
    # coordinator's last post: another value means someone else posted a role since.
    role_version: int | None = None

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def host(self) -> str:
        return urlsplit(self.business).hostname or "127.0.0.1"

    def available(self, now: float | None = None) -> bool:
        return self.up


@dataclass
class CoordinatorConfig:
    ip_address: str = "127.0.0.1"
    port: int = 1025
    prefill: list[Instance] = field(default_factory=list)
    decode: list[Instance] = field(default_factory=list)
    assign_roles: bool = True
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 600.0
    start_timeout_s: float = 300.0
    api_key: str | None = None      # the instances' key (management calls) and this /v1/status's
    max_request_bytes: int = 40 * MB  # maxRequestLength (MB in the file)
    header_timeout_s: float = 10.0    # clientHeaderTimeout
    body_timeout_s: float = 60.0      # clientBodyTimeout
    health_interval_s: float = 2.0    # healthInterval
    kv_transfer_key_file: str | None = None
    kv_transfer_key: bytes | None = None   # read from kv_transfer_key_file at load

    @classmethod
    def load(cls, path: str | Path) -> "CoordinatorConfig":
        try:
            doc = json.loads(read_small_file(path))
        except OSError as exc:
            raise CoordinatorConfigError(f"{path}: {exc.strerror or exc}") from None
        except (ValueError, RecursionError) as exc:
            raise CoordinatorConfigError(f"{path}: {exc}") from None
        if not isinstance(doc, dict):
            raise CoordinatorConfigError(f"{path}: the config must be a JSON object")
        return cls.from_dict(doc, str(path))

    @classmethod
    def from_dict(cls, doc: dict, where: str = "coordinator config") -> "CoordinatorConfig":
        errors: list[str] = _unknown_keys(doc)

        def instances(role: str) -> list[Instance]:
            out = []
            entries = doc.get(role)
            if entries is not None and not isinstance(entries, list):
                errors.append(f"{role}: must be a list of {{\"business\": URL, \"management\": URL}}")
                entries = []
            for i, entry in enumerate(entries or []):
                if not isinstance(entry, dict) or not all(
                        isinstance(entry.get(k), str) and entry[k].startswith(("http://", "https://"))
                        for k in ("business", "management")):
                    errors.append(f"{role}[{i}]: needs \"business\" and \"management\" URLs "
                                  "(http://host:port)")
                    continue
                out.append(Instance(role, i, entry["business"].rstrip("/"),
                                    entry["management"].rstrip("/")))
            if not out:
                errors.append(f"{role}: at least one instance is needed")
            return out

        def number(key: str, default: float, lo: float, hi: float, unit: str,
                   integer: bool = False, value: Any = None, name: str | None = None) -> float:
            value = doc.get(key, default) if value is None else value
            name = name or key
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
                math.isfinite(value) and (not integer or float(value).is_integer())
            if not ok or not lo <= value <= hi:
                kind = "an integer" if integer else "a number"
                errors.append(f"{name}: {value!r} is not {kind} in [{lo:g}, {hi:g}] ({unit})")
                return default
            return value

        prefill, decode = instances("prefill"), instances("decode")
        ip, port, assign, api_key = _scalars(doc, errors)
        t = doc.get("timeouts", {})
        if not isinstance(t, dict):
            errors.append("timeouts: must be an object {\"connect\", \"request\", \"start\"}")
            t = {}
        for k in sorted(set(t) - set(TIMEOUT_KEYS)):
            errors.append(f"timeouts.{k}: unknown key; known: {', '.join(TIMEOUT_KEYS)}")
        timeouts = {k: float(number(k, d, 0.001, 86400, "seconds", value=t.get(k, d),
                                    name=f"timeouts.{k}"))
                    for k, d in TIMEOUT_KEYS.items()}
        max_mb = number("maxRequestLength", 40, 1, 100, "MB, like ServerConfig.maxRequestLength",
                        integer=True)
        header_s = number("clientHeaderTimeout", 10, 0.1, 600, "seconds")
        body_s = number("clientBodyTimeout", 60, 0.1, 3600, "seconds")
        health_s = number("healthInterval", 2, 0.1, 300, "seconds")

        key_file, key = _key_file(doc, assign, api_key, errors)
        if errors:
            raise CoordinatorConfigError(f"{where}: " + "; ".join(errors))
        return cls(ip, port, prefill, decode, assign, timeouts["connect"], timeouts["request"],
                   timeouts["start"], api_key, int(max_mb) * MB, float(header_s), float(body_s),
                   float(health_s), key_file, key)


def _unknown_keys(doc: dict) -> list[str]:
    unknown = sorted(k for k in doc if k not in KNOWN_KEYS)
    if unknown:
        return [f"unknown key(s) {', '.join(map(repr, unknown))}; known: "
                f"{', '.join(KNOWN_KEYS)}"]
    return []


def _scalars(doc: dict, errors: list[str]) -> tuple[Any, Any, bool, str | None]:
    """ipAddress, port, assignRoles and apiKey (a problem is added to ``errors``)."""
    ip = doc.get("ipAddress", "127.0.0.1")
    if not isinstance(ip, str) or not ip:
        errors.append(f"ipAddress: {ip!r} is not a host address")
    port = doc.get("port", 1025)
    if not isinstance(port, int) or isinstance(port, bool) or not 1024 <= port <= 65535:
        errors.append(f"port: {port!r} is not in [1024, 65535]")
    assign = doc.get("assignRoles", True)
    if not isinstance(assign, bool):
        errors.append(f"assignRoles: {assign!r} is not true or false")
        assign = True
    api_key = doc.get("apiKey")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        errors.append("apiKey: must be a non-empty string")
        api_key = None
    return ip, port, assign, api_key


def _key_file(doc: dict, assign: bool, api_key: str | None,
              errors: list[str]) -> tuple[str | None, bytes | None]:
    """(kvTransferKeyFile, the key read from it); without assignRoles it is required, and
    with it either it or apiKey is (the instances take a role only from a caller holding
    one)."""
    key_file, key = doc.get("kvTransferKeyFile"), None
    if key_file is not None:
        if not isinstance(key_file, str) or not key_file:
            errors.append("kvTransferKeyFile: must be a path (a string)")
            key_file = None
        else:
            try:
                key = read_key_file(key_file)
            except ValueError as exc:      # KeyFileError / TrustError: says why
                errors.append(f"kvTransferKeyFile: {exc}")
    if assign is False and key_file is None:
        errors.append("assignRoles: false needs kvTransferKeyFile: the coordinator then "
                      "hands no KV transfer key to the instances (the key travels with the "
                      "role), so they must read the same key from a file, each from its "
                      "own ServerConfig.pdTransferKeyFile, and the coordinator from this "
                      "one; without it D refuses every request's kv_transfer_params")
    if assign is True and key_file is None and api_key is None:
        errors.append("assignRoles: true needs kvTransferKeyFile or apiKey: an instance takes "
                      "its role only from a caller holding the deployment's KV transfer key "
                      "(the file the instances read as ServerConfig.pdTransferKeyFile) or one "
                      "of its API keys (ServerConfig.apiKeys); scripts/pd_start.sh makes "
                      "conf/pd/kv-transfer.key on first use")
    return key_file, key
