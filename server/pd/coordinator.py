"""The PD coordinator (MindIE-MS's part): the one business endpoint clients call.

Per request it picks the least-loaded live prefill instance (P) and decode instance (D):

  1. P gets the request with ``stream: false``, ``max_tokens: 1`` and
     ``kv_transfer_params: {"do_remote_decode": true}`` (vLLM's proxy protocol): it
     prefills the prompt (main layers and the MTP layer), keeps the prompt blocks' KV for
     D, and answers with ``kv_transfer_params`` naming where to pull them;
  2. the coordinator signs those params with the deployment's KV transfer key
     (server/pd/trust.py: D takes no params it did not sign) and D gets the original
     request plus them: it pulls the KV (server/pd/kv_client.py), computes only the
     prompt's tail, and decodes with MTP;
  3. D's answer (streamed or not) is relayed to the client as it comes.

Client limits, like the daemon's own: the request headers must arrive within
``clientHeaderTimeout`` (server/api/http_protocol.py) and the body within
``clientBodyTimeout`` (408); a body over ``maxRequestLength`` is refused with 413 as soon
as its Content-Length (or its streamed size) says so, without being buffered; a body
that is not a JSON object, or nests deeper than ``MAX_JSON_DEPTH``, gets 400.  Every
error is in the OpenAI shape; nothing answers a plain-text 500.

Health: every ``healthInterval`` seconds each instance's management ``GET /v1/status``
is read.  An instance is down while it cannot be reached, is not running, or does not
hold the role and the KV transfer key this coordinator gave it; with ``assignRoles`` the
coordinator then posts the role again (a restarted instance comes back with none) and
the instance is up once its status shows the role and the key id.  Routing skips
instances that are down; ``/health`` is 503 while a role has no live instance.

Failures: a P or D that cannot be reached, or answers 502/503, before it answered is
marked down (until the health loop sees it well again) and the request goes to another
one of its role, if any (for D: with the same signed params); otherwise the client gets
a 503 in the OpenAI error shape.  Whenever D did not take the request (it refused, none
could, it failed before answering), P is told to drop the exported KV (``POST
/v1/kv/release``, fire and forget).  D failing mid-stream ends the stream with an error
event (its partial output cannot be replayed elsewhere without repeating tokens).  Each
request counts exactly one outcome in ``pd_requests_total``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from typing import Any, AsyncIterator

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.auth import ApiKeys
from server.api.body import read_json
from server.api.errors import APIError, error_response
from server.api.http_protocol import header_timeout_protocol
from server.api.offload import INLINE_BYTES, off_loop
from server.pd import trust
from server.pd.coordinator_config import CoordinatorConfig, CoordinatorConfigError, Instance

log = logging.getLogger("server.pd")
MAX_JSON_DEPTH = 64          # a body nesting deeper is refused (400)
RELEASE_TIMEOUT_S = 5.0      # a KV release call to P (fire and forget)
STATUS_TIMEOUT_S = 5.0       # a health check's GET /v1/status (at most)


def _error(status: int, message: str, param: str | None = None) -> Response:
    return error_response(status, message, param)


def json_depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (a scalar 0, ``{}`` 1), without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        depth = max(depth, d)
        if d > MAX_JSON_DEPTH:
            return d
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return depth


def _check_body(body: Any) -> None:
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(body).__name__}")
    if json_depth(body) > MAX_JSON_DEPTH:
        raise APIError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels")


def role_body(me: Instance, peers: list[Instance], key: bytes | None = None) -> dict:
    """MindIE's V1 role body: this instance and its peers (one logical device each), plus
    our fields: the deployment's KV transfer key, and for a decode instance each prefill
    peer's KV port (read from that peer's /v1/status)."""
    def node(inst: Instance) -> dict:
        out = {"id": inst.index, "host_ip": inst.host, "server_ip": inst.host,
               "device": [{"device_ip": inst.host, "device_logical_id": "0", "device_id": "0"}]}
        if me.role == "decode" and inst.kv_port is not None:
            out["kv_port"] = inst.kv_port
        return out
    local = node(me)
    local.pop("server_ip")
    local.pop("kv_port", None)
    body: dict[str, Any] = {"local": local, "peers": [node(p) for p in peers]}
    if key is not None:
        body["kv_transfer_key"] = key.hex()
    return body


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = cfg
        self.key = cfg.kv_transfer_key if cfg.kv_transfer_key is not None else trust.new_key()
        self.key_id = trust.key_id(self.key)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s,
                                                              connect=cfg.connect_timeout_s),
                                        transport=transport)
        self.auth = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.api_keys = ApiKeys((cfg.api_key,) if cfg.api_key else ())
        self.mtp_on: bool | None = None
        self._health_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.registry = CollectorRegistry()
        self.requests = Counter("pd_requests", "requests by outcome (one per request)",
                                ["outcome"], registry=self.registry)
        self.retries = Counter("pd_retries", "requests sent to another instance after one "
                               "failed", ["role"], registry=self.registry)
        self.in_flight = Gauge("pd_in_flight", "requests in flight per instance", ["instance"],
                               registry=self.registry)
        self.up = Gauge("pd_instance_up", "1 while the instance is live with its role and key",
                        ["instance"], registry=self.registry)
        self.role_posts = Counter("pd_role_assignments", "roles posted to instances (at start "
                                  "and after a restart)", ["instance"], registry=self.registry)
        self.releases = Counter("pd_kv_releases", "calls telling P to drop KV that D did not "
                                "take, by result", ["result"], registry=self.registry)
        for outcome in ("ok", "refused", "failed", "bad_request", "cancelled"):
            self.requests.labels(outcome)
        for inst in self.instances:
            self.in_flight.labels(inst.name).set(0)
            self.up.labels(inst.name).set(1 if inst.up else 0)

    @property
    def instances(self) -> list[Instance]:
        return self.cfg.prefill + self.cfg.decode

    def _peers(self, inst: Instance) -> list[Instance]:
        return self.cfg.decode if inst.role == "prefill" else self.cfg.prefill

    # -- start-up ----------------------------------------------------------------------
    async def wait_and_assign(self) -> None:
        log.info("KV transfer key id %s (%s)", self.key_id,
                 self.cfg.kv_transfer_key_file or "new for this start")
        deadline = time.monotonic() + self.cfg.start_timeout_s
        for inst in self.instances:
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
        if self.cfg.assign_roles:
            for inst in self.instances:
                err = await self._assign(inst)
                if err is not None:
                    raise RuntimeError(err)
                log.info("%s at %s is now %s", inst.name, inst.business, inst.role)
        await self.check_all()

    async def _status(self, inst: Instance, timeout: float | None = None) -> dict:
        r = await self.client.get(inst.management + "/v1/status", headers=self.auth,
                                  timeout=timeout or STATUS_TIMEOUT_S)
        if r.status_code != 200:
            raise RuntimeError(f"GET /v1/status answered {r.status_code}: {r.text[:200]}")
        st = r.json()
        if not isinstance(st, dict):
            raise RuntimeError("GET /v1/status did not answer a JSON object")
        self._note_kv_port(inst, st)
        return st

    @staticmethod
    def _note_kv_port(inst: Instance, st: dict) -> None:
        pd = st.get("pd")
        if inst.role == "prefill" and isinstance(pd, dict) and type(pd.get("kv_port")) is int:
            inst.kv_port = pd["kv_port"]

    @staticmethod
    def _mtp_k(st: dict) -> int:
        k = (st.get("mtp") or {}).get("num_speculative_tokens")
        return k if isinstance(k, int) else 0

    async def _check_mtp(self) -> None:
        """MindIE's rule for MTP under PD: configured on both P and D.  A P without it writes
        no MTP-layer KV for D to draft from; the instances must agree on k > 0."""
        ks = {}
        for inst in self.instances:
            try:
                ks[inst.name] = self._mtp_k(await self._status(inst, timeout=10))
            except (httpx.HTTPError, ValueError, RuntimeError, AttributeError) as exc:
                raise RuntimeError(f"{inst.name} ({inst.management}): cannot read its "
                                   f"/v1/status: {exc}") from None
        if len({k > 0 for k in ks.values()}) > 1:
            raise RuntimeError("MTP must be configured on both the prefill and the decode "
                               f"instances (num_speculative_tokens: {ks})")
        self.mtp_on = any(k > 0 for k in ks.values())

    async def _assign(self, inst: Instance) -> str | None:
        """POST the role (MindIE's V1 body with our key and KV ports); an error or None."""
        body = role_body(inst, self._peers(inst), self.key)
        try:
            r = await self.client.post(f"{inst.management}/v1/role/{inst.role}", json=body,
                                       headers=self.auth, timeout=STATUS_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return f"{inst.name}: role {inst.role} not posted: {exc!r}"
        self.role_posts.labels(inst.name).inc()
        if r.status_code != 200:
            return f"{inst.name}: role {inst.role} refused ({r.status_code}: {r.text[:200]})"
        inst.last_role_body = body
        return None

    # -- health ------------------------------------------------------------------------
    def start_health_loop(self) -> None:
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.check_all()
            except Exception:                     # the loop must outlive any one failure
                log.exception("health check failed")

    async def check_all(self) -> None:
        """One health pass: prefill instances first (D's role body names their KV ports)."""
        await asyncio.gather(*(self.check(i) for i in self.cfg.prefill))
        await asyncio.gather(*(self.check(i) for i in self.cfg.decode))

    def _problem(self, inst: Instance, st: dict) -> tuple[str | None, bool]:
        """(what is wrong, whether posting the role again may fix it)."""
        if st.get("status") != "running":
            return f"its status is {st.get('status')!r} ({st.get('error')})", False
        if self.mtp_on is not None and (self._mtp_k(st) > 0) != self.mtp_on:
            return ("its MTP setting differs from the other instances' (num_speculative_"
                    f"tokens {self._mtp_k(st)})"), False
        pd = st.get("pd")
        if not isinstance(pd, dict):
            return "it is not a PD instance (inferMode \"dmi\")", False
        if pd.get("role") != inst.role:
            return f"its role is {pd.get('role')!r}, not {inst.role!r}", True
        if pd.get("kv_transfer_key_id") != self.key_id:
            return (f"its KV transfer key id is {pd.get('kv_transfer_key_id')!r}, not this "
                    f"coordinator's {self.key_id!r}"), True
        if self.cfg.assign_roles and inst.role == "decode" and \
                inst.last_role_body != role_body(inst, self._peers(inst), self.key):
            return "a prefill peer's KV port changed", True
        return None, False

    async def check(self, inst: Instance) -> None:
        epoch = inst.epoch
        try:
            st = await self._status(inst)
            problem, fixable = self._problem(inst, st)
            if problem is not None and fixable and self.cfg.assign_roles:
                err = await self._assign(inst)
                if err is not None:
                    problem = f"{problem}; {err}"
                else:
                    log.info("%s: %s; role %s posted again", inst.name, problem, inst.role)
                    problem, _ = self._problem(inst, await self._status(inst))
        except (httpx.HTTPError, ValueError, RuntimeError, AttributeError) as exc:
            problem = f"unreachable ({exc!r})"
        if problem is not None:
            self.mark_down(inst, problem)
        elif inst.epoch == epoch:               # no request failed on it meanwhile
            self.mark_up(inst)

    def mark_down(self, inst: Instance, why: str) -> None:
        inst.epoch += 1
        if inst.up:
            log.warning("%s (%s) is down: %s", inst.name, inst.business, why)
        inst.up = False
        self.up.labels(inst.name).set(0)

    def mark_up(self, inst: Instance) -> None:
        if not inst.up:
            log.info("%s (%s) is up", inst.name, inst.business)
        inst.up = True
        self.up.labels(inst.name).set(1)

    def healthy(self) -> bool:
        return all(any(i.up for i in pool) for pool in (self.cfg.prefill, self.cfg.decode))

    # -- routing -------------------------------------------------------------------------
    @staticmethod
    def _candidates(pool: list[Instance]) -> list[Instance]:
        return sorted((i for i in pool if i.up), key=lambda i: i.in_flight)

    def _enter(self, inst: Instance) -> None:
        inst.in_flight += 1
        self.in_flight.labels(inst.name).set(inst.in_flight)

    def _leave(self, inst: Instance) -> None:
        inst.in_flight -= 1
        self.in_flight.labels(inst.name).set(inst.in_flight)

    async def prefill(self, path: str, body: dict, headers: dict, size: int = 0
                      ) -> tuple[Response | None, dict | None, Instance | None]:
        """(error response, None, None) or (None, kv_transfer_params from P, that P)."""
        pbody = dict(body)
        pbody.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        for key in ("stream_options", "min_tokens", "max_completion_tokens"):
            pbody.pop(key, None)
        content = await _dumps(pbody, size)
        for tried, inst in enumerate(self._candidates(self.cfg.prefill)):
            if tried:
                self.retries.labels("prefill").inc()
            self._enter(inst)
            try:
                r = await self.client.post(inst.business + path, content=content, headers=headers)
            except httpx.HTTPError as exc:
                self.mark_down(inst, f"request failed: {exc!r}")
                continue
            finally:
                self._leave(inst)
            if r.status_code != 200:       # the request's own fault (400...) or P's refusal
                if r.status_code in (502, 503):
                    self.mark_down(inst, f"it answered {r.status_code}: {r.text[:200]}")
                    continue
                return _relayed(r.content, r.status_code, r.headers), None, None
            try:
                params = r.json().get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
            if not isinstance(params, dict):
                return _error(502, f"{inst.name} answered without kv_transfer_params"), None, None
            return None, params, inst
        return _error(503, "no prefill instance could take the request"), None, None

    async def decode(self, path: str, body: dict, headers: dict, params: dict,
                     p_inst: Instance, size: int = 0) -> Response:
        """D's answer; whenever D did not take the request, P is told to drop its KV."""
        stream = body.get("stream") is True
        content = await _dumps({**body, "kv_transfer_params": trust.sign_params(self.key, params)},
                               size)
        taken = False
        try:
            for tried, inst in enumerate(self._candidates(self.cfg.decode)):
                if tried:
                    self.retries.labels("decode").inc()
                self._enter(inst)
                entered = True
                try:
                    req = self.client.build_request("POST", inst.business + path,
                                                    content=content, headers=headers)
                    try:
                        r = await self.client.send(req, stream=True)
                    except httpx.HTTPError as exc:
                        self.mark_down(inst, f"request failed: {exc!r}")
                        continue
                    if stream and r.status_code == 200:
                        taken, entered = True, False         # _relay leaves
                        return StreamingResponse(self._relay(inst, r),
                                                 media_type="text/event-stream")
                    try:
                        data = await r.aread()
                    except httpx.HTTPError as exc:
                        self.mark_down(inst, f"failed while answering: {exc!r}")
                        return _error(502, f"{inst.name} failed while answering")
                    finally:
                        await r.aclose()
                    if r.status_code in (502, 503):     # role flip, no role yet, overloaded
                        self.mark_down(inst, f"it answered {r.status_code}: {data[:200]!r}")
                        continue
                    taken = r.status_code == 200
                    return _relayed(data, r.status_code, r.headers)
                finally:
                    if entered:
                        self._leave(inst)
            return _error(503, "no decode instance could take the request")
        finally:
            if not taken:
                self.release(p_inst, params)

    def release(self, p_inst: Instance, params: dict) -> None:
        """Tell P to drop the KV it holds for D (fire and forget)."""
        rid = params.get("remote_request_id")
        if not isinstance(rid, str):
            return
        task = asyncio.get_running_loop().create_task(self._post_release(p_inst, rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_release(self, p_inst: Instance, rid: str) -> None:
        try:
            r = await self.client.post(p_inst.management + "/v1/kv/release",
                                       json={"remote_request_id": rid}, headers=self.auth,
                                       timeout=RELEASE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            self.releases.labels("failed").inc()
            log.warning("%s: KV release of %s failed: %r", p_inst.name, rid, exc)
            return
        if r.status_code == 200:
            self.releases.labels("ok").inc()
        else:
            self.releases.labels("refused").inc()
            log.warning("%s: KV release of %s answered %d: %s", p_inst.name, rid,
                        r.status_code, r.text[:200])

    async def _relay(self, inst: Instance, r: httpx.Response) -> AsyncIterator[bytes]:
        outcome = "cancelled"                    # the client went away mid-stream
        try:
            async for chunk in r.aiter_raw():
                yield chunk
            outcome = "ok"
        except httpx.HTTPError as exc:
            outcome = "failed"
            self.mark_down(inst, f"failed mid-stream: {exc!r}")
            msg = {"error": {"message": f"{inst.name} failed mid-stream: {exc}",
                             "type": "server_error", "param": None, "code": 502}}
            yield f"data: {json.dumps(msg)}\n\n".encode()
        finally:
            self.requests.labels(outcome).inc()
            await r.aclose()
            self._leave(inst)

    async def handle(self, path: str, request: Request) -> Response:
        counted = False

        def count(outcome: str) -> None:
            nonlocal counted
            counted = True
            self.requests.labels(outcome).inc()

        try:
            try:
                body, size = await read_json(request, self.cfg.max_request_bytes,
                                             self.cfg.body_timeout_s)
                if size <= INLINE_BYTES:
                    _check_body(body)
                else:
                    await off_loop(_check_body, body)
            except (APIError, RecursionError):
                count("bad_request")
                raise
            headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
            headers["content-type"] = "application/json"
            if not self._candidates(self.cfg.decode):   # don't spend a prefill for nothing
                count("failed")
                return _error(503, "no decode instance is available")
            err, params, p_inst = await self.prefill(path, body, headers, size)
            if err is not None:
                count("failed" if err.status_code >= 500 else "refused")
                return err
            resp = await self.decode(path, body, headers, params, p_inst, size)
            if isinstance(resp, StreamingResponse):
                counted = True                           # _relay counts its outcome
            else:
                count("ok" if resp.status_code == 200 else
                      "failed" if resp.status_code >= 500 else "refused")
            return resp
        except asyncio.CancelledError:
            if not counted:
                count("cancelled")
            raise
        except Exception:
            if not counted:
                count("failed")
            raise

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._background:                     # let pending KV releases finish, briefly
            await asyncio.wait(list(self._background), timeout=RELEASE_TIMEOUT_S)
        await self.client.aclose()


async def _dumps(body: dict, size: int) -> bytes:
    """The body to forward (``size``: the client's body's bytes; a large one is encoded
    off the event loop, as it was decoded)."""
    if size > INLINE_BYTES:
        return await off_loop(orjson.dumps, body)
    return orjson.dumps(body)


def _relayed(content: bytes, status: int, headers: httpx.Headers) -> Response:
    return Response(content, status, media_type=headers.get("content-type", "application/json"))


def build_app(coord: Coordinator) -> FastAPI:
    app = FastAPI(title="mtp-serve PD coordinator", docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        resp = error_response(exc.status, exc.message, exc.param, retry_after=exc.retry_after,
                              retry=exc.retry)
        if exc.status in (408, 413):   # the body was not read to its end: end the connection
            resp.headers["connection"] = "close"
        return resp

    @app.exception_handler(RecursionError)
    async def _recursion(request: Request, exc: RecursionError) -> Response:
        return _error(400, "the body nests too deeply")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return _error(400, "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.error("internal error on %s", request.url.path, exc_info=exc)
        return _error(500, f"internal error: {type(exc).__name__}")

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
                return _relayed(r.content, r.status_code, r.headers)
            except httpx.HTTPError:
                continue
        return _error(503, "no decode instance answered")

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

    return app


def server_config(app: Any, cfg: CoordinatorConfig, **kw: Any) -> Any:
    """uvicorn's config for the coordinator: the daemon's header deadline protocol."""
    import uvicorn
    return uvicorn.Config(app, host=cfg.ip_address, port=cfg.port, log_level="warning",
                          access_log=False, lifespan="off",
                          http=header_timeout_protocol(cfg.header_timeout_s),
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
