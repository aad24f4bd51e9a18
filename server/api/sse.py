"""JSON responses, and server-sent-events framing as the openai SDK parses it:
``data: <json>\\n\\n`` then ``[DONE]``."""
from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")
