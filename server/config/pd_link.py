"""The PD link's config values: a peer's address with its KV port, and the KV transfer
key file.  Parsed here so the config check, the daemon and the coordinator read them
one way (server/pd/trust.py says what the key is for).

Key files are opened the way a small secret should be: non-blocking (a FIFO named as the
key file hung ``--check`` and the coordinator for good: opening a FIFO for reading waits
for a writer), only a regular file once opened (``fstat``, so nothing can be swapped in
between a check and the open), and at most ``MAX_SMALL_FILE`` bytes read.  Links are
followed: Kubernetes mounts a secret as a symbolic link (``key -> ..data/key``), and the
file is the operator's own, not a name a client chose.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import stat
from pathlib import Path

KEY_BYTES = 32
MAX_SMALL_FILE = 1 << 20          # a key file, or the coordinator's config file


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


def read_small_file(path: str | Path, limit: int = MAX_SMALL_FILE) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes.  OSError (its ``strerror``
    says why) for anything else: a FIFO, a device or a directory is refused without
    waiting, a larger file without reading it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or directory)")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, more than the {limit} allowed")
        data = b""
        while len(data) <= limit and (chunk := os.read(fd, limit + 1 - len(data))):
            data += chunk
        if len(data) > limit:                  # it grew while being read
            raise OSError(errno.EFBIG, f"more than the {limit} bytes allowed")
        return data
    finally:
        os.close(fd)


def read_key_file(path: str | Path) -> bytes:
    try:
        text = read_small_file(path, 4096).decode("ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{path}: cannot read the KV transfer key: "
                           f"{getattr(exc, 'strerror', None) or exc}") from None
    return parse_key(text, str(path))
