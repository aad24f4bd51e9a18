"""The PD coordinator on its own: config, role bodies, signing, client limits, health and
retries against fake instances (small apps on loopback, all in one event loop thread);
then, on the demo model, a real P and D: one outcome per request, KV released when D
refuses, and a decode instance killed and restarted gets its role back.

Fake instances speak the daemon's contract: management ``GET /v1/status`` with
``pd.role``, ``pd.kv_port``, ``pd.kv_transfer_key_id`` and ``pd.model_fingerprint``,
``POST /v1/role/{role}`` (MindIE's V1 body, with ``kv_transfer_key`` under an API key) and
``POST /v1/kv/release``, both taken only with a call signed with the key the instance
holds (read from its key file, as ``pdTransferKeyFile``) or its API key; a fake D refuses
params the coordinator did not sign.  By hand, the full-size figures of
docs/reliability.md: ``PD_HALF_SENT=1000`` (half-sent sockets) and
``PD_FUZZ_EXAMPLES=3000`` (hypothesis cases).
"""
from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from server.pd import trust
from server.pd.coordinator.app import build_app, server_config
from server.pd.coordinator.config import (CoordinatorConfig, CoordinatorConfigError, Instance)
from server.pd.coordinator.fleet import role_body
from server.pd.coordinator.routing import MAX_JSON_DEPTH, Coordinator, json_depth
from server.testing.daemon import MODEL_NAME, Daemon, demo_model_ready, free_port

HEADER_S = BODY_S = 1.0
HEALTH_S = 0.2


# ---- config ------------------------------------------------------------------------------

def _doc(**kw) -> dict:
    return {"prefill": [{"business": "http://127.0.0.1:2001", "management": "http://127.0.0.1:2002"}],
            "decode": [{"business": "http://127.0.0.1:2003", "management": "http://127.0.0.1:2004"}],
            **kw}


def _key_file(folder) -> str:
    path = folder / "kv-transfer.key"
    path.write_text(trust.new_key().hex())
    return str(path)


def test_config_defaults_and_the_shipped_file(tmp_path):
    cfg = CoordinatorConfig.from_dict(_doc(apiKey="k"))
    assert (cfg.max_request_bytes, cfg.header_timeout_s, cfg.body_timeout_s,
            cfg.health_interval_s) == (40 * 1024 * 1024, 10, 60, 2)
    assert cfg.kv_transfer_key is None and cfg.assign_roles
    # The shipped set shares one key file (scripts/pd_start.sh makes it on first use).
    doc = json.loads(open("conf/pd/coordinator.json").read())
    assert doc["kvTransferKeyFile"] == "conf/pd/kv-transfer.key"
    for name in ("prefill", "decode"):
        server = json.loads(open(f"conf/pd/{name}.json").read())["ServerConfig"]
        assert server["pdTransferKeyFile"] == doc["kvTransferKeyFile"]
    shipped = CoordinatorConfig.from_dict({**doc, "kvTransferKeyFile": _key_file(tmp_path)})
    assert shipped.max_request_bytes == 40 * 1024 * 1024 and shipped.health_interval_s == 2


@pytest.mark.parametrize("extra, message", [
    ({"maxRequestLength": 0}, "maxRequestLength: 0 is not an integer in [1, 100] (MB"),
    ({"maxRequestLength": 1.5}, "maxRequestLength: 1.5 is not an integer"),
    ({"maxRequestLength": True}, "maxRequestLength: True"),
    ({"clientHeaderTimeout": "5"}, "clientHeaderTimeout: '5' is not a number"),
    ({"clientBodyTimeout": -1}, "clientBodyTimeout: -1 is not a number in [0.1, 3600]"),
    ({"healthInterval": 0}, "healthInterval: 0 is not a number"),
    ({"maxRequestLenght": 5}, "unknown key(s) 'maxRequestLenght'"),
    ({"timeouts": {"conect": 5}}, "timeouts.conect: unknown key"),
    ({"timeouts": {"connect": "x"}}, "timeouts.connect: 'x' is not a number"),
    ({"assignRoles": "yes"}, "assignRoles: 'yes' is not true or false"),
    ({"apiKey": 5}, "apiKey: must be a non-empty string"),
    ({"assignRoles": False}, "assignRoles: false needs kvTransferKeyFile"),
    ({}, "assignRoles: true needs kvTransferKeyFile or apiKey"),
    ({"kvTransferKeyFile": "/nonexistent/key"}, "cannot read the KV transfer key"),
])
def test_config_errors_name_the_key(extra, message):
    with pytest.raises(CoordinatorConfigError) as e:
        CoordinatorConfig.from_dict(_doc(**extra))
    assert message in str(e.value)


