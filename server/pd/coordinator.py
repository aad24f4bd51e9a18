"""The PD coordinator (MindIE-MS's part): the one business endpoint clients call.

Per request it picks the least-loaded prefill instance (P) and decode instance (D):

  1. P gets the request with ``stream: false``, ``max_tokens: 1`` and
     ``kv_transfer_params: {"do_remote_decode": true}`` (vLLM's proxy protocol): it
     prefills the prompt (main layers and the MTP layer), keeps the prompt blocks' KV for
     D, and answers with ``kv_transfer_params`` naming where to pull them;
  2. D gets the original request plus those ``kv_transfer_params``: it pulls the KV
     (server/pd/kv_client.py), computes only the prompt's tail, and decodes with MTP;
  3. D's answer (streamed or not) is relayed to the client as it comes.

Failures: a P or D that cannot be reached before it answered is marked down for a while
and the request goes to another one of its role, if any; otherwise the client gets a 503
in the OpenAI error shape.  D failing mid-stream ends the stream with an error event (its
partial output cannot be replayed elsewhere without repeating tokens).  At start the
coordinator assigns the roles the MindIE way (``POST /v1/role/prefill|decode`` on each
instance's management plane, with MindIE's V1 body).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from server.pd.coordinator_config import CoordinatorConfig, CoordinatorConfigError, Instance

log = logging.getLogger("server.pd")
DOWN_FOR_S = 5.0


def _error(status: int, message: str, kind: str = "server_error") -> Response:
    return Response(json.dumps({"error": {"message": message, "type": kind, "param": None,
                                          "code": status}}),
                    status_code=status, media_type="application/json")


def role_body(me: Instance, peers: list[Instance]) -> dict:
    """MindIE's V1 role body: this instance and its peers (one logical device each)."""
    def node(inst: Instance) -> dict:
        return {"id": inst.index, "host_ip": inst.host, "server_ip": inst.host,
                "device": [{"device_ip": inst.host, "device_logical_id": "0", "device_id": "0"}]}
    local = node(me)
    local.pop("server_ip")
    return {"local": local, "peers": [node(p) for p in peers]}


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s,
                                                              connect=cfg.connect_timeout_s))
        self.auth = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.registry = CollectorRegistry()
        self.requests = Counter("pd_requests", "requests by outcome", ["outcome"],
                                registry=self.registry)
        self.retries = Counter("pd_retries", "requests sent to another instance after one "
                               "failed", ["role"], registry=self.registry)
        self.in_flight = Gauge("pd_in_flight", "requests in flight per instance", ["instance"],
                               registry=self.registry)
        for inst in cfg.prefill + cfg.decode:
            self.in_flight.labels(inst.name).set(0)

    # -- start-up ----------------------------------------------------------------------
    async def wait_and_assign(self) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        for inst in self.cfg.prefill + self.cfg.decode:
            while True:
                try:
                    r = await self.client.get(inst.management + "/health", timeout=5)
                    if r.status_code in (200, 503):   # 503: up, but no role yet
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{inst.name} ({inst.management}) did not come up within "
                                       f"{self.cfg.start_timeout_s:g} s")
                await asyncio.sleep(0.2)
        await self._check_mtp()
        if not self.cfg.assign_roles:
            return
        for inst, peers in [(p, self.cfg.decode) for p in self.cfg.prefill] + \
                           [(d, self.cfg.prefill) for d in self.cfg.decode]:
            r = await self.client.post(f"{inst.management}/v1/role/{inst.role}",
                                       json=role_body(inst, peers), headers=self.auth)
            if r.status_code != 200:
                raise RuntimeError(f"{inst.name}: role {inst.role} refused ({r.status_code}: "
                                   f"{r.text[:200]})")
            log.info("%s at %s is now %s", inst.name, inst.business, inst.role)

    async def _check_mtp(self) -> None:
        """MindIE's rule for MTP under PD: configured on both P and D.  A P without it writes
        no MTP-layer KV for D to draft from; the instances must agree on k > 0."""
        ks = {}
        for inst in self.cfg.prefill + self.cfg.decode:
            r = await self.client.get(inst.management + "/v1/status", headers=self.auth, timeout=10)
            ks[inst.name] = r.json()["mtp"]["num_speculative_tokens"]
        if len({k > 0 for k in ks.values()}) > 1:
            raise RuntimeError("MTP must be configured on both the prefill and the decode "
                               f"instances (num_speculative_tokens: {ks})")

    # -- routing -------------------------------------------------------------------------
    def _candidates(self, pool: list[Instance]) -> list[Instance]:
        now = time.monotonic()
        up = [i for i in pool if i.available(now)] or list(pool)
        return sorted(up, key=lambda i: i.in_flight)

    def _enter(self, inst: Instance) -> None:
        inst.in_flight += 1
        self.in_flight.labels(inst.name).set(inst.in_flight)

    def _leave(self, inst: Instance) -> None:
        inst.in_flight -= 1
        self.in_flight.labels(inst.name).set(inst.in_flight)

    async def prefill(self, path: str, body: dict, headers: dict) -> tuple[Response | None, dict | None]:
        """(error response, None) or (None, kv_transfer_params from P)."""
        pbody = dict(body)
        pbody.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        for key in ("stream_options", "min_tokens", "max_completion_tokens"):
            pbody.pop(key, None)
        tried = 0
        for inst in self._candidates(self.cfg.prefill):
            tried += 1
            if tried > 1:
                self.retries.labels("prefill").inc()
            self._enter(inst)
            try:
                r = await self.client.post(inst.business + path, json=pbody, headers=headers)
            except httpx.HTTPError as exc:
                log.warning("%s failed: %s", inst.name, exc)
                inst.down_until = time.monotonic() + DOWN_FOR_S
                continue
            finally:
                self._leave(inst)
            if r.status_code != 200:       # the request's own fault (400...) or P's refusal
                if r.status_code >= 500:
                    inst.down_until = time.monotonic() + DOWN_FOR_S
                    if r.status_code in (502, 503):
                        continue
                return Response(r.content, r.status_code, media_type="application/json"), None
            params = r.json().get("kv_transfer_params")
            if not isinstance(params, dict):
                return _error(502, f"{inst.name} answered without kv_transfer_params"), None
            return None, params
        return _error(503, "no prefill instance could take the request"), None

    async def decode(self, path: str, body: dict, headers: dict) -> Response:
        stream = bool(body.get("stream"))
        for inst in self._candidates(self.cfg.decode):
            self._enter(inst)
            req = self.client.build_request("POST", inst.business + path, json=body, headers=headers)
            try:
                r = await self.client.send(req, stream=True)
            except httpx.HTTPError as exc:
                self._leave(inst)
                log.warning("%s failed: %s", inst.name, exc)
                inst.down_until = time.monotonic() + DOWN_FOR_S
                self.retries.labels("decode").inc()
                continue
            if not stream or r.status_code != 200:
                try:
                    content = await r.aread()
                except httpx.HTTPError as exc:
                    content = None
                    log.warning("%s failed mid-answer: %s", inst.name, exc)
                finally:
                    await r.aclose()
                    self._leave(inst)
                if content is None:
                    inst.down_until = time.monotonic() + DOWN_FOR_S
                    return _error(502, f"{inst.name} failed while answering")
                return Response(content, r.status_code,
                                media_type=r.headers.get("content-type", "application/json"))
            return StreamingResponse(self._relay(inst, r), media_type="text/event-stream")
        return _error(503, "no decode instance could take the request")

    async def _relay(self, inst: Instance, r: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            inst.down_until = time.monotonic() + DOWN_FOR_S
            self.requests.labels("failed").inc()
            msg = {"error": {"message": f"{inst.name} failed mid-stream: {exc}",
                             "type": "server_error", "param": None, "code": 502}}
            yield f"data: {json.dumps(msg)}\n\n".encode()
        finally:
            await r.aclose()
            self._leave(inst)

    async def handle(self, path: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            self.requests.labels("bad_request").inc()
            return _error(400, f"the body is not a JSON object: {exc}", "invalid_request_error")
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        err, params = await self.prefill(path, body, headers)
        if err is not None:
            self.requests.labels("failed" if err.status_code >= 500 else "refused").inc()
            return err
        resp = await self.decode(path, {**body, "kv_transfer_params": params}, headers)
        if not isinstance(resp, StreamingResponse):
            self.requests.labels("ok" if resp.status_code == 200 else "failed").inc()
        else:
            self.requests.labels("ok").inc()
        return resp

    async def close(self) -> None:
        await self.client.aclose()


def build_app(coord: Coordinator) -> FastAPI:
    app = FastAPI(title="mtp-serve PD coordinator", docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await coord.handle("/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await coord.handle("/v1/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for inst in coord._candidates(coord.cfg.decode):
            try:
                r = await coord.client.get(inst.business + "/v1/models", headers=headers)
                return Response(r.content, r.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return _error(503, "no decode instance answered")

    @app.get("/health")
    async def health() -> Response:
        now = time.monotonic()
        ok = all(any(i.available(now) for i in pool) for pool in (coord.cfg.prefill, coord.cfg.decode))
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(coord.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/status")
    async def status() -> Response:
        now = time.monotonic()
        return Response(json.dumps({"instances": [
            {"name": i.name, "role": i.role, "business": i.business, "in_flight": i.in_flight,
             "available": i.available(now)} for i in coord.cfg.prefill + coord.cfg.decode]}),
            media_type="application/json")

    return app


async def serve(cfg: CoordinatorConfig) -> int:
    import uvicorn
    coord = Coordinator(cfg)
    try:
        await coord.wait_and_assign()
    except RuntimeError as exc:
        print(f"error: {exc}", flush=True)
        await coord.close()
        return 1
    server = uvicorn.Server(uvicorn.Config(build_app(coord), host=cfg.ip_address, port=cfg.port,
                                           log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:            # say "success" only once the port accepts
            if task.done():
                print(f"error: the coordinator cannot listen on {cfg.ip_address}:{cfg.port}",
                      flush=True)
                return 1
            await asyncio.sleep(0.01)
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
    try:
        cfg = CoordinatorConfig.load(args.config_file)
    except CoordinatorConfigError as exc:
        print(f"error: {exc}")
        return 2
    return asyncio.run(serve(cfg))
