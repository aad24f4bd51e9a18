"""PD's routes, MindIE's role API on the management plane (the state they change is
server/pd/roles.py and instance.py): ``POST /v1/role/{role}``, ``/v2/role/{role}``,
and ``POST /v1/kv/release`` (ours: the coordinator drops an export D refused).

Role: 200 ``{"result": "ok"}``; 422 "Req body converts to json fail." for a body that is
not JSON (or nested too deeply to parse); 503 "Update pd info failed. Reset to previous
node status." (with the reason) when the role cannot be taken, the previous role kept.
Release: body ``{"remote_request_id": "..."}``, 200 ``{"released": true|false}``.

Both change state, so they are guarded like /stopService (POST only, no cross-origin
browser request) and, always, need a credential (401 without): the instance's KV transfer
key (a ``X-MTP-PD-Auth`` signature of the call, server/pd/trust.py ``sign_call``: what the
coordinator sends) or one of its API keys (``Authorization: Bearer``).  Before, without
``apiKeys`` anyone who reached the management port could post a role naming peers and a
key of their own, then have D load rows from their own KV server.  An instance that holds
neither (no ``pdTransferKeyFile``, no ``apiKeys``) takes no role from anyone.

A role taken is a change of trust: the engine purges every prefix block loaded from a
peer, and every block computed on top of one, before the new role serves a request.
Bodies are capped at ``MAX_BODY_BYTES`` (413): a role body is a few hundred bytes, and a
300 MB one grew P from 612 to 1,303 MB.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from starlette.responses import Response

from server.api.auth import same_origin
from server.api.sse import json_response
from server.pd import trust
from server.pd.roles import RoleError
from server.web.errors import APIError

MAX_BODY_BYTES = 1 << 20


class _Refused(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


async def read_capped(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refused with 413 once it passes ``limit`` bytes (declared or streamed) and
    408 when it takes longer than ``timeout_s``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"a management call's body is at most {limit} bytes, this one "
                       f"declares {declared}")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"a management call's body is at most {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout=timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"request body not received within {timeout_s:g} s "
                       "(clientBodyTimeout)", retry=False) from None


def check_credential(request: Request, body: bytes, state) -> None:
    """401 unless the call carries one of the API keys or the instance's KV transfer key's
    signature of this very call."""
    if state.api_keys.enabled and state.api_keys.matches(request.headers.get("authorization")):
        return
    key = state.pd.roles.key
    if trust.verify_call(key, request.method, request.url.path, body,
                         request.headers.get(trust.CALL_HEADER)):
        return
    if key is None and not state.api_keys.enabled:
        raise APIError(401, "this PD instance takes role and KV calls only from a caller "
                       "holding its KV transfer key or an API key, and it holds neither: set "
                       "ServerConfig.pdTransferKeyFile (the coordinator's kvTransferKeyFile) "
                       "or apiKeys", retry=False)
    raise APIError(401, "a role or KV call needs the deployment's KV transfer key (an "
                   f"{trust.CALL_HEADER} signature, as the PD coordinator sends) or an API "
                   "key ('Authorization: Bearer <key>')", retry=False)


async def _pd_body(request: Request, state, bad_json: str) -> object:
    """The guarded, authenticated JSON body of a state-changing PD call (``_Refused``
    carries a MindIE-shaped answer; an ``APIError`` the 401/403/408/413)."""
    if not same_origin(request):
        raise APIError(403, "cross-origin requests may not change the service's state")
    if state.pd is None:
        raise _Refused(json_response({"error": "this instance is not a PD instance "
                                               "(inferMode \"dmi\")"}, 503))
    raw = await read_capped(request, MAX_BODY_BYTES, state.settings.body_timeout_s)
    check_credential(request, raw, state)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):          # not JSON, or nested past the parser
        raise _Refused(json_response({"error": bad_json}, 422)) from None


def add_pd_routes(app: FastAPI, state) -> None:
    async def assign(request: Request, role: str, version: int) -> Response:
        try:
            body = await _pd_body(request, state, "Req body converts to json fail.")
        except _Refused as r:
            return r.response
        try:
            epoch = state.pd.assign(role, body, version)
        except RoleError as exc:
            return json_response({"error": "Update pd info failed. Reset to previous node "
                                           f"status. ({exc})"}, 503)
        state.engine.purge_peer_blocks(epoch)
        return json_response({"result": "ok"})

    @app.post("/v1/kv/release")
    async def release(request: Request) -> Response:
        bad = "the body must be {\"remote_request_id\": \"<id>\"}"
        try:
            body = await _pd_body(request, state, bad)
        except _Refused as r:
            return r.response
        rid = body.get("remote_request_id") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            return json_response({"error": bad}, 422)
        return json_response({"released": state.pd.release(rid)})

    @app.post("/v1/role/{role}")
    async def role_v1(request: Request, role: str) -> Response:
        return await assign(request, role, 1)

    @app.post("/v2/role/{role}")
    async def role_v2(request: Request, role: str) -> Response:
        return await assign(request, role, 2)
