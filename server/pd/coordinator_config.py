"""The coordinator's config file (``conf/pd/coordinator.json``) and its instances."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit


class CoordinatorConfigError(ValueError):
    pass


@dataclass
class Instance:
    role: str                       # "prefill" | "decode"
    index: int
    business: str                   # http://host:port
    management: str
    in_flight: int = 0
    down_until: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def host(self) -> str:
        return urlsplit(self.business).hostname or "127.0.0.1"

    def available(self, now: float) -> bool:
        return now >= self.down_until


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
    api_key: str | None = None      # the instances' key (management calls)

    @classmethod
    def load(cls, path: str | Path) -> "CoordinatorConfig":
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise CoordinatorConfigError(f"{path}: {exc}") from None
        errors = []

        def instances(role: str) -> list[Instance]:
            out = []
            for i, entry in enumerate(doc.get(role) or []):
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

        prefill, decode = instances("prefill"), instances("decode")
        port = doc.get("port", 1025)
        if not isinstance(port, int) or not 1024 <= port <= 65535:
            errors.append(f"port: {port!r} is not in [1024, 65535]")
        if errors:
            raise CoordinatorConfigError(f"{path}: " + "; ".join(errors))
        t = doc.get("timeouts", {})
        return cls(doc.get("ipAddress", "127.0.0.1"), port, prefill, decode,
                   bool(doc.get("assignRoles", True)), float(t.get("connect", 10)),
                   float(t.get("request", 600)), float(t.get("start", 300)),
                   doc.get("apiKey"))
