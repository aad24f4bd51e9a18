"""One request's trip through the engine: timeouts, disconnects, abort, metrics.

A pump task copies the engine's stream into a queue so that waiting can time out or
notice a disconnect without cancelling the engine's own generator; on any early exit we
call ``engine.abort`` once, which frees the request's KV at the next step boundary.

A request failed because the engine is gone for good (a rank or the engine process died
or hung: ``engine.fatal_error``) is a 503, as ``/health`` says by then: the daemon exits
a few seconds later and a client should go elsewhere.  Before, the requests that arrived
in those seconds got 500.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from server.engine.protocol import EngineOutput, EngineRequest, FinishReason
from server.web.errors import APIError

log = logging.getLogger("server.api")
_DISCONNECT_POLL_S = 0.02
_END = object()


class ClientDisconnected(Exception):
    """The client went away; the request was aborted and nobody reads the answer."""


class RequestTimeout(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(504, message, retry=False)


def engine_gone(fatal: str) -> APIError:
    """The refusal of a request the failed engine could not serve (module docstring)."""
    return APIError(503, f"the engine failed ({fatal}); this server is stopping", retry=False)


class EngineCall:
    """Async iterator over EngineOutput with tokenTimeout / e2eTimeout / disconnect aborts."""

    def __init__(self, engine: Any, request: EngineRequest, metrics: Any, *,
                 token_timeout_s: float, e2e_timeout_s: float,
                 is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> None:
        self.engine = engine
        self.request = request
        self.metrics = metrics
        self.token_timeout_s = token_timeout_s
        self.e2e_timeout_s = e2e_timeout_s
        self.is_disconnected = is_disconnected
        self.finished = False
        self.last: EngineOutput | None = None
        self.num_tokens = 0
        self._aborted = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pump: asyncio.Task | None = None
        self._spec = (0, 0, 0)
        self._prediction = (0, 0)
        self._reported = False

    async def _run_pump(self) -> None:
        try:
            async for out in self.engine.submit(self.request):
                self._queue.put_nowait(out)
        except Exception as exc:  # engine failure: surface it to the consumer
            self._queue.put_nowait(exc)
        finally:
            self._queue.put_nowait(_END)

    def close(self) -> None:
        """Abort unless finished.  Callers call this in ``finally``: leaving an ``async for``
        early does not close the inner generator, whose own ``finally`` would then run only
        when it is garbage-collected."""
        self.abort("stream closed early")
        self._report(self.finished and self.last is not None and self.last.finish_reason
                     not in (FinishReason.ERROR, FinishReason.ABORT))

    def _report(self, ok: bool) -> None:
        if self._reported:
            return
        self._reported = True
        req = self.request
        c = self.last.counters if self.last else None
        self.metrics.on_finished(ok, c.prompt_tokens if c else len(req.prompt_token_ids),
                                 self.num_tokens, time.monotonic() - req.arrival_time,
                                 c.num_preemptions if c else 0)

    def abort(self, why: str) -> None:
        if not self._aborted and not self.finished:
            self._aborted = True
            log.info("abort %s: %s", self.request.request_id, why)
            self.engine.abort(self.request.request_id)

    async def _next(self, deadline: float, last_time: float) -> Any:
        while True:
            now = time.monotonic()
            limit = min(deadline, last_time + self.token_timeout_s)
            if now >= limit:
                which = ("e2eTimeout", self.e2e_timeout_s) if deadline <= limit else \
                        ("tokenTimeout", self.token_timeout_s)
                self.abort(which[0])
                raise RequestTimeout(f"request {self.request.request_id} aborted: "
                                     f"{'no new token for' if which[0] == 'tokenTimeout' else 'not finished within'} "
                                     f"{which[1]:g} s ({which[0]}); its KV cache was freed")
            wait = limit - now
            if self.is_disconnected is not None:
                wait = min(wait, _DISCONNECT_POLL_S)
            try:
                return await asyncio.wait_for(self._queue.get(), timeout=wait)
            except asyncio.TimeoutError:
                if self.is_disconnected is not None and await self.is_disconnected():
                    self.abort("client disconnected")
                    raise ClientDisconnected(self.request.request_id)

    async def __aiter__(self) -> AsyncIterator[EngineOutput]:
        req = self.request
        if not req.arrival_time:
            req.arrival_time = time.monotonic()
        start = req.arrival_time
        deadline = start + self.e2e_timeout_s
        last_time = time.monotonic()
        self._pump = asyncio.create_task(self._run_pump())
        ok = False
        try:
            while True:
                item = await self._next(deadline, last_time)
                if item is _END:
                    break
                if isinstance(item, Exception):
                    raise APIError(500, f"engine failure: {item}")
                now = time.monotonic()
                self._observe(item, now, last_time, start)
                last_time = now
                self.last = item
                if item.finished:
                    self.finished = True
                    ok = item.finish_reason not in (FinishReason.ERROR, FinishReason.ABORT)
                    fatal = self.engine.fatal_error
                    if item.finish_reason == FinishReason.ERROR and fatal and not item.error_param:
                        raise engine_gone(fatal)
                yield item
                if self.finished:
                    break
            if not self.finished:
                raise APIError(500, "the engine ended the stream without a final output")
        finally:
            if not self.finished:
                self.abort("stream closed early")
            self._report(ok)

    def _observe(self, out: EngineOutput, now: float, prev: float, start: float) -> None:
        n = len(out.token_ids)
        c = out.counters
        if self.num_tokens == 0 and n:
            first = out.first_token_time or now
            self.metrics.on_first_token(max(0.0, first - start), c.prompt_tokens
                                        or len(self.request.prompt_token_ids), c.cached_tokens)
        elif n:
            self.metrics.on_step(now - prev, n)
        self.num_tokens += n
        self.metrics.on_tokens(n)
        spec = (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens)
        self.metrics.on_spec(*(a - b for a, b in zip(spec, self._spec)))
        self._spec = spec
        pred = (c.num_prediction_tokens, c.num_accepted_prediction_tokens)
        if pred != self._prediction:
            self.metrics.on_prediction(*(a - b for a, b in zip(pred, self._prediction)))
            self._prediction = pred


def engine_failure(out: EngineOutput | None, prompt_param: str = "prompt") -> APIError | None:
    """The error to report for a final output that did not finish normally: a 400 naming
    the parameter when the engine refused a request it can never serve as asked (the
    engine's "prompt" is the route's ``prompt_param``), a 500 for an engine fault."""
    if out is None:
        return None
    if out.finish_reason == FinishReason.ERROR and out.error_param:
        param = prompt_param if out.error_param == "prompt" else out.error_param
        return APIError(400, out.error or "the engine refused the request", param)
    if out.finish_reason == FinishReason.ERROR:
        return APIError(500, f"generation failed: {out.error or 'engine error'}")
    if out.finish_reason == FinishReason.ABORT:
        return APIError(503, f"request aborted by the server: {out.error or 'shutting down'}")
    return None


async def close_stream(body: Any, calls: list, release: Callable[[], None]) -> None:
    """After an SSE response, even one cut by a disconnect: close the body generator (it may
    be suspended at a ``yield`` that will never resume), abort unfinished requests, free the
    admission slot."""
    try:
        await body.aclose()
    finally:
        for call in calls:
            if call is not None:
                call.close()
        release()
