"""uvicorn's h11 protocol with a deadline for request headers.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but a client
that keeps sending one byte of its headers now and then resets that timer and can hold
a connection (and a file descriptor) for ever; one that connects and sends nothing is
never timed out at all.  Here every wait for a request's headers, on a new connection or
between keep-alive requests, has a fixed deadline (``clientHeaderTimeout``) that data
does not extend: when it passes before the headers are complete, the client gets
``408 Request Timeout`` and the connection is closed.  The body has its own deadline,
applied where it is read (``body.py``).
"""
from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"connection: close\r\ncontent-length: 50\r\n\r\n"
        b"request headers not received within the time limit")


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class whose connections must send each request's headers within
    ``timeout_s`` seconds of the connection opening or of the previous response."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _timed_cycle: Any = None

        def _arm(self) -> None:
            self._disarm()
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
            self.transport.write(_408)
            self.transport.close()

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
