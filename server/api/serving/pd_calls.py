"""The serving layer's two calls into PD (server/pd/instance.py): before submitting, and
the answer.  PD's refusals (``PDError``) become ``APIError``s here, with their status."""
from __future__ import annotations

from typing import Any, Callable

from server.api.errors import api_error
from server.engine.protocol import EngineRequest
from server.web.errors import APIError
from server.pd.errors import PDError


async def pd_requests(state: Any, req: Any, ers: list[EngineRequest],
                      release: Callable[[], None]
                      ) -> tuple[list[EngineRequest], Callable[[], None]]:
    """The engine requests as this instance's PD role wants them (unchanged when not in
    ``dmi`` mode), and the release to call when the request ends: it also drops a prefill
    export that was never answered (the request failed or the client left), so a reserved
    export never outlives its request by more than that.  A refusal frees the request's
    admission slots."""
    pd = state.pd
    if pd is None:
        if req.kv_transfer_params:
            release()
            raise APIError(400, "kv_transfer_params needs a PD instance (inferMode \"dmi\")",
                           "kv_transfer_params")
        return ers, release
    try:
        pd.check_role()
        params = req.kv_transfer_params
        if params and len(ers) != 1:
            raise APIError(400, "kv_transfer_params takes one choice of one prompt (n 1)",
                           "kv_transfer_params")
        if params and pd.roles.role == "prefill" and req.stream:
            raise APIError(400, "a prefill instance answers kv_transfer_params without "
                                "streaming (stream false)", "stream")
        out = [await pd.prepare(er, params) for er in ers]
    except PDError as exc:
        release()
        raise api_error(exc) from None
    except BaseException:
        release()
        raise
    done = False

    def release_and_finish() -> None:
        nonlocal done
        release()
        if not done:
            done = True
            pd.finish(out)

    return out, release_and_finish


def pd_answer(state: Any, ers: list[EngineRequest], body: dict) -> dict:
    """A prefill instance's answer names where its KV waits (kv_transfer_params)."""
    if state.pd is None or not ers:
        return body
    try:
        return {**body, **state.pd.response_params(ers[0])}
    except PDError as exc:
        raise api_error(exc) from None
