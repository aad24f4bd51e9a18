"""One KV block on disk: a checksummed file, written atomically.  No torch.

Layout (little-endian): magic ``MTPKVB01`` (8 bytes) | block hash (8, unsigned) | payload
length (8) | BLAKE2b-128 of the payload (16) | payload (one host-tier slot: every cache
layer of the block, kv/host_pool.py).  A reader that finds another magic, another hash, a
length that does not match the file or a digest that does not match the payload gets
None: a torn, truncated or corrupted file is never served.

Writes go to a temporary name in the same directory and are renamed into place, so a
reader sees either no file or a whole one.
"""
from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

MAGIC = b"MTPKVB01"
_HEADER = struct.Struct("<8sQQ16s")
HEADER_BYTES = _HEADER.size
_MASK = (1 << 64) - 1


def file_name(block_hash: int) -> str:
    return f"{block_hash & _MASK:016x}.kvb"


def hash_of_name(name: str) -> int | None:
    """The block hash a file name stands for (signed, as Python's hash() gives it)."""
    stem, dot, ext = name.partition(".")
    if ext != "kvb" or len(stem) != 16:
        return None
    try:
        h = int(stem, 16)
    except ValueError:
        return None
    return h - (1 << 64) if h >= 1 << 63 else h


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def write_block(path: str | os.PathLike[str], block_hash: int, payload: bytes | memoryview) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, block_hash & _MASK, len(payload), _digest(payload)))
            f.write(payload)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def read_block(path: str | os.PathLike[str], block_hash: int, payload_bytes: int) -> bytes | None:
    """The payload, or None when the file is missing or not exactly what was written."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if len(data) != HEADER_BYTES + payload_bytes:
        return None
    magic, h, n, digest = _HEADER.unpack_from(data)
    payload = data[HEADER_BYTES:]
    if magic != MAGIC or h != block_hash & _MASK or n != payload_bytes or _digest(payload) != digest:
        return None
    return payload
