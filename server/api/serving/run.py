"""A planned request's run, shared by chat.py and completions.py: its grammar compiled,
its engine requests adapted to the PD role, one ``EngineCall`` per choice, then the
answer: one JSON body, or an SSE stream with its ending.

Every way out frees what the request holds, once: the choices still running are aborted
(``Interleave.close``) and the admission slots (with a PD prefill's unanswered export)
are released, whether the answer ends normally, fails, or loses its client.  A stream
ends with ``[DONE]`` after its last chunk or after an error event in the OpenAI shape;
a client that went away gets nothing more.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from server.api.openai.grammars import prepare_grammar
from server.api.serving.engine_call import ClientDisconnected, EngineCall, close_stream
from server.api.serving.fanout import Interleave
from server.api.serving.pd_calls import pd_answer, pd_requests
from server.api.sse import DONE, SSE_HEADERS, event, json_response
from server.api.state import ServerState
from server.web.errors import APIError, openai_body

Stream = Callable[[Any, Interleave], AsyncIterator[bytes]]
Complete = Callable[[Any, Interleave], Awaitable[dict]]


async def run_choices(state: ServerState, plan: Any, release: Callable[[], None],
                      is_disconnected: Callable[[], Awaitable[bool]], *,
                      stream: Stream, complete: Complete,
                      idle: Callable[[int], bool] | None = None) -> Response:
    """Run ``plan`` (its ``req``, ``grammar``, ``num_choices`` and ``engine_request(k)``)
    and answer with ``stream(plan, merged)``'s SSE events or ``complete(plan, merged)``'s
    JSON body; ``idle(k)``: choice ``k`` needs no engine call (``Interleave`` yields
    ``(k, None)`` for it).  ``release`` frees the request's admission slots."""
    if plan.grammar is not None:
        await prepare_grammar(state.engine, plan.grammar, release)
    req, s = plan.req, state.settings
    ers, release = await pd_requests(
        state, req, [plan.engine_request(k) for k in range(plan.num_choices)], release)
    calls: list[EngineCall | None] = []
    for k in range(plan.num_choices):
        state.metrics.on_received()
        calls.append(None if idle is not None and idle(k) else EngineCall(
            state.engine, ers[k], state.metrics,
            token_timeout_s=s.token_timeout_s, e2e_timeout_s=s.e2e_timeout_s,
            is_disconnected=None if req.stream else is_disconnected))
    if req.stream:
        body = _sse(stream, plan, calls, release)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS,
                                 background=BackgroundTask(close_stream, body, calls, release))
    merged = Interleave(calls)
    try:
        # Before release: a PD prefill's answer keeps its export for D (pd_requests).
        return json_response(pd_answer(state, ers, await complete(plan, merged)))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        merged.close()          # one choice failed or the client left: abort the others
        release()


async def _sse(stream: Stream, plan: Any, calls: list, release: Callable[[], None]
               ) -> AsyncIterator[bytes]:
    """``stream(plan, merged)``'s events framed as the openai SDK reads a stream: an error
    becomes an error event, and ``[DONE]`` ends it unless the client is gone."""
    merged = Interleave(calls)
    events = stream(plan, merged)
    try:
        async for chunk in events:
            yield chunk
    except APIError as exc:
        yield event(openai_body(exc.status, exc.message, exc.param))
    except ClientDisconnected:
        return
    except Exception as exc:  # a bug must still end the stream in the documented shape
        yield event(openai_body(500, f"internal error: {type(exc).__name__}: {exc}"))
    finally:
        merged.close()          # abort every sibling still running
        release()
        await events.aclose()   # (suspended at a yield when the client left)
    yield DONE
