"""P's side of the KV transfer: an asyncio TCP server on ``interCommPort`` (wire.py).

Each connection asks for one request's rows; they are sent from the rows' own buffer and
forgotten.  Unknown or expired ids get an error header (D then falls back to computing the
prompt itself).  With ``interCommTLSEnabled`` the server speaks TLS (1.2 or newer) with the
``interCommTls*`` certificate, and checks D's certificate against the CA files.

Limits, because the port is reachable by more than D: at most ``max_connections`` open at
once (more get a "busy" error header and are closed); the request line must arrive within
``read_timeout_s`` and fit ``MAX_HEADER`` bytes; the rows must leave within
``write_timeout_s`` (a reader that stops reading is cut off, and its rows are gone, so D
computes the prompt itself).  Any request that cannot be taken gets an error header and
one log line, never an unhandled exception.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from typing import Callable

from server.pd.kv_exports import KVExports
from server.pd.wire import MAX_HEADER, header_bytes, ok_header

log = logging.getLogger("server.pd")


class KVServer:
    def __init__(self, exports: KVExports, on_sent: Callable[[int], None] | None = None,
                 on_failed: Callable[[str], None] | None = None, *, max_connections: int = 64,
                 read_timeout_s: float = 30.0, write_timeout_s: float = 60.0) -> None:
        self.exports = exports
        self.on_sent = on_sent or (lambda n: None)
        self.on_failed = on_failed or (lambda why: None)
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self.num_open = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self, sock, ssl_ctx: ssl.SSLContext | None = None) -> None:
        self._server = await asyncio.start_server(self._serve, sock=sock, ssl=ssl_ctx,
                                                  limit=MAX_HEADER)

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      reason: str, message: str) -> None:
        """Send an error header, then read what the peer still sends for a moment: closing
        with unread bytes resets the connection, and the reset can overtake the header."""
        self.on_failed(reason)
        writer.write(header_bytes({"status": "error", "error": message}))
        await asyncio.wait_for(writer.drain(), timeout=self.write_timeout_s)
        if writer.can_write_eof():
            writer.write_eof()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(0.5):
                while await reader.read(1 << 16):
                    pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_open += 1
        try:
            if self.num_open > self.max_connections:
                await self._refuse(reader, writer, "busy", f"the KV port has "
                                   f"{self.max_connections} connections open; retry later")
                return
            await self._answer(reader, writer)
        except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            log.warning("KV transfer connection failed: %s", exc or type(exc).__name__)
            self.on_failed("connection")
        except Exception as exc:       # noqa: BLE001 - one connection's fault, logged once
            log.warning("KV transfer connection failed: %r", exc)
            self.on_failed("connection")
        finally:
            self.num_open -= 1
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), timeout=1)
            except Exception:          # noqa: BLE001 - the peer is gone already
                writer.transport.abort()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=self.read_timeout_s)
            req = json.loads(line)
            rid = str(req["request_id"])
            if req.get("op") != "pull":
                raise ValueError(f"op {req.get('op')!r}")
        except asyncio.TimeoutError:
            await self._refuse(reader, writer, "bad_request",
                               f"no request line within {self.read_timeout_s:g} s")
            return
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError,
                asyncio.LimitOverrunError) as exc:
            # ValueError covers a line over MAX_HEADER bytes (asyncio's readline) and JSON
            # that does not parse; RecursionError deeply nested JSON.
            await self._refuse(reader, writer, "bad_request", f"bad request: {str(exc)[:200]}")
            return
        rows = self.exports.take(rid)
        if rows is None:
            await self._refuse(reader, writer, "unknown_request",
                               f"no KV held for request {rid[:200]} (unknown, already pulled "
                               "or expired)")
            return
        try:
            writer.write(ok_header(rows))
            writer.write(memoryview(rows.payload))
            await asyncio.wait_for(writer.drain(), timeout=self.write_timeout_s)
        except asyncio.TimeoutError:
            log.warning("KV transfer of %s cut: not read within %g s", rid, self.write_timeout_s)
            self.on_failed("write_timeout")
            writer.transport.abort()
            return
        finally:
            self.exports.done_sending(rows)
        self.on_sent(len(rows.payload))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