def test_key_file(tmp_path):
    key = trust.new_key()
    (tmp_path / "key").write_text(key.hex() + "\n")
    cfg = CoordinatorConfig.from_dict(_doc(assignRoles=False, kvTransferKeyFile=str(tmp_path / "key")))
    assert cfg.kv_transfer_key == key and Coordinator(cfg).key == key
    (tmp_path / "short").write_text("abcd")
    with pytest.raises(CoordinatorConfigError, match="64 hex digits"):
        CoordinatorConfig.from_dict(_doc(kvTransferKeyFile=str(tmp_path / "short")))
    # Without a file (the instances take the key with the role, under the API key): a new
    # key per start.
    a, b = (Coordinator(CoordinatorConfig.from_dict(_doc(apiKey="k"))) for _ in range(2))
    assert len(a.key) == 32 and a.key != b.key and a.key_id == trust.key_id(a.key)


def test_role_bodies_carry_the_key_and_the_prefill_kv_ports():
    p = Instance("prefill", 0, "http://10.0.0.1:1035", "http://10.0.0.1:1036", kv_port=1121)
    d = Instance("decode", 0, "http://10.0.0.2:1045", "http://10.0.0.2:1046")
    key = trust.new_key()
    db = role_body(d, [p], key)
    assert db["kv_transfer_key"] == key.hex()
    assert db["peers"] == [{"id": 0, "host_ip": "10.0.0.1", "server_ip": "10.0.0.1", "kv_port": 1121,
                            "device": [{"device_ip": "10.0.0.1", "device_logical_id": "0",
                                        "device_id": "0"}]}]
    assert "server_ip" not in db["local"] and "kv_port" not in db["local"]
    pb = role_body(p, [d], key)
    assert "kv_port" not in pb["peers"][0] and pb["kv_transfer_key"] == key.hex()
    assert "kv_transfer_key" not in role_body(p, [d])


def test_json_depth():
    assert json_depth({}) == 1 and json_depth({"a": [1, {"b": []}]}) == 4 and json_depth(3) == 0
    deep: list = []
    for _ in range(100_000):                 # no recursion: any depth is measured
        deep = [deep]
    assert json_depth(deep) > MAX_JSON_DEPTH


# ---- fake instances and an in-process coordinator ----------------------------------------

