"""API keys: the business plane's (server/api/planes/business.py) and the coordinator's.

Keys come from ``ServerConfig.apiKeys`` and ``$MTP_SERVE_API_KEY`` (comma-separated), read
once at load (docs/config.md), or the coordinator's ``apiKey``.  A request carries one as
``Authorization: Bearer <key>``, the header the openai SDK sends for ``api_key``.  Every
configured key is compared, each with ``hmac.compare_digest``, so the time taken says
nothing about which key or how many leading bytes matched.  With no key configured every
request passes (the loopback default).
"""
from __future__ import annotations

import hmac

from fastapi import Request

from server.web.errors import APIError


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
