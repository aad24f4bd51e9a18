"""The KV transfer's wire format (version 1), D pulling from P over one TCP connection.

A block travels as one row of bytes: for every cache layer, the main layers' and the MTP
layer's, every tensor its cache stores per block (float rows; or int8 latent, float32
scale and RoPE rows) laid end to end: the row the host tier and the disk tier hold
(engine/kv/transfer/host_pool.py), so a block moves whole whatever its dtype.

    D -> P   one line of JSON:  {"op": "pull", "version": 1, "request_id": "<P's id>"}\\n
    P -> D   4-byte big-endian length L, L bytes of JSON header, then the payload:
             {"status": "ok", "num_blocks": n, "bytes_per_block": b, "layout": "...",
              "sha256": "<hex of the payload>", "block_digests": ["<hex>", ...]}
                                                     followed by n * b bytes, block 0 first
             {"status": "error", "error": "..."}    and no payload

``layout`` names what the rows hold (cache layers, block size, bytes per block, cache
dtype, and the weights that computed them: server/config/checkpoint/fingerprint.py): D refuses rows
whose layout is not its own (rows of another checkpoint of the same shape are wrong
answers with HTTP 200), and a payload whose digest does not match.  ``block_digests``
name the prompt tokens each block was computed for, keyed with the transfer key
(trust.py): D uses only the leading blocks whose digests equal its own prompt's.  The
payload is sent from the rows' own buffer (no copy on P's side).  P reads at most ``MAX_HEADER`` bytes of
request line and answers anything else with an error header.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import struct
from dataclasses import dataclass

VERSION = 1
MAX_HEADER = 1 << 16


class TransferError(RuntimeError):
    """The pull failed: the peer is gone, timed out, refused, or sent something broken."""


@dataclass(frozen=True, slots=True)
class KVRows:
    """The full prompt blocks of one request, in block order."""
    num_blocks: int
    bytes_per_block: int
    layout: str
    payload: bytes
    digests: tuple[str, ...] = ()    # per block: the tokens it was computed for (trust.py)

    def rows(self) -> tuple[bytes, ...]:
        b = self.bytes_per_block
        return tuple(self.payload[i * b:(i + 1) * b] for i in range(self.num_blocks))


def layout_of(num_kv_layers: int, block_size: int, bytes_per_block: int, kv_dtype: str,
              model: str) -> str:
    """``model``: the weights' fingerprint (server/config/checkpoint/fingerprint.py)."""
    return (f"v{VERSION};layers={num_kv_layers};block={block_size};bytes={bytes_per_block};"
            f"kv={kv_dtype};model={model}")


def layout_fields(layout: str) -> dict[str, str]:
    """``layout_of``'s fields by name (a peer's layout may be anything: unknown parts are
    left out)."""
    return dict(part.split("=", 1) for part in layout.split(";") if "=" in part)


def pull_line(request_id: str) -> bytes:
    return (json.dumps({"op": "pull", "version": VERSION, "request_id": request_id}) + "\n").encode()


def header_bytes(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack(">I", len(raw)) + raw


def ok_header(rows: KVRows) -> bytes:
    return header_bytes({"status": "ok", "num_blocks": rows.num_blocks,
                         "bytes_per_block": rows.bytes_per_block, "layout": rows.layout,
                         "sha256": hashlib.sha256(rows.payload).hexdigest(),
                         "block_digests": list(rows.digests)})


async def read_response(reader: asyncio.StreamReader) -> KVRows:
    try:
        (size,) = struct.unpack(">I", await reader.readexactly(4))
        if size > MAX_HEADER:
            raise TransferError(f"KV transfer header of {size} bytes")
        header = json.loads(await reader.readexactly(size))
        if header.get("status") != "ok":
            raise TransferError(f"the prefill instance refused: {header.get('error', header)}")
        n, b = int(header["num_blocks"]), int(header["bytes_per_block"])
        digests = header.get("block_digests", [])
        if n < 0 or b < 0 or not isinstance(digests, list) or \
                not all(isinstance(d, str) for d in digests):
            raise ValueError("num_blocks, bytes_per_block or block_digests")
        payload = await reader.readexactly(n * b)
    except asyncio.IncompleteReadError as exc:
        raise TransferError(f"the connection closed after {len(exc.partial)} bytes of a KV "
                            "transfer") from None
    except (ValueError, KeyError, TypeError, RecursionError, AttributeError) as exc:
        raise TransferError(f"malformed KV transfer header: {exc}") from None
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise TransferError("KV transfer payload does not match its sha256")
    return KVRows(n, b, str(header.get("layout")), payload, tuple(digests))