class LoopThread:
    """One event loop in a thread: the fake instances and the coordinator run on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def _serve(app, port: int, **kw) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                           lifespan="off", **kw) if not isinstance(app, uvicorn.Config)
                            else app)
    server.task = asyncio.create_task(server.serve())
    while not server.started:
        if server.task.done():
            raise RuntimeError(f"cannot serve on port {port}")
        await asyncio.sleep(0.01)
    return server


def _oai(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "x", "param": None, "code": status}},
                        status)


class Fake:
    """A PD instance: business and management on one port."""

    def __init__(self, name: str, file_key: bytes | None = None, api_key: str | None = None,
                 model: str = "f00d") -> None:
        self.name = name
        self.port, self.kv_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.role: str | None = None
        self.role_version = 0                      # roles taken since it started
        self.file_key = file_key                   # its pdTransferKeyFile's key
        self.key: bytes | None = file_key
        self.api_key = api_key
        self.model = model                         # its weights' fingerprint
        self.business_status: int | None = None    # answer business requests with this
        self.retry_after: str | None = None        # ... with this Retry-After
        self.unwell = False                        # /health answers 503 while set
        self.die_mid_stream = False
        self.role_posts: list[dict] = []
        self.releases: list[dict] = []
        self.seen: list[dict] = []
        self.n = 0
        self.server: uvicorn.Server | None = None
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.business, methods=["POST"]),
            Route("/v1/completions", self.business, methods=["POST"]),
            Route("/v1/models", lambda r: JSONResponse({"data": [{"id": MODEL_NAME}]})),
            Route("/health", lambda r: Response(status_code=200 if self.role and not self.unwell else 503)),
            Route("/v1/status", self.status),
            Route("/v1/role/{role}", self.assign, methods=["POST"]),
            Route("/v1/kv/release", self.release, methods=["POST"])])

    async def start(self) -> "Fake":
        self.server = await _serve(self.app, self.port)
        return self

    async def stop(self) -> None:
        """Gone, as after SIGKILL: what it held (its role, a key handed over) is lost."""
        self.server.should_exit = True
        await self.server.task
        self.role, self.key, self.role_version = None, self.file_key, 0

    async def status(self, request: Request) -> Response:
        return JSONResponse({"status": "running", "mtp": {"num_speculative_tokens": 1},
                             "pd": {"role": self.role, "kv_port": self.kv_port,
                                    "kv_transfer_key_id": trust.key_id(self.key),
                                    "role_version": self.role_version,
                                    "model_fingerprint": self.model,
                                    "model_weight_path": f"/models/{self.model}"}})

    async def _authorized(self, request: Request) -> bool:
        """The daemon's rule (server/api/planes/pd_routes.py): its API key, or a call signed with
        its key."""
        raw = await request.body()
        if self.api_key and request.headers.get("authorization") == f"Bearer {self.api_key}":
            return True
        return trust.verify_call(self.key, "POST", request.url.path, raw,
                                 request.headers.get(trust.CALL_HEADER))

    async def assign(self, request: Request) -> Response:
        if not await self._authorized(request):
            return _oai(401, "no credential")
        body = await request.json()
        self.role_posts.append(body)
        self.role = request.path_params["role"]
        self.role_version += 1
        if "kv_transfer_key" in body:
            self.key = trust.parse_key(body["kv_transfer_key"], "body")
        return JSONResponse({"result": "ok"})

    async def release(self, request: Request) -> Response:
        if not await self._authorized(request):
            return _oai(401, "no credential")
        self.releases.append(await request.json())
        return JSONResponse({"released": True})

    async def business(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.seen.append(body)
        if self.business_status:
            r = _oai(self.business_status, f"{self.name} refuses")
            if self.retry_after is not None:
                r.headers["Retry-After"] = self.retry_after
            return r
        if self.role is None:
            return _oai(503, "this PD instance has no role yet")
        params = body.get("kv_transfer_params")
        if self.role == "prefill":
            if params != {"do_remote_decode": True} or body.get("stream") is not False:
                return _oai(400, "bad prefill request")
            if "messages" not in body and "prompt" not in body:
                return _oai(400, "messages or prompt is required")
            self.n += 1
            return JSONResponse({"id": "x", "kv_transfer_params": {
                "do_remote_prefill": True, "remote_host": "127.0.0.1",
                "remote_port": self.kv_port, "remote_request_id": f"{self.name}-{self.n}"}})
        try:
            trust.verify_params(self.key, params if isinstance(params, dict) else {})
        except trust.TrustError as exc:
            return _oai(400, str(exc))
        if body.get("stream") is True:
            async def events():
                yield b'data: {"choices": [{"text": "a"}]}\n\n'
                await asyncio.sleep(0.05)
                if self.die_mid_stream:
                    raise RuntimeError("decode instance died")
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"choices": [{"text": "ok"}], "served_by": self.name,
                             "params": params})


class Set:
    def __init__(self, lt: LoopThread, fakes_p: list[Fake], fakes_d: list[Fake],
                 coord: Coordinator, server: uvicorn.Server) -> None:
        self.lt, self.p, self.d, self.coord, self.server = lt, fakes_p, fakes_d, coord, server
        self.base = f"http://127.0.0.1:{coord.cfg.port}"
        self.port = coord.cfg.port

    def metric(self, name: str, label: str) -> float:
        text = httpx.get(self.base + "/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(name + "{") and label in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        async def down():
            servers = [self.server] + [f.server for f in self.p + self.d
                                       if f.server is not None and not f.server.task.done()]
            for server in servers:
                server.should_exit = True
            await asyncio.gather(*(server.task for server in servers), self.coord.close())
        self.lt.run(down())


@pytest.fixture(scope="module")
def lt():
    t = LoopThread()
    yield t
    t.stop()


def _make(lt: LoopThread, n_p: int = 1, n_d: int = 1, key_folder=None, models=(),
          **extra) -> Set:
    """Fakes holding the key file's key (and the apiKey, if ``extra`` sets one), the
    coordinator reading the same file; ``models``: fingerprints of P then D (all alike)."""
    key_file = _key_file(key_folder)
    key = bytes.fromhex(open(key_file).read())
    fp = list(models) or ["f00d"] * (n_p + n_d)

    async def up() -> Set:
        ps = [await Fake(f"p{i}", key, extra.get("apiKey"), fp[i]).start() for i in range(n_p)]
        ds = [await Fake(f"d{i}", key, extra.get("apiKey"), fp[n_p + i]).start()
              for i in range(n_d)]
        cfg = CoordinatorConfig.from_dict({
            "kvTransferKeyFile": key_file, "port": free_port(), "healthInterval": HEALTH_S,
            "clientHeaderTimeout": HEADER_S, "clientBodyTimeout": BODY_S,
            "timeouts": {"connect": 2, "request": 20, "start": 10},
            "prefill": [{"business": f.url, "management": f.url} for f in ps],
            "decode": [{"business": f.url, "management": f.url} for f in ds], **extra})
        coord = Coordinator(cfg)
        try:
            await coord.wait_and_assign()
        except RuntimeError:                       # refused to start: nothing stays up
            await coord.close()
            for f in ps + ds:
                await f.stop()
            raise
        coord.start_health_loop()
        server = await _serve(server_config(build_app(coord), cfg), cfg.port)
        return Set(lt, ps, ds, coord, server)
    return lt.run(up())


@pytest.fixture
def make_set(lt, tmp_path):
    """A fresh coordinator over fresh fakes, for tests that change the instances."""
    made: list[Set] = []

    def make(n_p: int = 1, n_d: int = 1, **extra) -> Set:
        made.append(_make(lt, n_p, n_d, tmp_path, **extra))
        return made[-1]

    yield make
    for s in made:
        s.stop()


@pytest.fixture(scope="module")
def limited(lt, tmp_path_factory):
    """One set for the client-limit tests (they change nothing): maxRequestLength 1 MB."""
    s = _make(lt, key_folder=tmp_path_factory.mktemp("limited"), maxRequestLength=1)
    yield s
    s.stop()


CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _wait(cond, timeout_s: float = 5.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - t0


def _is_oai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    return err


def test_roles_keys_kv_ports_and_signed_params(make_set):
    s = make_set()
    p, d = s.p[0], s.d[0]
    assert p.role == "prefill" and d.role == "decode"
    assert p.key == d.key == s.coord.key
    assert d.role_posts[-1]["peers"][0]["kv_port"] == p.kv_port
    assert "kv_port" not in p.role_posts[-1]["peers"][0]
    r = httpx.post(s.base + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200, r.text
    params = r.json()["params"]
    assert params["remote_request_id"] == "p0-1" and params["signature"]
    trust.verify_params(s.coord.key, params)
    assert p.releases == []                       # D took it: nothing to release
    # A client's own kv_transfer_params never reach P or D.
    r = httpx.post(s.base + "/v1/completions", timeout=10, json={
        "prompt": "x", "kv_transfer_params": {"remote_host": "10.9.9.9", "signature": "f00"}})
    assert r.status_code == 200 and r.json()["params"]["remote_host"] == "127.0.0.1"


def test_decode_503_goes_to_another_decode_instance_then_503_and_release(make_set):
    s = make_set(n_d=2)
    d0, d1 = s.d
    d0.business_status = 503                      # a role flip, or overloaded
    served = {httpx.post(s.base + "/v1/chat/completions", json=CHAT, timeout=10).json()["served_by"]
              for _ in range(4)}
    assert served == {"d1"}
    assert s.metric("pd_retries_total", 'role="decode"') >= 1
    d1.business_status = 503
    r = httpx.post(s.base + "/v1/chat/completions", json=CHAT, timeout=10)
    assert "no decode instance" in _is_oai_error(r, 503)["message"]
    _wait(lambda: s.p[0].releases)                # P is told to drop the KV nobody took
    assert s.p[0].releases[-1] == {"remote_request_id": f"p0-{s.p[0].n}"}
    # Both D gone: refused at once, without a prefill on P.  (A D that answers 503 is
    # up again at the next health check: its status shows its role and key.)
    d0.business_status = d1.business_status = None
    for d in (d0, d1):
        s.lt.run(d.stop())
    _wait(lambda: httpx.get(s.base + "/health").status_code == 503, 3)
    prefills = s.p[0].n
    r = httpx.post(s.base + "/v1/chat/completions", json=CHAT, timeout=10)
    assert "no decode instance is available" in _is_oai_error(r, 503)["message"]
    assert s.p[0].n == prefills
    # They come back: the health loop gives them their role and key and marks them up.
    for d in (d0, d1):
        s.lt.run(d.start())
    _wait(lambda: httpx.get(s.base + "/health").status_code == 200, 3)
    assert httpx.post(s.base + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200


def test_prefill_503_goes_to_another_prefill_instance(make_set):
    s = make_set(n_p=2)
    s.p[0].business_status = 503
    for _ in range(3):
        r = httpx.post(s.base + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 200 and r.json()["params"]["remote_request_id"].startswith("p1-")


def test_a_full_prefill_instance_stays_in_rotation(make_set):
    """P answers "exports full" (503 with Retry-After): that request gets a 503 that says
    when to retry, and P is not marked down for every other client."""
    s = make_set()
    p = s.p[0]
    p.business_status, p.retry_after = 503, "1"
    r = httpx.post(s.base + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert "no prefill instance" in _is_oai_error(r, 503)["message"]
    assert r.headers["retry-after"] == "1"
    assert s.coord.cfg.prefill[0].up                         # still in rotation
    p.business_status = None
    r = httpx.post(s.base + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 200, r.text
    # A 503 that does not say when (stopping) is down until the health loop sees it well
    # (its health says unwell meanwhile: a health round every 0.2 s could otherwise mark
    # it up again before the assertion on a slow host).
    p.business_status, p.retry_after, p.unwell = 503, None, True
    httpx.post(s.base + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert not s.coord.cfg.prefill[0].up


def test_instances_on_other_weights_are_not_paired(make_set, lt, tmp_path):
    """At start the coordinator refuses to pair P and D on two checkpoints, naming both;
    later, an instance that comes back on other weights gets no role and stays down."""
    with pytest.raises(RuntimeError) as e:
        make_set(models=("f00d", "beef"))
    assert "/models/f00d" in str(e.value) and "/models/beef" in str(e.value)
    s = make_set()
    d = s.d[0]
    s.lt.run(d.stop())
    d.model = "beef"                              # restarted on another checkpoint
    s.lt.run(d.start())
    _wait(lambda: httpx.get(s.base + "/health").status_code == 503, 3)
    time.sleep(3 * HEALTH_S)
    assert d.role is None and len(d.role_posts) == 1
    _is_oai_error(httpx.post(s.base + "/v1/chat/completions", json=CHAT, timeout=10), 503)


def test_decode_refusal_is_relayed_and_releases_the_kv(make_set):
    s = make_set()
    s.d[0].business_status = 400
    before = s.metric("pd_requests_total", 'outcome="refused"')
    r = httpx.post(s.base + "/v1/chat/completions", json=CHAT, timeout=10)
    _is_oai_error(r, 400)
    _wait(lambda: s.p[0].releases == [{"remote_request_id": "p0-1"}])
    assert s.metric("pd_requests_total", 'outcome="refused"') == before + 1
    _wait(lambda: s.metric("pd_kv_releases_total", 'result="ok"') == 1)
    assert httpx.get(s.base + "/health").status_code == 200     # a 400 is not D's fault


def test_restarted_instance_gets_its_role_and_key_back(make_set):
    s = make_set()
    d = s.d[0]
    s.lt.run(d.stop())
    _wait(lambda: httpx.get(s.base + "/health").status_code == 503, 3)
    r = httpx.post(s.base + "/v1/chat/completions", json=CHAT, timeout=10)
    _is_oai_error(r, 503)
    s.lt.run(d.start())                           # back on the same port, with no role
    t = _wait(lambda: httpx.post(s.base + "/v1/chat/completions", json=CHAT,
                                 timeout=10).status_code == 200, 5)
    assert d.role == "decode" and d.key == s.coord.key and t < 5 * HEALTH_S + 1
    assert s.metric("pd_role_assignments_total", 'instance="decode0"') == 2


def test_an_instance_with_another_key_gets_the_role_again(make_set):
    """Under the API key's authority the coordinator hands its key over with the role."""
    s = make_set(apiKey="s3cret")
    assert s.d[0].role_posts[-1]["kv_transfer_key"] == s.coord.key.hex()
    s.d[0].key = trust.new_key()                  # e.g. assigned by another coordinator
    _wait(lambda: s.d[0].key == s.coord.key, 3)
    assert len(s.d[0].role_posts) == 2


