"""The optional disk tier behind the host tier: one checksummed file per block.  No torch.

Files live in ``<kvPool disk_path>/<fingerprint>/``; the fingerprint names the model, the
block layout and the file format (kv/tiers.py), so a directory written for another
checkpoint, block size, cache dtype or format is never read.  Files are named by the
prefix cache's block keys (kvblock/key.py: SHA-256 chains, the same in every process),
so a restarted daemon finds the blocks an earlier one wrote: the directory is scanned
once at start.  A file holds its block's tokens and a hit compares them.

Policy (SGLang's "write through" for its storage tier): a block saved to the host tier
is also written to disk, so what left the device survives a restart.  The engine decides
every write here (``plan_write`` evicts the least recently used file past the size
bound) and the worker writes the file in that step (kvblock/file.py: atomic, checksummed).
Reads happen here, on the engine side, while a prefix is matched: a file is verified
before its block counts as a hit, and one that fails (torn, truncated, corrupted) is
deleted, counted and treated as a miss, so the block is recomputed, never served.
A block whose write is planned in the step being built is not on disk yet: a read of it
is a miss (``end_step`` ends that when the step message takes the writes).  An entry that
is not a regular file of the block file's size (a directory, a FIFO, a link to a large
file) is a damaged entry too: at start-up and on every read while serving it is
removed, logged and counted, never followed, never waited on (kvblock/file.py).
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

from server.kvblock.file import BadBlockFile, digest_of_name, file_bytes, file_name, load_block
from server.kvblock.key import BlockKey

log = logging.getLogger("server.engine")


class DiskTier:
    def __init__(self, directory: str | os.PathLike[str], capacity_blocks: int,
                 block_bytes: int, block_size: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"the disk KV tier needs room for one block ({block_bytes} bytes)")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.file_bytes = file_bytes(block_size, block_bytes)
        self._index: OrderedDict[bytes, None] = OrderedDict()      # digests, LRU: oldest first
        self.num_corrupt = 0          # files found damaged (deleted, never served)
        self.num_written = 0          # files the engine asked the worker to write
        self.num_read = 0             # verified reads (disk hits, in blocks)
        self._planned: set[bytes] = set()  # digests whose file the step being built writes
        self._scan()

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.startswith("."):                 # a write torn by a crash
                _remove(entry.path)
                continue
            h = digest_of_name(entry.name)
            if h is None:
                continue
            if not entry.is_file(follow_symlinks=False) or \
                    entry.stat(follow_symlinks=False).st_size != self.file_bytes:
                self._drop_corrupt(h, "not a regular file of a block file's size")
                continue
            found.append((entry.stat(follow_symlinks=False).st_mtime, h))
        for _, h in sorted(found):
            self._index[h] = None
        while len(self._index) > self.capacity_blocks:
            self._evict()
        if self._index or self.num_corrupt:
            log.info("disk KV tier %s: %d blocks found, %d damaged files removed", self.dir,
                     len(self._index), self.num_corrupt)

    # ---- figures --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def usage(self) -> float:
        return len(self._index) / self.capacity_blocks

    def path(self, key: BlockKey | bytes) -> str:
        return str(self.dir / file_name(key))

    # ---- reads (engine side) --------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return key.digest in self._index

    def read(self, key: BlockKey) -> bytes | None:
        """The verified payload of a block, or None (and the file is gone) when damaged."""
        h = key.digest
        if h not in self._index or h in self._planned:
            return None
        try:
            payload = load_block(self.path(h), key, self.block_bytes)
        except FileNotFoundError:      # removed behind our back: a plain miss
            del self._index[h]
            return None
        except BadBlockFile as exc:
            del self._index[h]
            self._drop_corrupt(h, str(exc))
            return None
        self._index.move_to_end(h)
        self.num_read += 1
        return payload

    def _drop_corrupt(self, digest: bytes, why: str) -> None:
        self.num_corrupt += 1
        log.warning("disk KV tier: %s is damaged; removed (%s; its block will be recomputed)",
                    file_name(digest), why)
        _remove(self.path(digest))

    # ---- writes (decided here, done by the worker) ------------------------------------
    def plan_write(self, key: BlockKey) -> str | None:
        """The path the worker writes the block to this step; None when it is on disk."""
        h = key.digest
        if h in self._index:
            self._index.move_to_end(h)
            return None
        while len(self._index) >= self.capacity_blocks:
            self._evict()
        self._index[h] = None
        self._planned.add(h)
        self.num_written += 1
        return self.path(h)

    def end_step(self) -> None:
        self._planned.clear()

    def _evict(self) -> None:
        h, _ = self._index.popitem(last=False)
        _remove(self.path(h))


def _remove(path: str) -> None:
    """Delete a block file; an entry that cannot be deleted (a directory put in its place,
    a read-only file) is logged and left: reads of it fail their check, writes to it fail
    and are logged, so it is a miss, never an engine error."""
    try:
        Path(path).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("disk KV tier: cannot remove %s: %s", path, exc)
