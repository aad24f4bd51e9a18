"""One daemon's part in PD disaggregation (``inferMode: "dmi"``): its role, KV and counters.

A prefill instance (P), for a request carrying ``kv_transfer_params: {"do_remote_decode":
true}``, prefills the prompt (the MTP layer too), exports the full prompt blocks' rows and
answers with ``kv_transfer_params`` naming its KV port and the request to pull.  A decode
instance (D), for a request carrying those params, pulls the rows from P (only from a
peer: never from an address a body names otherwise), checks their layout, and hands them
to the engine, which computes only the prompt's tail (the partial last block and the last
token: D samples the first token itself, with the request's seed, so outputs equal a
co-located daemon's) and decodes with MTP.  A pull that fails (P gone, timed out, rows
expired, a layout that is not D's) is counted and D computes the whole prompt instead:
the answer is the same, only slower.  Requests without params are served co-located.
"""
from __future__ import annotations

import dataclasses
import logging
import ssl
from dataclasses import dataclass
from typing import Any

from server.api.errors import APIError
from server.engine.protocol import EngineRequest
from server.pd.kv_client import pull_kv
from server.pd.kv_exports import KVExports
from server.pd.roles import RoleState
from server.pd.wire import KVRows, TransferError, layout_of

log = logging.getLogger("server.pd")


@dataclass(frozen=True)
class PDSettings:
    role: str | None                  # fixed in the config (pdRole), else assigned by POST
    peers: tuple[str, ...]
    host: str                         # where P's KV port listens (ipAddress)
    port: int                         # interCommPort
    trans_timeout_s: float            # kv_trans_timeout (<= 0 means 1, as in MindIE)
    link_timeout_s: float             # kv_link_timeout (<= 0 means 1080)


def pd_settings(cfg: Any) -> PDSettings | None:
    s = cfg.server
    if s.infer_mode != "dmi":
        return None
    mc = cfg.model_config
    return PDSettings(s.pd_role, tuple(s.pd_peers), s.ip_address, s.inter_comm_port,
                      float(mc.kv_trans_timeout if mc.kv_trans_timeout > 0 else 1),
                      float(mc.kv_link_timeout if mc.kv_link_timeout > 0 else 1080))


class PDMetrics:
    def __init__(self, registry: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge
        kw = {"registry": registry if registry is not None else CollectorRegistry()}
        self.transfers = Counter("kv_transfers", "KV transfers between PD instances",
                                 ["direction"], **kw)
        self.bytes = Counter("kv_transfer_bytes", "bytes of KV moved between PD instances",
                             ["direction"], **kw)
        self.failures = Counter("kv_transfer_failures", "KV transfers that failed (D then "
                                "computed the prompt itself)", ["reason"], **kw)
        self.held = Gauge("kv_exports_held", "prefill exports waiting to be pulled", **kw)
        for d in ("sent", "received"):
            self.transfers.labels(d)
            self.bytes.labels(d)


class PDInstance:
    def __init__(self, settings: PDSettings, runtime: Any, registry: Any = None,
                 client_ssl: ssl.SSLContext | None = None) -> None:
        self.settings = settings
        self.roles = RoleState()
        if settings.role is not None:
            self.roles.assign(settings.role, {"local": {}, "peers": [
                {"server_ip": p} for p in settings.peers] or [{"server_ip": settings.host}]})
        # A pull arrives within milliseconds of P's answer; rows nobody took are dropped.
        self.exports = KVExports(ttl_s=max(30.0, 3 * settings.trans_timeout_s))
        self.layout = layout_of(runtime.num_kv_layers, runtime.block_size, runtime.kv_block_bytes,
                                f"{runtime.kv_cache_dtype},mtp={int(runtime.mtp_enabled)}")
        self.bytes_per_block = runtime.kv_block_bytes
        self.metrics = PDMetrics(registry)
        self.client_ssl = client_ssl

    # -- the engine's side -------------------------------------------------------------
    def on_export(self, request_id: str, num_blocks: int, rows: bytes) -> None:
        """The engine thread files a prefill's rows (EngineCore.kv_export_sink)."""
        self.exports.put(request_id, KVRows(num_blocks, self.bytes_per_block, self.layout, rows))
        self.metrics.held.set(self.exports.num_held)

    def on_sent(self, num_bytes: int) -> None:
        self.metrics.transfers.labels("sent").inc()
        self.metrics.bytes.labels("sent").inc(num_bytes)
        self.metrics.held.set(self.exports.num_held)

    def on_failed(self, reason: str) -> None:
        self.metrics.failures.labels(reason).inc()

    # -- the serving layer's side ------------------------------------------------------
    def check_role(self) -> None:
        if self.roles.role is None:
            raise APIError(503, "this PD instance has no role yet: POST /v1/role/prefill or "
                                "/v1/role/decode on its management plane (or set "
                                "ServerConfig.pdRole)")

    async def prepare(self, er: EngineRequest, params: dict | None) -> EngineRequest:
        """Adapt one engine request to this instance's role and the request's params."""
        self.check_role()
        if not params:
            return er
        if self.roles.role == "prefill":
            if params.get("do_remote_decode") is not True:
                raise APIError(400, "a prefill instance takes kv_transfer_params "
                                    "{\"do_remote_decode\": true}", "kv_transfer_params")
            return dataclasses.replace(er, export_kv=True)
        host, port, rid = (params.get("remote_host"), params.get("remote_port"),
                           params.get("remote_request_id"))
        if not isinstance(host, str) or not isinstance(port, int) or not isinstance(rid, str):
            raise APIError(400, "kv_transfer_params needs remote_host (string), remote_port "
                                "(integer) and remote_request_id (string)", "kv_transfer_params")
        if not self.roles.is_peer(host):
            raise APIError(400, f"kv_transfer_params.remote_host {host!r} is not a peer of "
                                "this decode instance", "kv_transfer_params")
        try:
            rows = await pull_kv(host, port, rid, connect_timeout_s=self.settings.link_timeout_s,
                                 transfer_timeout_s=self.settings.trans_timeout_s,
                                 ssl_ctx=self.client_ssl)
        except TransferError as exc:
            log.warning("KV pull for %s failed (%s); computing the prompt here", er.request_id, exc)
            self.on_failed("pull")
            return er
        if rows.layout != self.layout or rows.bytes_per_block != self.bytes_per_block:
            log.warning("KV rows from %s:%d have layout %s, this instance %s; computing the "
                        "prompt here", host, port, rows.layout, self.layout)
            self.on_failed("layout")
            return er
        self.metrics.transfers.labels("received").inc()
        self.metrics.bytes.labels("received").inc(len(rows.payload))
        return dataclasses.replace(er, remote_kv=rows.rows())

    def response_params(self, er: EngineRequest) -> dict:
        """P's answer: where D pulls this request's rows."""
        if not er.export_kv:
            return {}
        if er.request_id not in self.exports:
            raise APIError(500, "the prefill finished without exporting its KV")
        return {"kv_transfer_params": {
            "do_remote_prefill": True, "remote_host": self.settings.host,
            "remote_port": self.settings.port, "remote_request_id": er.request_id,
            "layout": self.layout}}

    def status(self) -> dict:
        return {"role": self.roles.role, "peers": sorted(self.roles.peers),
                "kv_port": self.settings.port, "layout": self.layout,
                "exports_held": self.exports.num_held}