def test_the_key_travels_only_under_an_api_key_and_calls_are_signed(make_set):
    """With the key file alone the role body carries no key (the instances read the
    file); an instance holding another key cannot be given the role, and stays down."""
    s = make_set()
    assert all("kv_transfer_key" not in f.role_posts[-1] for f in s.p + s.d)
    s.d[0].key = trust.new_key()
    _wait(lambda: httpx.get(s.base + "/health").status_code == 503, 3)
    assert len(s.d[0].role_posts) == 1 and s.d[0].key != s.coord.key


def test_a_role_another_caller_posted_is_replaced(make_set):
    """Someone holding a credential posts D other peers: the next health check sees D's
    role version move and posts the coordinator's role again (D then purges)."""
    s = make_set()
    d = s.d[0]
    body = {"local": {}, "peers": [{"server_ip": "127.0.0.1", "kv_port": 9}]}
    content = json.dumps(body).encode()
    r = httpx.post(d.url + "/v1/role/decode", content=content, timeout=5, headers={
        trust.CALL_HEADER: trust.sign_call(d.key, "POST", "/v1/role/decode", content)})
    assert r.status_code == 200
    _wait(lambda: len(d.role_posts) == 3, 3)
    assert d.role_posts[-1] == d.role_posts[0]


def test_a_prefill_kv_port_change_reaches_decode(make_set):
    s = make_set()
    s.p[0].kv_port = free_port()
    _wait(lambda: s.d[0].role_posts[-1]["peers"][0]["kv_port"] == s.p[0].kv_port, 3)


