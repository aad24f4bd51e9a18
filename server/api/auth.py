"""API keys for the business plane and the guard on state-changing management calls.

Keys come from ``ServerConfig.apiKeys`` and ``$MTP_SERVE_API_KEY`` (comma-separated), read
once at load (docs/config.md).  A request carries one as ``Authorization: Bearer <key>``,
the header the openai SDK sends for ``api_key``.  Every configured key is compared, each
with ``hmac.compare_digest``, so the time taken says nothing about which key or how many
leading bytes matched.  With no key configured every request passes (the loopback default).

Management calls that change state (``POST /stopService``) are also refused when the
request comes from a browser page of another origin: a page can send a cross-origin POST
without reading the answer, and before this guard ``GET /stopService`` from any web page
stopped the daemon.
"""
from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from fastapi import Request

from server.api.errors import APIError


class ApiKeys:
    """The configured keys (may be none: then ``check`` lets everything through)."""

    def __init__(self, keys: tuple[str, ...] = ()) -> None:
        self._keys = tuple(k.encode() for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def matches(self, authorization: str | None) -> bool:
        """True when the header is ``Bearer <one of the keys>``."""
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = token.strip().encode("utf-8", "surrogateescape")
        found = False
        for key in self._keys:           # no early exit: every key is compared
            found |= hmac.compare_digest(key, given)
        return found

    def check(self, request: Request) -> None:
        """Raise 401 (OpenAI shape on /v1) unless no key is configured or one matches."""
        if self._keys and not self.matches(request.headers.get("authorization")):
            raise APIError(401, "Incorrect or missing API key: send it as "
                           "'Authorization: Bearer <key>'", retry=False)


def same_origin(request: Request) -> bool:
    """False for a browser request sent by a page of another origin.

    Browsers send ``Origin`` on cross-origin POSTs and ``Sec-Fetch-Site`` on every request;
    tools such as curl send neither, and are let through.  An ``Origin`` must name the
    address the request was sent to (``Host``), scheme aside."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None:
        return True
    try:
        netloc = urlsplit(origin).netloc
    except ValueError:
        return False
    return bool(netloc) and netloc.lower() == request.headers.get("host", "").lower()


def guard_state_change(request: Request, keys: ApiKeys) -> None:
    """For management calls that change state: 403 cross-origin, 401 without the key."""
    if not same_origin(request):
        raise APIError(403, "cross-origin requests may not change the service's state")
    keys.check(request)
