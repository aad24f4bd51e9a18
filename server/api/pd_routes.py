"""PD's routes, MindIE's role API on the management plane (the state they change is
server/pd/roles.py and instance.py): ``POST /v1/role/{role}``, ``/v2/role/{role}``,
and ``POST /v1/kv/release`` (ours: the coordinator drops an export D refused).

Role: 200 ``{"result": "ok"}``; 422 "Req body converts to json fail." for a body that is
not JSON (or nested too deeply to parse); 503 "Update pd info failed. Reset to previous
node status." (with the reason) when the role cannot be taken, the previous role kept.
Release: body ``{"remote_request_id": "..."}``, 200 ``{"released": true|false}``.  Both
change state, so they are guarded like /stopService (POST only, no cross-origin browser
request, the API key when one is set).
"""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from starlette.responses import Response

from server.api.auth import guard_state_change
from server.api.sse import json_response
from server.pd.roles import RoleError


class _Refused(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


async def _pd_body(request: Request, state, bad_json: str) -> object:
    """The guarded JSON body of a state-changing PD call (``_Refused`` carries the answer)."""
    guard_state_change(request, state.api_keys)
    if state.pd is None:
        raise _Refused(json_response({"error": "this instance is not a PD instance "
                                               "(inferMode \"dmi\")"}, 503))
    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError):          # not JSON, or nested past the parser
        raise _Refused(json_response({"error": bad_json}, 422)) from None


def add_pd_routes(app: FastAPI, state) -> None:
    async def assign(request: Request, role: str, version: int) -> Response:
        try:
            body = await _pd_body(request, state, "Req body converts to json fail.")
        except _Refused as r:
            return r.response
        try:
            state.pd.roles.assign(role, body, version)
        except RoleError as exc:
            return json_response({"error": "Update pd info failed. Reset to previous node "
                                           f"status. ({exc})"}, 503)
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
