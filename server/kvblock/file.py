"""One KV block on disk: a checksummed file, written atomically, read without trust.  No torch.

Layout (little-endian), format 2: magic ``MTPKVB02`` (8 bytes) | the block key's SHA-256
digest (32) | content length (8) | payload length (8) | BLAKE2b-128 of content and
payload (16) | content (the key's parent digest, next token and tokens: kvblock/key.py) |
payload (one host-tier slot: every cache layer of the block,
engine/kv/transfer/host_pool.py).  The file is named by the digest.  A reader gets a block only when the magic, digest, both lengths
and the checksum match and the stored content equals the content it looks up: a block
whose digest merely collides with another's, and a torn, truncated or corrupted file,
are never served.  Format 1 (``MTPKVB01``, named by 64-bit Python hashes) is refused by
its magic, and its 16-digit names are not scanned; the disk tier's folder name carries
the format too (engine/kv/tiers.py), so its files are not even looked at.

Reads open only a regular file of the expected size and never follow a link
(``O_NOFOLLOW``; ``O_NONBLOCK``, so a FIFO put in a block's place opens at once instead of
waiting for a writer, then ``fstat`` refuses it); they allocate the expected size, never
what a link or a grown file would give.  Anything else is a ``BadBlockFile`` (the disk
tier logs and counts it as a miss).

Writes go to a temporary name in the same directory, opened the same careful way, and
are renamed into place, so a reader sees either no file or a whole one.
"""
from __future__ import annotations

import errno
import hashlib
import os
import stat
import struct
from pathlib import Path

from server.kvblock.key import DIGEST_BYTES, BlockKey, content_bytes

MAGIC = b"MTPKVB02"
_HEADER = struct.Struct("<8s32sQQ16s")
HEADER_BYTES = _HEADER.size                # 72
_SUFFIX = ".kvb"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class BadBlockFile(Exception):
    """A block file that is not what the engine wrote; the message says what it is."""


def file_bytes(block_size: int, payload_bytes: int) -> int:
    """The size of every block file of this layout (header, content, payload)."""
    return HEADER_BYTES + content_bytes(block_size) + payload_bytes


def file_overhead(block_size: int) -> int:
    """Bytes a file adds to its block's rows (header and the tokens it compares)."""
    return HEADER_BYTES + content_bytes(block_size)


def file_name(key: BlockKey | bytes) -> str:
    digest = key.digest if isinstance(key, BlockKey) else key
    return digest.hex() + _SUFFIX


def digest_of_name(name: str) -> bytes | None:
    """The key digest a file name stands for; None for any other name."""
    stem, dot, ext = name.partition(".")
    if dot + ext != _SUFFIX or len(stem) != 2 * DIGEST_BYTES:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def _checksum(content: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(content, digest_size=16)
    h.update(payload)
    return h.digest()


def write_block(path: str | os.PathLike[str], key: BlockKey, payload: bytes | memoryview) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)        # a leftover (or planted) entry is never written through
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _NONBLOCK | _CLOEXEC,
                     0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(_HEADER.pack(MAGIC, key.digest, len(key.content), len(payload),
                                 _checksum(key.content, payload)))
            f.write(key.content)
            f.write(payload)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def load_block(path: str | os.PathLike[str], key: BlockKey, payload_bytes: int) -> bytes:
    """The payload of ``key``'s block file.  Raises FileNotFoundError when there is none and
    BadBlockFile when the entry is anything but the whole file the engine wrote for it."""
    size = HEADER_BYTES + len(key.content) + payload_bytes
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadBlockFile("a symbolic link") from None
        raise BadBlockFile(f"cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadBlockFile(f"not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_size != size:
            raise BadBlockFile(f"{st.st_size} bytes, a block file has {size}")
        data = _read_exactly(fd, size)
    finally:
        os.close(fd)
    magic, digest, n_content, n_payload, checksum = _HEADER.unpack_from(data)
    content = bytes(data[HEADER_BYTES:HEADER_BYTES + n_content]) if n_content == len(key.content) \
        else b""
    payload = data[HEADER_BYTES + len(key.content):]
    if magic != MAGIC:
        raise BadBlockFile(f"magic {magic!r}, not {MAGIC!r}")
    if digest != key.digest or n_content != len(key.content) or n_payload != payload_bytes:
        raise BadBlockFile("the header names another block or layout")
    if _checksum(content, payload) != checksum:
        raise BadBlockFile("checksum mismatch (torn or corrupted)")
    if content != key.content:
        raise BadBlockFile("holds other tokens under this digest")
    return bytes(payload)


def read_block(path: str | os.PathLike[str], key: BlockKey, payload_bytes: int) -> bytes | None:
    """The payload, or None when the file is missing or not exactly what was written."""
    try:
        return load_block(path, key, payload_bytes)
    except (OSError, BadBlockFile):
        return None


def _read_exactly(fd: int, size: int) -> memoryview:
    buf = memoryview(bytearray(size))
    got = 0
    while got < size:
        n = os.readv(fd, [buf[got:]])
        if n == 0:
            raise BadBlockFile(f"shrank while read ({got} of {size} bytes)")
        got += n
    return buf
