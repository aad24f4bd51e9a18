"""One daemon's part in PD disaggregation (``inferMode: "dmi"``): its role, KV and counters.

A prefill instance (P), for a request carrying ``kv_transfer_params: {"do_remote_decode":
true}``, reserves room for the prompt's rows (503 when its exports are full), prefills the
prompt (the MTP layer too), exports the full prompt blocks' rows and answers with
``kv_transfer_params`` naming its KV port and the request to pull.  A decode instance
(D), for a request carrying those params as the coordinator signed them, pulls the rows
from that peer's KV port (never from an address or port a body names otherwise), checks
their layout and that each block was computed for its own prompt's tokens (trust.py),
and hands the agreeing blocks to the engine, which computes only the rest of the prompt
(D samples the first token itself, with the request's seed, so outputs equal a
co-located daemon's) and decodes with MTP.  A pull that fails (P gone, timed out, rows
expired, a layout that is not D's, rows of other weights) is counted and D computes the
whole prompt instead: the answer is the same, only slower.  Requests without params are
served co-located.  A request whose params are for the other role (the role changed under
it) gets 503, so the coordinator sends it elsewhere.  Refusals are errors.py's ``PDError``
classes; the serving layer (server/api/serving/pd_calls.py) answers each with its status.

Rows D takes are tagged with the role version they were checked under
(``EngineRequest.remote_kv_epoch``): a role change (new peers, a new key) purges every
prefix block loaded from a peer and every block computed on top of one, and rows checked
under an earlier version are not loaded after it (server/api/planes/pd_routes.py asks the engine,
kv/block_manager.py keeps the tags).
"""
from __future__ import annotations

import dataclasses
import logging
import ssl
from dataclasses import dataclass, field
from typing import Any

from server.config.checkpoint.fingerprint import weights_fingerprint
from server.config.pd_link import parse_peer, read_key_file
from server.engine.protocol import EngineRequest
from server.pd.errors import PDError, PDRefused, PDUnavailable
from server.pd.kv_client import pull_kv
from server.pd.kv_exports import KVExports
from server.pd.roles import RoleState
from server.pd.trust import TrustError, block_digests, key_id, num_matching, verify_params
from server.pd.wire import KVRows, TransferError, layout_fields, layout_of

log = logging.getLogger("server.pd")


@dataclass(frozen=True)
class PDSettings:
    role: str | None                  # fixed in the config (pdRole), else assigned by POST
    peers: tuple[str, ...]            # pdPeers: "ip" or "ip:port" (the peer's KV port)
    host: str                         # where P's KV port listens (ipAddress)
    port: int                         # interCommPort
    trans_timeout_s: float            # kv_trans_timeout (<= 0 means 1, as in MindIE)
    link_timeout_s: float             # kv_link_timeout (<= 0 means 1080)
    key: bytes | None = None          # pdTransferKeyFile's key (else the coordinator's)
    max_exports: int = 256            # pdMaxExports
    max_export_bytes: int = 2 << 30   # pdMaxExportMb
    request_life_s: float = 600.0     # e2eTimeout: how long a reservation may wait
    # role -> why this instance's layout may not take it (a role the management API assigns
    # later obeys the rule config/parallel.py checks for pdRole)
    refused_roles: dict[str, str] = field(default_factory=dict)
    model_fingerprint: str = ""       # the weights' (server/config/checkpoint/fingerprint.py)
    model_path: str = ""              # modelWeightPath, for messages that name the two models


