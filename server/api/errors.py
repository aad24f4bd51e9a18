"""The daemon's exception handlers: every failure answered in the shapes of
server/web/errors.py, OpenAI's on ``/v1/*`` and MindIE's on the native endpoints.

A ``PDError`` (server/pd/errors.py) becomes the ``APIError`` of its status (``api_error``);
the serving layer converts it where PD is called (serving/pd_calls.py), the handler here is
for one that escapes elsewhere.  FastAPI's 422 never reaches a client.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from server.web.errors import APIError, error_response, native_path
from server.pd.errors import PDError


def api_error(exc: PDError) -> APIError:
    """The APIError a client sees for ``exc``: its status, message, parameter and, on a
    503, when to retry (``Retry-After``)."""
    return APIError(exc.status, exc.message, exc.param, retry_after=exc.retry_after)


def _is_native(request: Request) -> bool:
    return native_path(request.url.path)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    first = errs[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    return f"{param or 'request'}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app) -> None:
    """Route every failure through our shapes; FastAPI's 422 never reaches a client."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        resp = error_response(exc.status, exc.message, exc.param,
                              native=_is_native(request), retry_after=exc.retry_after,
                              retry=exc.retry)
        if exc.status in (408, 413):   # the body was not read to its end: end the connection
            resp.headers["connection"] = "close"
        return resp

    @app.exception_handler(PDError)
    async def _pd_error(request: Request, exc: PDError) -> Response:
        return await _api_error(request, api_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return error_response(400, message, param, native=_is_native(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), native=_is_native(request))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}",
                              native=_is_native(request))
