"""Read and decode a JSON body ourselves: 413 over maxRequestLength, 400 for bad JSON.

FastAPI's own body parsing would answer malformed JSON with 422 and has no size cap.
"""
from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request

from server.api.errors import APIError


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds maxRequestLength "
                       f"({limit} bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds maxRequestLength ({limit} bytes)")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
