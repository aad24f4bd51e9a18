"""Error shapes and the exception that carries them, for the daemon (server/api) and the
PD coordinator (server/pd/coordinator) alike.

Two shapes, because two kinds of client read them:
  /v1/*  (OpenAI SDK, LangChain)  {"error": {"message", "type", "param", "code"}}
  native endpoints (MindIE tools)  {"error": "<message>", "error_type": "<MindIE type>"}
The openai SDK picks its exception class from the HTTP status only, so the status is
what must be right; ``type`` uses OpenAI's categories and ``code`` the status number.
The daemon's exception handlers, which pick the shape by path, are server/api/errors.py.
"""
from __future__ import annotations

from http import HTTPStatus

import orjson
from starlette.responses import Response

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
}

# MindIE's WrapperJson status -> error_type table (reference mindie.md 4.2).
_MINDIE_TYPES = {
    400: "Bad Request",
    404: "NotFoundError",
    413: "Bad Request",
    422: "Input Validation Error",
    424: "Generation Error",
    500: "Incomplete Generation",
    503: "Service Unavailable",
}


class APIError(Exception):
    """A refusal with everything a client needs: status, message, offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 retry_after: int | None = None, retry: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.retry = retry            # x-should-retry for the openai SDK; None: its default


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def native_path(path: str) -> bool:
    """Whether a path is a native (MindIE-shaped) endpoint rather than an OpenAI one."""
    return not path.startswith("/v1/") or path in ("/v1/config", "/v1/status")


def openai_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message,
                      "type": _OPENAI_TYPES.get(status, HTTPStatus(status).phrase),
                      "param": param, "code": status}}


def mindie_body(status: int, message: str) -> dict:
    return {"error": message,
            "error_type": _MINDIE_TYPES.get(status, HTTPStatus(status).phrase)}


def error_response(status: int, message: str, param: str | None = None, *,
                   native: bool = False, retry_after: int | None = None,
                   retry: bool | None = None) -> Response:
    body = mindie_body(status, message) if native else openai_body(status, message, param)
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if retry is not None:
        headers["x-should-retry"] = "true" if retry else "false"
    return Response(orjson.dumps(body), status_code=status, media_type="application/json",
                    headers=headers)
