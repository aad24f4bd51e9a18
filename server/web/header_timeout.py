"""uvicorn's h11 protocol with a deadline for request headers.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but a client
that keeps sending one byte of its headers now and then resets that timer and can hold
a connection (and a file descriptor) for ever; one that connects and sends nothing is
never timed out at all.  Here every wait for a request's headers, on a new connection or
between keep-alive requests, has a fixed deadline (``clientHeaderTimeout``) that data
does not extend: when it passes before the headers are complete, the client gets
``408 Request Timeout`` and the connection is closed.  The body has its own deadline,
applied where it is read (``body.py``).

The 408 is JSON in the shape of the endpoint the request line names, when it arrived
(errors.py: OpenAI's on /v1, MindIE's on the native endpoints); OpenAI's otherwise.
"""
from __future__ import annotations

import asyncio
import re
from typing import Any, Callable
from urllib.parse import urlsplit

import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.web.errors import mindie_body, native_path, openai_body

_HEAD_KEPT = 2048                     # enough of the head for its request line
_REQUEST_LINE = re.compile(rb"^\s*[A-Z]+ (\S+) ")


def timeout_response(head: bytes, timeout_s: float,
                     native: Callable[[str], bool] = native_path) -> bytes:
    """The whole 408 for a request whose first bytes were ``head``."""
    message = f"request headers not received within {timeout_s:g} s (clientHeaderTimeout)"
    line = _REQUEST_LINE.match(head)
    path = urlsplit(line.group(1).decode("latin-1")).path if line else ""   # absolute form too
    body = orjson.dumps(mindie_body(408, message) if path and native(path)
                        else openai_body(408, message))
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


def header_timeout_protocol(timeout_s: float, native: Callable[[str], bool] = native_path
                            ) -> type[H11Protocol]:
    """An H11Protocol class whose connections must send each request's headers within
    ``timeout_s`` seconds of the connection opening or of the previous response.
    ``native``: whether a path's errors take MindIE's shape (the coordinator's never do)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _timed_cycle: Any = None
        _head = b""

        def _arm(self) -> None:
            self._disarm()
            self._head = b""
            self._timed_cycle = self.cycle
            self._header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if self.transport.is_closing() or self.cycle is not self._timed_cycle or not waiting:
                return
            self.transport.write(timeout_response(self._head, timeout_s, native))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is not None and len(self._head) < _HEAD_KEPT:
                self._head += data[:_HEAD_KEPT - len(self._head)]
            super().data_received(data)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self._header_timer is not None and self.cycle is not self._timed_cycle:
                self._disarm()           # a new request's headers arrived

        def on_response_complete(self) -> None:
            done = self.cycle
            super().on_response_complete()
            # Waiting for the next keep-alive request (unless a pipelined one just started).
            if not self.transport.is_closing() and self.cycle is done:
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
