"""Admission control: at most ``maxLinkNum`` engine requests in flight, and a drain switch.

MindIE queues up to 2x maxLinkNum more requests before refusing; here the engine's own
waiting queue plays that role, so the HTTP layer only caps what it has accepted.  One
HTTP request holds one slot while its body is read; a request with ``n`` > 1 choices
takes ``n - 1`` more once the body says so (each choice is its own engine request), and
gives all of them back at once through its ``Ticket``.
"""
from __future__ import annotations

import asyncio

from server.web.errors import APIError

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.accepting = True
        self._idle = asyncio.Event()
        self._idle.set()

    def acquire(self, count: int = 1) -> None:
        """Take ``count`` slots at once or refuse with 503 (over capacity, or stopping)."""
        if not self.accepting:
            raise APIError(503, "The service has been stopped", retry=False)
        if self.in_flight + count > self.max_in_flight:
            what = "" if count == 1 else f" and this request needs {count} more (n)"
            raise APIError(503, f"Server is over capacity: {self.in_flight} requests in "
                           f"flight{what}, maxLinkNum is {self.max_in_flight}; retry later",
                           retry_after=RETRY_AFTER_S)
        self.in_flight += count
        if self.in_flight:
            self._idle.clear()

    def release(self, count: int = 1) -> None:
        self.in_flight = max(0, self.in_flight - count)
        if self.in_flight == 0:
            self._idle.set()

    def ticket(self) -> "Ticket":
        """One slot for a new HTTP request, as a ticket that can grow and frees all once."""
        self.acquire()
        return Ticket(self)

    def stop_accepting(self) -> None:
        self.accepting = False

    async def wait_idle(self) -> None:
        await self._idle.wait()


class Ticket:
    """The slots one HTTP request holds.  Calling it releases every slot, once; later calls
    do nothing, so every exit path (refusal, error, disconnect, normal end) may call it."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.held = 1

    def grow(self, count: int) -> None:
        """Take ``count`` more slots (503 when they are not free; the held ones stay held)."""
        if count <= 0:
            return
        if self.held == 0:
            raise RuntimeError("ticket already released")
        self.admission.acquire(count)
        self.held += count

    def __call__(self) -> None:
        held, self.held = self.held, 0
        if held:
            self.admission.release(held)
