"""Management plane (managementIpAddress:managementPort) and the metrics route.

Native MindIE endpoints answer errors as {"error": ..., "error_type": ...}.
/health/timed[-N] runs a one-token dummy inference and waits at most N seconds
(default 10, N in 1..600): 200 {"status": "healthy"} on success, 500 on timeout or
failure, 503 with no body while the service is stopping, 404 for an invalid N.
``/stopService`` changes state: POST only (405 for GET), refused with 403 when a browser
page of another origin sends it, and with API keys configured it needs one (401).
With API keys configured /health/timed[-N] needs one too (401): each call runs an
inference, and a keyless caller could otherwise load the engine at will.  Plain /health
stays open for load balancers.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from server.api.auth import guard_state_change
from server.api.sse import json_response
from server.api.state import ServerState
from server.engine.protocol import EngineRequest, FinishReason, SamplingParams
from server.engine.stats import EngineStats
from server.web.errors import APIError, error_response

DEFAULT_TIMED_WAIT_S = 10
MAX_TIMED_WAIT_S = 600
_TIMED = re.compile(r"/health/timed((-[0-9]+)?)")


def stats_view(stats: EngineStats) -> dict:
    """EngineStats as plain JSON, with the KV pool summarised under fixed keys."""
    raw = dataclasses.asdict(stats)
    raw["kv_cache"] = {"total_blocks": stats.kv_blocks_total,
                       "free_blocks": stats.kv_blocks_total - stats.kv_blocks_used,
                       "usage": float(stats.kv_usage), "block_size": stats.block_size}
    raw["acceptance_rate"] = stats.acceptance_rate
    raw["mean_acceptance_length"] = stats.mean_acceptance_length
    raw["num_requests_running"] = stats.num_running
    raw["num_requests_waiting"] = stats.num_waiting
    raw["host_kv_tier"] = {"total_blocks": stats.host_blocks_total,
                           "used_blocks": stats.host_blocks_used,
                           "cached_blocks": stats.host_blocks_cached,
                           "usage": float(stats.host_usage),
                           "hit_tokens": stats.host_cache_hits,
                           "bytes_saved": stats.kv_bytes_saved, "bytes_loaded": stats.kv_bytes_loaded,
                           "num_requests_swapped": stats.num_requests_swapped,
                           "disk": {"total_blocks": stats.disk_blocks_total,
                                    "used_blocks": stats.disk_blocks_used,
                                    "hit_tokens": stats.disk_cache_hits,
                                    "bytes_written": stats.disk_bytes_written,
                                    "bytes_read": stats.disk_bytes_read,
                                    "corrupt_files": stats.disk_corrupt_files}}
    return raw


async def timed_health(state: ServerState, wait_s: float) -> Response:
    if not state.admission.accepting:
        return Response(status_code=503)
    tok = state.tokenizer
    first = tok.bos_token_id if tok.bos_token_id is not None else 0
    req = EngineRequest(f"health-{time.monotonic_ns()}", [first],
                        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                        arrival_time=time.monotonic())

    async def run() -> Any:
        last = None
        async for out in state.engine.submit(req):
            last = out
        return last

    try:
        last = await asyncio.wait_for(run(), timeout=wait_s)
    except asyncio.TimeoutError:
        state.engine.abort(req.request_id)
        return error_response(500, f"health check inference did not finish in {wait_s:g} s",
                              native=True)
    except Exception as exc:
        return error_response(500, f"health check inference failed: {exc}", native=True)
    if last is None or last.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
        return error_response(500, "health check inference failed", native=True)
    return json_response({"status": "healthy"})


def add_management_routes(app: FastAPI, state: ServerState, with_health: bool = True) -> None:
    if with_health:
        @app.get("/health")
        async def health() -> Response:
            healthy = state.admission.accepting and state.engine.fatal_error is None
            return Response(status_code=200 if healthy else 503)

    @app.get("/health/{rest:path}")
    async def health_timed(request: Request, rest: str) -> Response:
        state.api_keys.check(request)
        m = _TIMED.fullmatch(request.url.path)
        if m is None:
            raise APIError(404, f"unknown health endpoint {request.url.path}")
        n = m.group(1)
        if n and (len(n) - 1 > 3 or not 1 <= int(n[1:]) <= MAX_TIMED_WAIT_S):
            raise APIError(404, f"Max wait time is {MAX_TIMED_WAIT_S}, input is invalid or too long")
        return await timed_health(state, int(n[1:]) if n else DEFAULT_TIMED_WAIT_S)

    @app.get("/v1/config")
    async def config() -> Response:
        return json_response(state.settings.raw)

    @app.get("/v1/status")
    async def status() -> Response:
        stats = stats_view(state.engine.stats())
        s = state.settings
        rt = state.engine.runtime
        return json_response({
            "status": ("unhealthy" if state.engine.fatal_error is not None
                       else "running" if state.admission.accepting else "stopping"),
            "error": state.engine.fatal_error,
            "model_name": s.model_name,
            "in_flight": state.admission.in_flight,
            "max_link_num": s.max_link_num,
            "mtp": {"enabled": rt.mtp_enabled, "num_speculative_tokens": rt.num_speculative_tokens,
                    "configured_num_speculative_tokens": rt.configured_speculative_tokens,
                    "adaptive_speculation": rt.adaptive_speculation},
            "async_scheduling_enabled": rt.async_scheduling,
            "runtime": rt.to_dict(),
            "engine": stats,
            "kv_cache": stats["kv_cache"],
            "pd": state.pd.status() if state.pd is not None else None,
            "host_kv_tier": {**rt.host_tier_dict(), **stats["host_kv_tier"]},
            # Leak watch (scripts/soak.py): these return to their idle level after load.
            "process": {"asyncio_tasks": len(asyncio.all_tasks()),
                        "threads": threading.active_count()},
        })

    @app.post("/stopService")
    async def stop_service(request: Request) -> Response:
        guard_state_change(request, state.api_keys)
        state.request_stop()
        return json_response({"status": "stopping",
                              "in_flight": state.admission.in_flight})


def add_metrics_route(app: FastAPI, state: ServerState) -> None:
    @app.get("/metrics")
    async def metrics() -> Response:
        if not state.metrics.enabled:
            raise APIError(500, "Metrics are off: MIES_SERVICE_MONITOR_MODE is 0.")
        st = stats_view(state.engine.stats())
        state.metrics.refresh(int(st["num_requests_running"] or 0),
                              int(st["num_requests_waiting"] or 0),
                              int(st["num_requests_swapped"]),
                              float(st["kv_cache"]["usage"] or 0.0),
                              float(st["host_usage"]))
        state.metrics.refresh_kv_tiers(st)
        if st.get("steps_per_k"):
            state.metrics.refresh_spec(int(st.get("spec_current_k") or 0), list(st["steps_per_k"]))
        return Response(state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")