def pd_settings(cfg: Any) -> PDSettings | None:
    s = cfg.server
    if s.infer_mode != "dmi":
        return None
    mc = cfg.model_config
    key = read_key_file(s.pd_transfer_key_file) if s.pd_transfer_key_file else None
    weights = cfg.model_weight_path
    par, refused = cfg.parallel, {}
    if (par.cp > 1 or par.sp > 1) and par.moe_ep > 1:
        refused["decode"] = (f"cp {par.cp} and sp {par.sp} with moe_ep {par.moe_ep}: with MoE "
                             "expert parallel only the P node supports cp and sp (MindIE), so "
                             "this instance takes the prefill role only")
    return PDSettings(s.pd_role, tuple(s.pd_peers), s.ip_address, s.inter_comm_port,
                      float(mc.kv_trans_timeout if mc.kv_trans_timeout > 0 else 1),
                      float(mc.kv_link_timeout if mc.kv_link_timeout > 0 else 1080),
                      key, s.pd_max_exports, s.pd_max_export_mb << 20, float(s.e2e_timeout),
                      refused, weights_fingerprint(weights) if weights else "", str(weights or ""))


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
        self.roles = RoleState(key=settings.key, refused=dict(settings.refused_roles))
        if settings.role is not None:
            peers = [parse_peer(p) for p in settings.peers] or [(settings.host, None)]
            self.roles.assign(settings.role, {"local": {}, "peers": [
                {"server_ip": h, **({"kv_port": p} if p else {})} for h, p in peers]})
        # A pull arrives within milliseconds of P's answer; rows nobody took are dropped.
        self.exports = KVExports(ttl_s=max(30.0, 3 * settings.trans_timeout_s),
                                 max_count=settings.max_exports,
                                 max_bytes=settings.max_export_bytes,
                                 reserve_ttl_s=settings.request_life_s)
        self.layout = layout_of(runtime.num_kv_layers, runtime.block_size, runtime.kv_block_bytes,
                                f"{runtime.kv_cache_dtype},mtp={int(runtime.mtp_enabled)}",
                                settings.model_fingerprint)
        self.block_size = runtime.block_size
        self.bytes_per_block = runtime.kv_block_bytes
        self.metrics = PDMetrics(registry)
        self.client_ssl = client_ssl
        self._answered: set[str] = set()     # P: exports named in an answer, not yet finished

    # -- the engine's side -------------------------------------------------------------
    def on_export(self, request_id: str, num_blocks: int, rows: bytes) -> None:
        """The engine thread files a prefill's rows (EngineCore.kv_export_sink); rows of a
        request that no longer holds a reservation (it failed, or was released) are dropped."""
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
            raise PDUnavailable("this PD instance has no role yet: POST /v1/role/prefill or "
                                "/v1/role/decode on its management plane (or set "
                                "ServerConfig.pdRole)")

    def assign(self, role: str, body: Any, api_version: int = 1) -> int:
        """Take a role body (roles.py; RoleError when it cannot be taken); the new role
        version, which the caller hands the engine so that it purges every block loaded
        from a peer under an earlier one."""
        self.roles.assign(role, body, api_version)
        return self.roles.version

    async def prepare(self, er: EngineRequest, params: dict | None) -> EngineRequest:
        """Adapt one engine request to this instance's role and the request's params."""
        self.check_role()
        if not params:
            return er
        role = self.roles.role
        if role == "prefill":
            if params.get("do_remote_decode") is not True:
                if "remote_request_id" in params:        # a decode request: the role changed
                    raise PDUnavailable("this PD instance is a prefill instance now; "
                                        "send decode requests to a decode instance")
                raise PDRefused("a prefill instance takes kv_transfer_params "
                                "{\"do_remote_decode\": true}", "kv_transfer_params")
            return self._reserve_export(er)
        if params.get("do_remote_decode") is True:       # a prefill request: the role changed
            raise PDUnavailable("this PD instance is a decode instance now; send prefill "
                                "requests to a prefill instance")
        host, port, rid = (params.get("remote_host"), params.get("remote_port"),
                           params.get("remote_request_id"))
        if not isinstance(host, str) or type(port) is not int or not isinstance(rid, str):
            raise PDRefused("kv_transfer_params needs remote_host (string), remote_port "
                            "(integer) and remote_request_id (string)", "kv_transfer_params")
        epoch = self.roles.version           # what the checks below were made under
        try:
            verify_params(self.roles.key, params)
        except TrustError as exc:
            self.on_failed("untrusted")
            raise PDRefused(str(exc), "kv_transfer_params") from None
        if not self.roles.is_peer(host):
            raise PDRefused(f"kv_transfer_params.remote_host {host!r} is not a peer of "
                            "this decode instance", "kv_transfer_params")
        allowed = self.roles.kv_ports_of(host, self.settings.port)
        if port not in allowed:
            raise PDRefused(f"kv_transfer_params.remote_port {port} is not the KV port of "
                            f"peer {host} ({', '.join(map(str, sorted(allowed)))})",
                            "kv_transfer_params")
        er = await self._pull(er, host, port, rid)
        return dataclasses.replace(er, remote_kv_epoch=epoch) if er.remote_kv else er

    def _reserve_export(self, er: EngineRequest) -> EngineRequest:
        num_blocks = (len(er.prompt_token_ids) - 1) // self.block_size
        digests = tuple(block_digests(self.roles.key, er.prompt_token_ids, self.block_size,
                                      num_blocks))
        if not self.exports.reserve(er.request_id, num_blocks * self.bytes_per_block, digests):
            self.on_failed("exports_full")
            # Full, not broken: its Retry-After keeps it in the coordinator's rotation.
            raise PDUnavailable(f"this prefill instance holds {self.exports.num_held} KV "
                                f"exports ({self.exports.bytes_held / 2**20:.0f} MB) waiting "
                                "for decode instances, its limit (pdMaxExports, "
                                "pdMaxExportMb); retry later")
        self.metrics.held.set(self.exports.num_held)
        return dataclasses.replace(er, export_kv=True)

    async def _pull(self, er: EngineRequest, host: str, port: int, rid: str) -> EngineRequest:
        try:
            rows = await pull_kv(host, port, rid, connect_timeout_s=self.settings.link_timeout_s,
                                 transfer_timeout_s=self.settings.trans_timeout_s,
                                 ssl_ctx=self.client_ssl)
        except TransferError as exc:
            log.warning("KV pull for %s failed (%s); computing the prompt here", er.request_id, exc)
            self.on_failed("pull")
            return er
        if rows.layout != self.layout or rows.bytes_per_block != self.bytes_per_block:
            theirs = layout_fields(rows.layout).get("model")
            other_model = theirs != self.settings.model_fingerprint
            log.warning("KV rows from %s:%d %s; computing the prompt here", host, port,
                        f"were computed by other weights (model {theirs}, this instance "
                        f"{self.settings.model_fingerprint}: {self.settings.model_path})"
                        if other_model else
                        f"have layout {rows.layout}, this instance {self.layout}")
            self.on_failed("model" if other_model else "layout")
            return er
        self.metrics.transfers.labels("received").inc()
        self.metrics.bytes.labels("received").inc(len(rows.payload))
        ours = block_digests(self.roles.key, er.prompt_token_ids, self.block_size,
                             rows.num_blocks)
        n = num_matching(ours, rows.digests)
        if n < rows.num_blocks:
            log.warning("KV rows from %s:%d: %d of %d blocks were computed for other tokens "
                        "than this prompt's; computing those here", host, port,
                        rows.num_blocks - n, rows.num_blocks)
            self.on_failed("prompt_mismatch")
        return dataclasses.replace(er, remote_kv=rows.rows()[:n])

    def response_params(self, er: EngineRequest) -> dict:
        """P's answer: where D pulls this request's rows."""
        if not er.export_kv:
            return {}
        if not self.exports.holds_rows(er.request_id):
            raise PDError("the prefill finished without exporting its KV")
        self._answered.add(er.request_id)
        return {"kv_transfer_params": {
            "do_remote_prefill": True, "remote_host": self.settings.host,
            "remote_port": self.settings.port, "remote_request_id": er.request_id,
            "layout": self.layout}}

    def finish(self, ers: list[EngineRequest]) -> None:
        """A request's end on P (once): rows named in its answer wait for D; a reservation
        or rows of a request that failed or lost its client go now."""
        for er in ers:
            if not er.export_kv:
                continue
            if er.request_id in self._answered:
                self._answered.discard(er.request_id)
            elif self.exports.release(er.request_id):
                self.metrics.held.set(self.exports.num_held)

    def release(self, request_id: str) -> bool:
        """The coordinator gave up on a request (D refused it): drop its rows."""
        found = self.exports.release(request_id)
        self.metrics.held.set(self.exports.num_held)
        return found

    def status(self) -> dict:
        ex = self.exports
        return {"role": self.roles.role, "peers": sorted(self.roles.peers),
                "peer_kv_ports": {a: sorted(p) for a, p in sorted(self.roles.kv_ports.items())},
                "kv_port": self.settings.port, "layout": self.layout,
                "model_fingerprint": self.settings.model_fingerprint,
                "model_weight_path": self.settings.model_path,
                "role_version": self.roles.version,
                "kv_transfer_key_id": key_id(self.roles.key),
                "exports_held": ex.num_held, "exports_bytes": ex.bytes_held,
                "exports_sending_bytes": ex.bytes_sending,
                "exports_limit": {"count": ex.max_count, "bytes": ex.max_bytes},
                "exports_refused": ex.num_refused, "exports_expired": ex.num_expired,
                "exports_released": ex.num_released}
