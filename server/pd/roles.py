"""A PD instance's role, assigned the MindIE way or fixed in the config.

``POST /v1/role/prefill`` / ``/v1/role/decode`` (and ``/v2/role/...``) on the management
plane take MindIE's body: V1 ``{"local": {...}, "peers": [{...}, ...]}``, V2 ``{"local":
[nodes], "peers": [[nodes], ...]}``.  What this daemon uses from it: the peers' addresses
(``server_ip`` / ``host_ip``, and V2 nodes' ``host_ip``): a decode instance pulls KV only
from a peer, never from an address a request body names.  ``flex`` is not built.  Until an
instance in ``inferMode: "dmi"`` has a role, business requests get 503.

Our extensions of the body (the coordinator sends them, server/pd/trust.py): a top-level
``kv_transfer_key`` (64 hex digits, the deployment's key; kept when a later body has
none) and a peer node's ``kv_port`` (the port D pulls that peer's rows from).  Addresses
must be strings: ``ipaddress`` would take the integer 2130706433 as 127.0.0.1.
"""
from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass, field
from typing import Any

from server.config.pd_link import KeyFileError, parse_key

ROLES = ("prefill", "decode")


class RoleError(ValueError):
    """The body cannot be taken (the reason is in the message)."""


@dataclass
class RoleState:
    role: str | None = None
    peers: frozenset[str] = frozenset()          # addresses of the peer instances
    local: Any = None
    version: int = 0                             # role switches so far
    # peer address -> the KV ports of the prefill instances there (several P may share a host)
    kv_ports: dict[str, frozenset[int]] = field(default_factory=dict)
    key: bytes | None = None                     # the deployment's KV transfer key
    # role -> why this instance may not take it (its parallel layout: PDSettings)
    refused: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def assign(self, role: str, body: Any, api_version: int = 1) -> None:
        if role not in ROLES:
            raise RoleError(f"role {role!r} is not built here; allowed: prefill, decode")
        if role in self.refused:
            raise RoleError(self.refused[role])
        if not isinstance(body, dict) or "local" not in body:
            raise RoleError("the body needs \"local\" and \"peers\"")
        peers = body.get("peers")
        if not isinstance(peers, list) or not peers:
            raise RoleError("\"peers\" must be a non-empty list for a prefill or decode role")
        addrs: set[str] = set()
        ports: dict[str, set[int]] = {}
        for i, peer in enumerate(peers):
            nodes = peer if api_version == 2 and isinstance(peer, list) else [peer]
            for node in nodes:
                if not isinstance(node, dict):
                    raise RoleError(f"peers[{i}] is not an object")
                port = node.get("kv_port")
                if port is not None and (type(port) is not int or not 1 <= port <= 65535):
                    raise RoleError(f"peers[{i}].kv_port: {port!r} is not a port number")
                for key in ("server_ip", "host_ip"):
                    value = node.get(key)
                    if value is None:
                        continue
                    if not isinstance(value, str):
                        raise RoleError(f"peers[{i}].{key}: {value!r} is not an IP address "
                                        "string")
                    try:
                        addr = str(ipaddress.ip_address(value))
                    except ValueError:
                        raise RoleError(f"peers[{i}].{key}: {value!r} is not an IP address") from None
                    addrs.add(addr)
                    if port is not None:
                        ports.setdefault(addr, set()).add(port)
        if not addrs:
            raise RoleError("no peer names an address (server_ip or host_ip)")
        key = body.get("kv_transfer_key")
        if key is not None:
            if not isinstance(key, str):
                raise RoleError("kv_transfer_key must be a string of 64 hex digits")
            try:
                key = parse_key(key, "kv_transfer_key")
            except KeyFileError as exc:
                raise RoleError(str(exc)) from None
        with self._lock:
            self.role, self.peers, self.local = role, frozenset(addrs), body["local"]
            self.kv_ports = {a: frozenset(p) for a, p in ports.items()}
            if key is not None:
                self.key = key
            self.version += 1

    def is_peer(self, host: str) -> bool:
        try:
            return str(ipaddress.ip_address(host)) in self.peers
        except ValueError:
            return False

    def kv_ports_of(self, host: str, default: int) -> frozenset[int]:
        """The ports a peer's rows may be pulled from (its nodes' ``kv_port``s, else
        ``default``)."""
        return self.kv_ports.get(str(ipaddress.ip_address(host)), frozenset((default,)))
