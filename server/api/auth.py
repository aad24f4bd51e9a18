"""The guard on state-changing management calls (the API keys are server/web/api_keys.py).

Management calls that change state (``POST /stopService``, the PD role and release calls)
are refused when the request comes from a browser page of another origin: a page can send
a cross-origin POST without reading the answer, and before this guard ``GET /stopService``
from any web page stopped the daemon.  They also need the API key when one is set.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from fastapi import Request

from server.web.api_keys import ApiKeys
from server.web.errors import APIError


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
