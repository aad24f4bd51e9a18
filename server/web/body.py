"""Read and decode a JSON body ourselves: 413 over maxRequestLength, 408 when it is slow,
400 for bad JSON.

FastAPI's own body parsing would answer malformed JSON with 422 and has no size cap.  The
whole body must arrive within ``clientBodyTimeout`` seconds of the headers: a client that
declares ``Content-Length: 1000`` and sends 12 bytes otherwise holds its connection (and,
before slots were taken after the body, a ``maxLinkNum`` slot) for ever.  A large body
is decoded off the event loop (``offload``).
"""
from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import Request

from server.web.errors import APIError
from server.web.offload import INLINE_BYTES, TRIM_BYTES, off_loop, trim_soon


async def read_json(request: Request, limit: int, timeout_s: float = 30.0) -> tuple[Any, int]:
    """(the decoded body, its size in bytes): the size tells the handler whether planning
    the request may run on the event loop (``offload.PLAN_INLINE_BYTES``)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds maxRequestLength "
                       f"({limit} bytes)")
    try:
        body = await asyncio.wait_for(_read(request, limit), timeout=timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"request body not received within {timeout_s:g} s "
                       "(clientBodyTimeout)", retry=False) from None
    if len(body) > TRIM_BYTES:
        trim_soon()
    if not body.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        if len(body) <= INLINE_BYTES:
            return orjson.loads(body), len(body)
        return await off_loop(orjson.loads, body), len(body)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None


async def _read(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            chunks.clear()
            if size > TRIM_BYTES:      # give back what the refused chunks took
                trim_soon()
            raise APIError(413, f"request body exceeds maxRequestLength ({limit} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)
