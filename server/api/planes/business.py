"""Business plane (ipAddress:port): OpenAI routes and /health.

With API keys configured every route but /health needs ``Authorization: Bearer <key>``
(401 otherwise), checked before a ``maxLinkNum`` slot is taken or the body is read.
"""
from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from starlette.responses import Response

from server.api.serving.chat import create_chat_completion
from server.api.serving.completions import create_completion
from server.api.sse import json_response
from server.api.state import ServerState
from server.web.body import read_json
from server.web.errors import APIError
from server.web.offload import PLAN_INLINE_BYTES


def model_card(state: ServerState) -> dict:
    # ``root`` is the served name, not the weights' path: the path would tell every
    # client where the checkpoint lies on the host (and often the account it runs as).
    s = state.settings
    return {"id": s.model_name, "object": "model", "created": state.created,
            "owned_by": "mtp-serve", "root": s.model_name, "parent": None,
            "max_model_len": s.max_seq_len,
            "num_speculative_tokens": s.num_speculative_tokens}


def add_business_routes(app: FastAPI, state: ServerState) -> None:
    # A coroutine, not a plain function: FastAPI runs a plain dependency on its thread
    # pool, a hop that cost every request (``GET /v1/models`` included) ~0.3 ms.
    async def authorized(request: Request) -> None:
        state.api_keys.check(request)

    auth = [Depends(authorized)]

    async def _run(request: Request, handler) -> Response:
        # The body first (size cap, clientBodyTimeout), then a maxLinkNum slot: a client
        # that sends half a body holds no slot.  The ticket is the handler's ``release``:
        # calling it frees every slot it holds (one now, n for n choices), once.
        s = state.settings
        raw, size = await read_json(request, s.max_request_bytes, s.body_timeout_s)
        ticket = state.admission.ticket()
        try:
            return await handler(state, raw, request.is_disconnected, ticket,
                                 plan_inline=size <= PLAN_INLINE_BYTES)
        except BaseException:     # a failure before the handler's own cleanup took over
            ticket()
            raise

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request) -> Response:
        return await _run(request, create_chat_completion)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await _run(request, create_completion)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card(state)]})

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> Response:
        if model_id != state.settings.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model")
        return json_response(model_card(state))

    @app.get("/health")
    async def health() -> Response:
        if not state.admission.accepting or state.engine.fatal_error is not None:
            return Response(status_code=503)
        return Response(status_code=200)
