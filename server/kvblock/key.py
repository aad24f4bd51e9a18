"""The key of one full prefix block: a SHA-256 chain over the blocks' tokens.  No torch.

A block's key names it in the device prefix cache, the host tier and the disk tier (its
file name), and is the parent of the next block's key.  It used to be Python's
``hash((parent, next_token, tokens))``: 64 bits, unkeyed, and a hit was taken on the hash
alone, so two prompts whose hashes met would share KV rows (vLLM moved from the same
construction to SHA-256 for that reason: GHSA-rm76-4mrf-v9r8).  Now:

  content = parent digest (32 bytes; zeros for the first block)
            | next token (int64; -1 without MTP-aware hashing)
            | the block's tokens (int64 each)
  digest  = SHA-256(domain tag | content)

and a ``BlockKey`` compares equal only when digest *and* content are equal, so a dict
lookup (device cache, host tier) compares the block's tokens, its next token and its
parent's digest, not the digest alone; the disk tier stores the content in each file and
compares it too (kvblock/file.py).  The parent digest in the content chains the whole
prefix: a block matches only when every block before it matched.

The next token is there because, with MTP, the MTP layer's KV at a block's last slot is
computed from the first token of the next block (kv/block_manager.py).

Cost: one ``array('q', ...)`` of the block's tokens and one SHA-256 of ``40 + 8 *
block_size`` bytes per block (about 1-2 us for 16-128 tokens), never per token.
Digests are the same in every process, so a restarted daemon finds its disk files.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Sequence

DIGEST_BYTES = 32
ROOT = bytes(DIGEST_BYTES)              # the parent of a prompt's first block
_NEXT = struct.Struct("<q")
_DOMAIN = hashlib.sha256(b"mtp-serve prefix block key v1\0")   # copied per block


def content_bytes(block_size: int) -> int:
    """Bytes of one block's content (what a disk file stores besides its rows)."""
    return DIGEST_BYTES + _NEXT.size + 8 * block_size


@dataclass(frozen=True, slots=True, eq=False)
class BlockKey:
    digest: bytes                        # SHA-256 of the tag and content (32 bytes)
    content: bytes                       # parent digest | next token | tokens (module doc)

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockKey) and self.digest == other.digest \
            and self.content == other.content

    @property
    def hex(self) -> str:
        return self.digest.hex()


def digest_of(content: bytes) -> bytes:
    h = _DOMAIN.copy()
    h.update(content)
    return h.digest()


def block_key(parent: BlockKey | None, tokens: Sequence[int], next_token: int | None) -> BlockKey:
    """The key of a block of ``tokens`` after ``parent`` (None: the prompt's first block),
    followed by ``next_token`` (None: not part of the key)."""
    toks = array("q", tokens)
    if sys.byteorder == "big":          # little-endian everywhere, as the digest's docs say
        toks.byteswap()
    content = (ROOT if parent is None else parent.digest) + \
        _NEXT.pack(-1 if next_token is None else next_token) + toks.tobytes()
    return BlockKey(digest_of(content), content)
