"""The open requests of an engine front, one asyncio queue each (no torch here: the
serving process of engine_process.py uses it without importing torch)."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from server.engine.protocol import EngineOutput, EngineRequest


class OutputStreams:
    """The open requests of an engine front: one asyncio queue each, filled from the
    engine's side (``put_threadsafe``) or from the event loop (``put``)."""

    def __init__(self) -> None:
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    def ids(self) -> list[str]:
        return list(self._queues)

    def __len__(self) -> int:            # safe from another thread (a watchdog's)
        return len(self._queues)

    async def open(self, req: EngineRequest, start: Any, abort: Any) -> AsyncIterator[EngineOutput]:
        """Register ``req``, ``start(q)`` it, then yield its outputs (an exception put
        in the queue is raised) until the finished one; leaving early calls ``abort``."""
        if not req.arrival_time:
            req.arrival_time = time.monotonic()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            start(q)
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    break
        finally:
            self._queues.pop(req.request_id, None)
            if not finished:
                abort(req.request_id)

    def put(self, request_id: str, item: Any) -> None:
        """On the event loop: ``item`` (an EngineOutput or an exception) to that stream."""
        stream = self._queues.get(request_id)
        if stream is not None:
            stream[1].put_nowait(item)

    def put_threadsafe(self, request_id: str, item: Any) -> None:
        """The same, from another thread."""
        stream = self._queues.get(request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)
