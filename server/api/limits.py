"""Admission control: at most ``maxLinkNum`` requests in flight, and a drain switch.

MindIE queues up to 2x maxLinkNum more requests before refusing; here the engine's own
waiting queue plays that role, so the HTTP layer only caps what it has accepted.
"""
from __future__ import annotations

import asyncio

from server.api.errors import APIError

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.accepting = True
        self._idle = asyncio.Event()
        self._idle.set()

    def acquire(self) -> None:
        """Take a slot or refuse with 503 (over capacity, or the service is stopping)."""
        if not self.accepting:
            raise APIError(503, "The service has been stopped", retry=False)
        if self.in_flight >= self.max_in_flight:
            raise APIError(503, f"Server is over capacity: {self.in_flight} requests in "
                           f"flight, maxLinkNum is {self.max_in_flight}; retry later",
                           retry_after=RETRY_AFTER_S)
        self.in_flight += 1
        self._idle.clear()

    def release(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        if self.in_flight == 0:
            self._idle.set()

    def stop_accepting(self) -> None:
        self.accepting = False

    async def wait_idle(self) -> None:
        await self._idle.wait()
