"""The PD link's config values: a peer's address with its KV port, and the KV transfer
key file.  Parsed here so the config check, the daemon and the coordinator read them
one way (server/pd/trust.py says what the key is for)."""
from __future__ import annotations

import ipaddress
from pathlib import Path

KEY_BYTES = 32


class KeyFileError(ValueError):
    """The key (or its file) cannot be used; the message says why."""


def parse_peer(text: str) -> tuple[str, int | None]:
    """``"10.0.0.2"`` -> ("10.0.0.2", None); ``"10.0.0.2:1121"`` and ``"[fe80::1]:1121"``
    -> the address and its KV port.  ValueError says what is wrong."""
    host, port = text, None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError("an IPv6 address with a port is written [address]:port")
        port = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        addr = str(ipaddress.ip_address(host))
    except ValueError:
        raise ValueError("not an IP address") from None
    if port is None:
        return addr, None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port!r} is not in [1, 65535]")
    return addr, int(port)


def parse_key(text: str, where: str) -> bytes:
    """A key written as 64 hex digits (a role body's field, or a key file)."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise KeyFileError(f"{where}: the KV transfer key must be {2 * KEY_BYTES} hex "
                           "digits") from None
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"{where}: the KV transfer key must be {2 * KEY_BYTES} hex digits, "
                           f"got {2 * len(key)}")
    return key


def read_key_file(path: str | Path) -> bytes:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{path}: cannot read the KV transfer key: "
                           f"{getattr(exc, 'strerror', None) or exc}") from None
    return parse_key(text, str(path))
