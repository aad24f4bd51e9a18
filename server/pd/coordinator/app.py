"""The coordinator's app and process: ``python -m server.pd --config-file
conf/pd/coordinator.json`` (server/pd/__main__.py runs ``main``).

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (routing.py), ``GET
/v1/models`` (a live decode instance's), ``/health`` (503 while a role has no live
instance), ``/metrics``, and ``GET /v1/status`` (the instances; needs the API key).

Client limits, like the daemon's own: the request headers must arrive within
``clientHeaderTimeout`` (server/web/header_timeout.py) and the body within
``clientBodyTimeout`` (408); a body over ``maxRequestLength`` is refused with 413 as soon
as its Content-Length (or its streamed size) says so, without being buffered, and the
connection is closed.  Every error is in the OpenAI shape; nothing answers a plain-text
500.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.web.errors import APIError, error_response
from server.web.header_timeout import header_timeout_protocol
from server.pd.coordinator.config import CoordinatorConfig, CoordinatorConfigError
from server.pd.coordinator.routing import Coordinator, error, relayed

log = logging.getLogger("server.pd")


def build_app(coord: Coordinator) -> FastAPI:
    app = FastAPI(title="mtp-serve PD coordinator", docs_url=None, redoc_url=None,
                  openapi_url=None)
    _install_error_handlers(app)
    _add_routes(app, coord)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        resp = error_response(exc.status, exc.message, exc.param, retry_after=exc.retry_after,
                              retry=exc.retry)
        if exc.status in (408, 413):   # the body was not read to its end: end the connection
            resp.headers["connection"] = "close"
        return resp

    @app.exception_handler(RecursionError)
    async def _recursion(request: Request, exc: RecursionError) -> Response:
        return error(400, "the body nests too deeply")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error(400, "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.error("internal error on %s", request.url.path, exc_info=exc)
        return error(500, f"internal error: {type(exc).__name__}")


def _add_routes(app: FastAPI, coord: Coordinator) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await coord.handle("/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await coord.handle("/v1/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for inst in coord.candidates(coord.cfg.decode):
            try:
                r = await coord.client.get(inst.business + "/v1/models", headers=headers)
                return relayed(r.content, r.status_code, r.headers)
            except httpx.HTTPError:
                continue
        return coord.unavailable("no decode instance answered")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if coord.healthy() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(coord.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/status")
    async def status(request: Request) -> Response:
        coord.api_keys.check(request)
        return Response(json.dumps({"kv_transfer_key_id": coord.key_id, "instances": [
            {"name": i.name, "role": i.role, "business": i.business, "in_flight": i.in_flight,
             "available": i.up, "kv_port": i.kv_port} for i in coord.instances]}),
            media_type="application/json")


def server_config(app: Any, cfg: CoordinatorConfig, **kw: Any) -> Any:
    """uvicorn's config for the coordinator: the daemon's header deadline protocol."""
    import uvicorn
    return uvicorn.Config(app, host=cfg.ip_address, port=cfg.port, log_level="warning",
                          access_log=False, lifespan="off",
                          http=header_timeout_protocol(cfg.header_timeout_s,
                                                       native=lambda path: False),
                          timeout_keep_alive=5, timeout_graceful_shutdown=5, **kw)


async def serve(cfg: CoordinatorConfig) -> int:
    import uvicorn
    coord = Coordinator(cfg)
    try:
        await coord.wait_and_assign()
    except RuntimeError as exc:
        print(f"error: {exc}", flush=True)
        await coord.close()
        return 1
    coord.start_health_loop()
    server = uvicorn.Server(server_config(build_app(coord), cfg))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:            # say "success" only once the port accepts
            if task.done():
                print(f"error: the coordinator cannot listen on {cfg.ip_address}:{cfg.port}",
                      flush=True)
                return 1
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):     # stop cleanly (exit 0), not by a traceback
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        print(f"Coordinator start success! http://{cfg.ip_address}:{cfg.port}", flush=True)
        await task
    finally:
        await coord.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m server.pd",
                                 description="PD coordinator: one endpoint over prefill and "
                                             "decode instances")
    ap.add_argument("--config-file", default="conf/pd/coordinator.json")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every call at INFO: two lines per request and per health check would fill
    # the log (and a parent's unread pipe); failures are logged here, by instance.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        cfg = CoordinatorConfig.load(args.config_file)
    except CoordinatorConfigError as exc:
        print(f"error: {exc}")
        return 2
    return asyncio.run(serve(cfg))
