"""The coordinator's instances: their roles, their health and their load.

At start the coordinator waits for every instance's management plane, checks that MTP is
configured alike on P and D (MindIE's rule) and that every instance serves the same
weights (their ``pd.model_fingerprint``: rows of other weights are wrong answers), and with
``assignRoles`` posts each its role (MindIE's V1 role body, ``role_body``, with, for a
decode instance, its prefill peers' KV ports).

Every call that changes an instance's state (a role, a KV release) is signed with the
deployment's KV transfer key (``X-MTP-PD-Auth``, server/pd/trust.py ``sign_call``) and
carries the ``apiKey`` when one is set: an instance takes such calls from nobody else.
The key itself travels in the role body (``kv_transfer_key``) only when the call is
authorized by the ``apiKey``; otherwise the instances read it from their own file.

Health: every ``healthInterval`` seconds each instance's management ``GET /v1/status``
is read.  An instance is down while it cannot be reached, is not running, or does not
hold the role and the KV transfer key this coordinator gave it, or its role version says
another caller posted it a role since ours; with ``assignRoles`` the coordinator then
posts the role again (a restarted instance comes back with none) and
the instance is up once its status shows the role and the key id.  An instance that
serves other weights than the fleet's is down and gets no role, whatever else is well.
Routing skips instances that are down (``candidates``: the live ones, least loaded
first); ``/health`` is 503 while a role has no live instance.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from server.web.api_keys import ApiKeys
from server.pd import trust
from server.pd.coordinator.config import CoordinatorConfig, Instance

log = logging.getLogger("server.pd")
STATUS_TIMEOUT_S = 5.0       # a health check's GET /v1/status (at most)


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


class Fleet:
    """The instances of ``cfg``, the HTTP client that reaches them, and the metrics
    registry (instance gauges here; the request counters are routing.py's)."""

    def __init__(self, cfg: CoordinatorConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = cfg
        self.key = cfg.kv_transfer_key if cfg.kv_transfer_key is not None else trust.new_key()
        self.key_id = trust.key_id(self.key)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s,
                                                              connect=cfg.connect_timeout_s),
                                        transport=transport)
        self.auth = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.api_keys = ApiKeys((cfg.api_key,) if cfg.api_key else ())
        self.mtp_on: bool | None = None
        self.model: tuple[str, str] | None = None   # (fingerprint, the first instance's path)
        self._health_task: asyncio.Task | None = None
        self.registry = CollectorRegistry()
        self.in_flight = Gauge("pd_in_flight", "requests in flight per instance", ["instance"],
                               registry=self.registry)
        self.up = Gauge("pd_instance_up", "1 while the instance is live with its role and key",
                        ["instance"], registry=self.registry)
        self.role_posts = Counter("pd_role_assignments", "roles posted to instances (at start "
                                  "and after a restart)", ["instance"], registry=self.registry)
        for inst in self.instances:
            self.in_flight.labels(inst.name).set(0)
            self.up.labels(inst.name).set(1 if inst.up else 0)

    @property
    def instances(self) -> list[Instance]:
        return self.cfg.prefill + self.cfg.decode

    def _peers(self, inst: Instance) -> list[Instance]:
        return self.cfg.decode if inst.role == "prefill" else self.cfg.prefill

    async def post(self, url: str, body: dict, timeout: float) -> httpx.Response:
        """A state-changing management call: signed with the key, with the apiKey if set."""
        content = orjson.dumps(body)
        headers = {**self.auth, "content-type": "application/json",
                   trust.CALL_HEADER: trust.sign_call(self.key, "POST", urlsplit(url).path,
                                                      content)}
        return await self.client.post(url, content=content, headers=headers, timeout=timeout)

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
        await self._check_alike()
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

    @staticmethod
    def _model_of(st: dict) -> tuple[str | None, str | None]:
        """(weights fingerprint, weights path) from an instance's status."""
        pd = st.get("pd") if isinstance(st.get("pd"), dict) else {}
        fp, path = pd.get("model_fingerprint"), pd.get("model_weight_path")
        return (fp if isinstance(fp, str) else None, path if isinstance(path, str) else None)

    async def _check_alike(self) -> None:
        """MindIE's rule for MTP under PD: configured on both P and D.  A P without it writes
        no MTP-layer KV for D to draft from; the instances must agree on k > 0.  And one
        checkpoint for all: D would load rows other weights computed (a rolling upgrade, a
        wrong modelWeightPath) and answer wrongly with HTTP 200."""
        ks, models = {}, {}
        for inst in self.instances:
            try:
                st = await self._status(inst, timeout=10)
            except (httpx.HTTPError, ValueError, RuntimeError, AttributeError) as exc:
                raise RuntimeError(f"{inst.name} ({inst.management}): cannot read its "
                                   f"/v1/status: {exc}") from None
            ks[inst.name], models[inst.name] = self._mtp_k(st), self._model_of(st)
        if len({k > 0 for k in ks.values()}) > 1:
            raise RuntimeError("MTP must be configured on both the prefill and the decode "
                               f"instances (num_speculative_tokens: {ks})")
        self.mtp_on = any(k > 0 for k in ks.values())
        first = self.instances[0].name
        fp, path = models[first]
        for name, (other_fp, other_path) in models.items():
            if other_fp is None or other_fp != fp:
                raise RuntimeError(f"the instances serve different weights: {first} "
                                   f"{path} (fingerprint {fp}), {name} {other_path} "
                                   f"(fingerprint {other_fp}); P and D must load one "
                                   "checkpoint, or D serves rows of the other as its own")
        self.model = (fp, path)

    async def _assign(self, inst: Instance) -> str | None:
        """POST the role (MindIE's V1 body with our key and KV ports); an error or None."""
        body = self._role_body(inst)
        try:
            r = await self.post(f"{inst.management}/v1/role/{inst.role}", body, STATUS_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return f"{inst.name}: role {inst.role} not posted: {exc!r}"
        self.role_posts.labels(inst.name).inc()
        if r.status_code != 200:
            return f"{inst.name}: role {inst.role} refused ({r.status_code}: {r.text[:200]})"
        inst.last_role_body = body
        inst.role_version = None                # the next status read says which it is
        return None

    def _role_body(self, inst: Instance) -> dict:
        """The key goes in the body only under the apiKey's authority; a call signed with
        the key needs no copy of it (and would show it to whoever reads the call)."""
        return role_body(inst, self._peers(inst), self.key if self.cfg.api_key else None)

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
        """(what is wrong, whether posting the role again may fix it); with nothing wrong
        it notes the role version the instance shows (the one our post gave it)."""
        if st.get("status") != "running":
            return f"its status is {st.get('status')!r} ({st.get('error')})", False
        if self.mtp_on is not None and (self._mtp_k(st) > 0) != self.mtp_on:
            return ("its MTP setting differs from the other instances' (num_speculative_"
                    f"tokens {self._mtp_k(st)})"), False
        fp, path = self._model_of(st)
        if self.model is not None and fp != self.model[0]:
            return (f"it serves other weights: {path} (fingerprint {fp}), the other "
                    f"instances {self.model[1]} (fingerprint {self.model[0]})"), False
        pd = st.get("pd")
        if not isinstance(pd, dict):
            return "it is not a PD instance (inferMode \"dmi\")", False
        if pd.get("role") != inst.role:
            return f"its role is {pd.get('role')!r}, not {inst.role!r}", True
        if pd.get("kv_transfer_key_id") != self.key_id:
            return (f"its KV transfer key id is {pd.get('kv_transfer_key_id')!r}, not this "
                    f"coordinator's {self.key_id!r}"), True
        if self.cfg.assign_roles and inst.role == "decode" and \
                inst.last_role_body != self._role_body(inst):
            return "a prefill peer's KV port changed", True
        version = pd.get("role_version")
        if self.cfg.assign_roles and inst.role_version is not None and \
                version != inst.role_version:
            # Someone else's role (other peers, say): ours again, which purges what D
            # loaded from peers under theirs.
            return "another caller posted it a role", True
        inst.role_version = version
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

    # -- load ----------------------------------------------------------------------------
    @staticmethod
    def candidates(pool: list[Instance]) -> list[Instance]:
        return sorted((i for i in pool if i.up), key=lambda i: i.in_flight)

    def _enter(self, inst: Instance) -> None:
        inst.in_flight += 1
        self.in_flight.labels(inst.name).set(inst.in_flight)

    def _leave(self, inst: Instance) -> None:
        inst.in_flight -= 1
        self.in_flight.labels(inst.name).set(inst.in_flight)

    async def stop_health_loop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None

    async def close(self) -> None:
        await self.stop_health_loop()
        await self.client.aclose()
