"""The optional disk tier behind the host tier: one checksummed file per block.  No torch.

Files live in ``<kvPool disk_path>/<fingerprint>/``; the fingerprint names the model and
the block layout (engine/core.py), so a directory written for another checkpoint, block
size or cache dtype is never read.  Block hashes are the prefix cache's chain hashes
(kv/block_manager.py), which are stable across processes, so a restarted daemon finds the
blocks an earlier one wrote: the directory is scanned once at start.

Policy (SGLang's "write through" for its storage tier): a block saved to the host tier
is also written to disk, so what left the device survives a restart.  The engine decides
every write here (``plan_write`` evicts the least recently used file past the size
bound) and the worker writes the file in that step (kv/block_file.py: atomic, checksummed).
Reads happen here, on the engine side, while a prefix is matched: a file is verified
before its block counts as a hit, and one that fails (torn, truncated, corrupted) is
deleted, counted and treated as a miss, so the block is recomputed, never served.
A block whose write is planned in the step being built is not on disk yet: a read of it
is a miss (``end_step`` ends that when the step message takes the writes).  A path that
is not a regular file (a directory, say) is a damaged entry too: skipped, never fatal.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

from server.engine.kv.block_file import HEADER_BYTES, file_name, hash_of_name, read_block

log = logging.getLogger("server.engine")


class DiskTier:
    def __init__(self, directory: str | os.PathLike[str], capacity_blocks: int,
                 block_bytes: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"the disk KV tier needs room for one block ({block_bytes} bytes)")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self._index: OrderedDict[int, None] = OrderedDict()        # LRU: oldest first
        self.num_corrupt = 0          # files found damaged (deleted, never served)
        self.num_written = 0          # files the engine asked the worker to write
        self.num_read = 0             # verified reads (disk hits, in blocks)
        self._planned: set[int] = set()   # hashes whose file the step being built writes
        self._scan()

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.startswith("."):                 # a write torn by a crash
                Path(entry.path).unlink(missing_ok=True)
                continue
            h = hash_of_name(entry.name)
            if h is None:
                continue
            if not entry.is_file(follow_symlinks=False) or \
                    entry.stat().st_size != HEADER_BYTES + self.block_bytes:
                self._drop_corrupt(h)
                continue
            found.append((entry.stat().st_mtime, h))
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

    def path(self, block_hash: int) -> str:
        return str(self.dir / file_name(block_hash))

    # ---- reads (engine side) --------------------------------------------------------
    def contains(self, block_hash: int) -> bool:
        return block_hash in self._index

    def read(self, block_hash: int) -> bytes | None:
        """The verified payload of a block, or None (and the file is gone) when damaged."""
        if block_hash not in self._index or block_hash in self._planned:
            return None
        payload = read_block(self.path(block_hash), block_hash, self.block_bytes)
        if payload is None:
            del self._index[block_hash]
            if Path(self.path(block_hash)).exists():
                self._drop_corrupt(block_hash)
            return None
        self._index.move_to_end(block_hash)
        self.num_read += 1
        return payload

    def _drop_corrupt(self, block_hash: int) -> None:
        self.num_corrupt += 1
        log.warning("disk KV tier: %s is damaged; removed (its block will be recomputed)",
                    file_name(block_hash))
        _remove(self.path(block_hash))

    # ---- writes (decided here, done by the worker) ------------------------------------
    def plan_write(self, block_hash: int) -> str | None:
        """The path the worker writes the block to this step; None when it is on disk."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return None
        while len(self._index) >= self.capacity_blocks:
            self._evict()
        self._index[block_hash] = None
        self._planned.add(block_hash)
        self.num_written += 1
        return self.path(block_hash)

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
