"""P's side of the KV transfer: an asyncio TCP server on ``interCommPort`` (wire.py).

Each connection asks for one request's rows; they are sent from the rows' own buffer and
forgotten.  Unknown or expired ids get an error header (D then falls back to computing the
prompt itself).  With ``interCommTLSEnabled`` the server speaks TLS (1.2 or newer) with the
``interCommTls*`` certificate, and checks D's certificate against the CA files.
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
from typing import Callable

from server.pd.kv_exports import KVExports
from server.pd.wire import MAX_HEADER, header_bytes, ok_header

log = logging.getLogger("server.pd")


class KVServer:
    def __init__(self, exports: KVExports, on_sent: Callable[[int], None] | None = None,
                 on_failed: Callable[[str], None] | None = None) -> None:
        self.exports = exports
        self.on_sent = on_sent or (lambda n: None)
        self.on_failed = on_failed or (lambda why: None)
        self._server: asyncio.AbstractServer | None = None

    async def start(self, sock, ssl_ctx: ssl.SSLContext | None = None) -> None:
        self._server = await asyncio.start_server(self._serve, sock=sock, ssl=ssl_ctx,
                                                  limit=MAX_HEADER)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=30)
            try:
                req = json.loads(line)
                rid = str(req["request_id"])
                if req.get("op") != "pull":
                    raise ValueError(f"op {req.get('op')!r}")
            except (ValueError, KeyError, TypeError) as exc:
                writer.write(header_bytes({"status": "error", "error": f"bad request: {exc}"}))
                self.on_failed("bad_request")
                return
            rows = self.exports.take(rid)
            if rows is None:
                writer.write(header_bytes({"status": "error",
                                           "error": f"no KV held for request {rid} (unknown, "
                                                    "already pulled or expired)"}))
                self.on_failed("unknown_request")
                return
            writer.write(ok_header(rows))
            writer.write(memoryview(rows.payload))
            await writer.drain()
            self.on_sent(len(rows.payload))
        except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            log.warning("KV transfer connection failed: %s", exc)
            self.on_failed("connection")
        finally:
            try:
                writer.close()
                await writer.wait_closed()
            except Exception:          # noqa: BLE001 - the peer is gone already
                pass

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