def test_one_outcome_per_request_and_a_stream_failing_midway_is_failed_only(make_set):
    s = make_set()

    def counts() -> dict:
        return {o: s.metric("pd_requests_total", f'outcome="{o}"')
                for o in ("ok", "failed", "refused", "bad_request", "cancelled")}

    before = counts()
    with httpx.stream("POST", s.base + "/v1/chat/completions", json={**CHAT, "stream": True},
                      timeout=10) as r:
        assert "[DONE]" in "".join(r.iter_text())
    httpx.post(s.base + "/v1/chat/completions", content=b"[1]", timeout=10)
    s.d[0].die_mid_stream = True
    with httpx.stream("POST", s.base + "/v1/chat/completions", json={**CHAT, "stream": True},
                      timeout=10) as r:
        text = "".join(r.iter_text())
    assert "failed mid-stream" in text
    _wait(lambda: sum(counts().values()) == sum(before.values()) + 3)
    after = counts()
    assert {k: after[k] - before[k] for k in after} == {
        "ok": 1, "failed": 1, "refused": 0, "bad_request": 1, "cancelled": 0}


def test_status_needs_the_api_key_metrics_and_health_do_not(make_set):
    s = make_set(apiKey="s3cret")
    err = _is_oai_error(httpx.get(s.base + "/v1/status"), 401)
    assert err["type"] == "authentication_error"
    _is_oai_error(httpx.get(s.base + "/v1/status", headers={"Authorization": "Bearer wrong"}), 401)
    r = httpx.get(s.base + "/v1/status", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["kv_transfer_key_id"] == s.coord.key_id
    assert httpx.get(s.base + "/health").status_code == 200
    assert httpx.get(s.base + "/metrics").status_code == 200


# ---- client limits -----------------------------------------------------------------------

@pytest.mark.parametrize("content, needle", [
    (b"", "empty"), (b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"),
    (b'"text"', "JSON object"), (b"\xff\xfe", "not valid JSON"),
    (b"[" * 65 + b"]" * 65, "JSON object"),
    (b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1), "nests deeper"),
    (b"[" * 5000 + b"]" * 5000, "not valid JSON"),       # orjson's own depth limit
])
def test_bad_bodies_are_400_in_the_openai_shape(limited, content, needle):
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = httpx.post(limited.base + path, content=content, timeout=10)
        assert needle in _is_oai_error(r, 400)["message"]


def test_unknown_routes_and_methods_are_in_the_openai_shape(limited):
    _is_oai_error(httpx.get(limited.base + "/v1/nothing"), 404)
    _is_oai_error(httpx.get(limited.base + "/v1/chat/completions"), 405)


def _recv_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return data


def test_a_400_mb_body_is_refused_at_once_and_health_stays_fast(limited):
    """Content-Length says 400 MB: 413 before reading it, while a sender keeps pushing."""
    sock = socket.create_connection(("127.0.0.1", limited.port))
    stop, result = threading.Event(), {}

    def push():
        result["t0"] = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 419430400\r\n\r\n")
        chunk = b" " * 65536
        try:
            while not stop.is_set():
                sock.sendall(chunk)
        except OSError:
            pass

    def read():
        result["data"] = _recv_until_closed(sock, 10)
        result["t1"] = time.monotonic()

    threads = [threading.Thread(target=push), threading.Thread(target=read)]
    for t in threads:
        t.start()
    worst = 0.0
    with httpx.Client(timeout=5) as c:
        while threads[1].is_alive():
            t0 = time.monotonic()
            assert c.get(limited.base + "/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(10)
    sock.close()
    assert result["data"].startswith(b"HTTP/1.1 413"), result["data"][:200]
    assert b'"code":413' in result["data"] and b"maxRequestLength" in result["data"]
    took = result["t1"] - result["t0"]
    print(f"400 MB body: 413 and closed after {took * 1000:.0f} ms; worst /health "
          f"{worst * 1000:.0f} ms")
    assert took < 1.0 and worst < 0.2


def test_a_streamed_body_is_cut_at_the_limit(limited):
    """No Content-Length (chunked): 413 once the body passes 1 MB, not at its end."""
    sent = [0]

    def body():
        for _ in range(1024):                     # 1024 x 64 KB = 64 MB if nobody stopped it
            sent[0] += 65536
            yield b" " * 65536

    try:
        r = httpx.post(limited.base + "/v1/completions", content=body(), timeout=10)
        assert "maxRequestLength" in _is_oai_error(r, 413)["message"]
    except httpx.TransportError:                  # closed while httpx was still writing
        pass
    # Cut soon after 1 MB: what more the client wrote went into the sockets' buffers
    # (loopback's autotuned buffers hold a few MB).
    assert sent[0] < 16 * 1024 * 1024


def _wait_closed(socks: list[socket.socket], limit_s: float) -> dict[int, float]:
    """Seconds until each socket was closed by the server (EOF or reset)."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    t0, closed = time.monotonic(), {}
    while len(closed) < len(socks) and time.monotonic() - t0 < limit_s:
        for key, _ in sel.select(timeout=0.2):
            try:
                data = key.fileobj.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                closed[key.fileobj.fileno()] = time.monotonic() - t0
                sel.unregister(key.fileobj)
    sel.close()
    return closed


def test_half_sent_requests_are_all_closed_within_the_timeouts(limited):
    n = int(os.environ.get("PD_HALF_SENT", "200"))     # PD_HALF_SENT=1000 for the full figure
    socks = []
    try:
        t0 = time.monotonic()
        for i in range(n):
            s = socket.create_connection(("127.0.0.1", limited.port))
            if i % 2:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            else:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          b"application/json\r\nContent-Length: 1000\r\n\r\n{\"messages\":")
            socks.append(s)
        opened = time.monotonic() - t0
        assert httpx.get(limited.base + "/health", timeout=5).status_code == 200
        closed = _wait_closed(socks, max(HEADER_S, BODY_S) + 5)
        print(f"{n} half-sent requests (opened in {opened:.2f} s): {len(closed)} closed, the "
              f"last {max(closed.values()) + opened:.2f} s after the first connected")
        assert len(closed) == n
        assert max(closed.values()) + opened < max(HEADER_S, BODY_S) + 2
    finally:
        for s in socks:
            s.close()
    assert httpx.post(limited.base + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200


def test_late_headers_get_408_in_the_openai_shape_on_every_path(limited):
    """The coordinator answers every error in OpenAI's shape, /health's included."""
    for line in (b"POST /v1/chat/completions HTTP/1.1", b"GET /health HTTP/1.1"):
        with socket.create_connection(("127.0.0.1", limited.port)) as s:
            s.sendall(line + b"\r\nHost: x\r\n")
            data = _recv_until_closed(s, HEADER_S + 5)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        assert json.loads(body)["error"]["type"] == "timeout_error", body


def test_slow_body_gets_408_in_the_openai_shape(limited):
    with socket.create_connection(("127.0.0.1", limited.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        data = _recv_until_closed(s, BODY_S + 5)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), head
    assert json.loads(body)["error"]["code"] == 408


@pytest.mark.timeout(120)
def test_property_no_server_error_on_any_body(limited):
    """Any JSON body (reusing the daemon's fuzz strategies) and any bytes: never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from tests.daemon.test_daemon_fuzz import _bodies

    raw = st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
                    st.one_of(st.binary(max_size=64),
                              st.integers(1, 3000).map(lambda k: b"[" * k + b"]" * k),
                              st.integers(1, 3000).map(lambda k: b'{"a":' * k + b"1" + b"}" * k)))
    n = int(os.environ.get("PD_FUZZ_EXAMPLES", "300"))
    seen: dict[int, int] = {}
    with httpx.Client(base_url=limited.base, timeout=10) as client:
        @settings(max_examples=n, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.one_of(_bodies(), raw))
        def run(case):
            path, body = case
            r = client.post(path, content=body) if isinstance(body, bytes) else \
                client.post(path, json=body)
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body, r.text[:300])
            if r.status_code != 200:
                assert r.headers.get("content-type", "").startswith("application/json"), \
                    (r.status_code, r.headers, r.text[:300])
                err = r.json()["error"]
                assert err["code"] == r.status_code and err["message"], err

        run()
    print("status counts:", seen)
    assert sum(seen.values()) >= n and seen.get(200, 0) > n // 10 and seen.get(400, 0) > n // 10, seen


# ---- real daemons (demo model) -----------------------------------------------------------

@pytest.fixture(scope="module")
def real_set(tmp_path_factory):
    from tests.pd.test_pd import ENV, Coordinator as PDCoordinator, _pd_config
    daemons = [Daemon(_pd_config(tmp_path_factory.mktemp(n)), env=ENV) for n in ("p", "d")]
    holder = {"p": daemons[0], "d": daemons[1], "env": ENV}
    c = None
    try:
        with ThreadPoolExecutor(2) as pool:        # both start at once; a failure raises
            list(pool.map(Daemon.start, daemons))
        c = PDCoordinator(tmp_path_factory.mktemp("c"), *daemons)
        holder["c"] = c
        yield holder
    finally:
        if c is not None:
            c.stop()
        for d in {id(x): x for x in (*daemons, holder["p"], holder["d"])}.values():
            d.kill()


def _real_metric(base: str, name: str, label: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow
@pytest.mark.demo
@pytest.mark.skipif(not demo_model_ready(), reason="demo model not present")
class TestRealDaemons:
    def test_one_outcome_per_request_and_release_on_refusal(self, real_set):
        p, c = real_set["p"], real_set["c"]

        def outcome(o: str) -> float:
            return _real_metric(c.base, "pd_requests_total", f'outcome="{o}"')

        ok, refused = outcome("ok"), outcome("refused")
        r = httpx.post(c.base + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200, r.text
        with httpx.stream("POST", c.base + "/v1/completions", timeout=60,
                          json={"model": MODEL_NAME, "prompt": "hello " * 40, "max_tokens": 4,
                                "stream": True}) as r:
            assert r.status_code == 200 and "[DONE]" in "".join(r.iter_text())
        assert outcome("ok") == ok + 2
        # P takes it (the coordinator drops stream_options for P), D refuses it: P is told to
        # drop the rows at once instead of holding them for their 30 s lifetime.
        r = httpx.post(c.base + "/v1/chat/completions", timeout=60, json={
            **CHAT, "messages": [{"role": "user", "content": "hello " * 40}],
            "stream_options": {"include_usage": "yes"}})
        assert r.status_code == 400, r.text
        assert outcome("refused") == refused + 1
        _wait(lambda: _real_metric(c.base, "pd_kv_releases_total", 'result="ok"') >= 1, 5)
        _wait(lambda: p.status()["pd"]["exports_held"] == 0, 5)

    def test_decode_killed_and_restarted_gets_its_role_back(self, real_set):
        d, c = real_set["d"], real_set["c"]
        assert httpx.post(c.base + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        t_kill = time.monotonic()
        _wait(lambda: httpx.get(c.base + "/health", timeout=5).status_code == 503, 10)
        fresh = Daemon(d.config, env=real_set["env"])
        real_set["d"] = fresh
        fresh.start()                                  # the same config: the same ports
        t_up = time.monotonic()
        while True:
            r = httpx.post(c.base + "/v1/chat/completions", json=CHAT, timeout=60)
            if r.status_code == 200:
                break
            assert r.status_code == 503, r.text
            assert time.monotonic() - t_kill < 15, r.text
            time.sleep(0.1)
        done = time.monotonic()
        print(f"D restarted in {t_up - t_kill:.1f} s after SIGKILL; requests succeed again "
              f"{done - t_up:.1f} s later ({done - t_kill:.1f} s after the kill)")
        assert fresh.status()["pd"]["role"] == "decode"
        assert httpx.get(c.base + "/health", timeout=5).status_code == 200
