"""A PD instance's role, assigned the MindIE way or fixed in the config.

``POST /v1/role/prefill`` / ``/v1/role/decode`` (and ``/v2/role/...``) on the management
plane take MindIE's body: V1 ``{"local": {...}, "peers": [{...}, ...]}``, V2 ``{"local":
[nodes], "peers": [[nodes], ...]}``.  What this daemon uses from it: the peers' addresses
(``server_ip`` / ``host_ip``, and V2 nodes' ``host_ip``): a decode instance pulls KV only
from a peer, never from an address a request body names.  ``flex`` is not built.  Until an
instance in ``inferMode: "dmi"`` has a role, business requests get 503.
"""
from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass, field
from typing import Any

ROLES = ("prefill", "decode")


class RoleError(ValueError):
    """The body cannot be taken (the reason is in the message)."""


@dataclass
class RoleState:
    role: str | None = None
    peers: frozenset[str] = frozenset()          # addresses of the peer instances
    local: Any = None
    version: int = 0                             # role switches so far
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def assign(self, role: str, body: Any, api_version: int = 1) -> None:
        if role not in ROLES:
            raise RoleError(f"role {role!r} is not built here; allowed: prefill, decode")
        if not isinstance(body, dict) or "local" not in body:
            raise RoleError("the body needs \"local\" and \"peers\"")
        peers = body.get("peers")
        if not isinstance(peers, list) or not peers:
            raise RoleError("\"peers\" must be a non-empty list for a prefill or decode role")
        addrs = set()
        for i, peer in enumerate(peers):
            nodes = peer if api_version == 2 and isinstance(peer, list) else [peer]
            for node in nodes:
                if not isinstance(node, dict):
                    raise RoleError(f"peers[{i}] is not an object")
                for key in ("server_ip", "host_ip"):
                    value = node.get(key)
                    if value is None:
                        continue
                    try:
                        addrs.add(str(ipaddress.ip_address(value)))
                    except ValueError:
                        raise RoleError(f"peers[{i}].{key}: {value!r} is not an IP address") from None
        if not addrs:
            raise RoleError("no peer names an address (server_ip or host_ip)")
        with self._lock:
            self.role, self.peers, self.local = role, frozenset(addrs), body["local"]
            self.version += 1

    def is_peer(self, host: str) -> bool:
        try:
            return str(ipaddress.ip_address(host)) in self.peers
        except ValueError:
            return False
