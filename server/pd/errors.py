"""Why PD cannot serve a request, said without HTTP: the serving layer (server/api) answers
each with its ``status`` in its own error shape (server/api/errors.py, ``api_error``).

``PDRefused`` (400): the request's ``kv_transfer_params`` are wrong for this instance (not
signed, not a peer's KV port, the wrong form for its role); ``PDUnavailable`` (503): not now
(no role yet, the role changed under the request, the exports are full), so the
coordinator sends it elsewhere; ``PDError`` itself (500): this instance failed.

Every 503 says when to try again (``retry_after``: the ``Retry-After`` header).  That is
also how the coordinator tells "full, or between roles: later" from "stopping": an
instance that answers a 503 with ``Retry-After`` stays in rotation (one "exports full"
answer used to mark the only P down for every client), and its health checks decide
whether it is down.
"""
from __future__ import annotations


class PDError(Exception):
    """This instance failed the request (500)."""

    status = 500
    retry_after: int | None = None    # seconds, sent as Retry-After

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param            # the request field at fault, if one is


class PDRefused(PDError):
    """The request's PD fields cannot be served here (400)."""

    status = 400


class PDUnavailable(PDError):
    """Not now: another instance (or a later try) may serve it (503)."""

    status = 503
    retry_after = 1
