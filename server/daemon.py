"""The daemon: engine plus three HTTP planes (business, management, metrics) in one loop.

Start-up order, so that every failure is clear and early, and comes before any port:
  1. TLS (httpsEnabled): each plane's certificate, key, password, CA and CRL files are
     loaded into its SSLContext (a wrong password names the file; never a prompt);
  2. tokenizer, model and engine load (a checkpoint that cannot be served fails here);
  3. every listening socket is bound, then all listen: all ports or none;
  4. the engine thread starts, uvicorn serves each address; once all listen:
     ``Daemon start success!``.
Stop (SIGTERM, SIGINT, POST /stopService): refuse new requests with 503, let in-flight
ones finish (at most e2eTimeout), shut the engine down, close the servers, exit 0.  A
second SIGTERM/SIGINT stops at once; a drain cut short (by it or by the deadline) exits
EXIT_DRAIN_CUT (3), so a supervisor can tell that requests were lost.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from server.api.app import build_app
from server.api.limits import Admission
from server.api.settings import settings_from_config
from server.api.state import ServerState
from server.api.tls import listener_contexts
from server.web.api_keys import ApiKeys
from server.web.header_timeout import header_timeout_protocol
from server.web.tls_files import TlsError
from server.metrics import make_metrics
from server.pd.instance import PDInstance, pd_settings
from server.pd.kv_server import KVServer
from server.pd.tls import kv_link_contexts

log = logging.getLogger("server.daemon")
READY_LINE = "Daemon start success!"
EXIT_OK, EXIT_FAIL = 0, 1
EXIT_DRAIN_CUT = 3          # stopped before every in-flight request finished


class DaemonError(RuntimeError):
    """A start-up failure with a message meant for the operator."""


@dataclass
class Listener:
    host: str
    port: int
    planes: set[str]
    sock: socket.socket | None = None


def plan_listeners(cfg: Any) -> list[Listener]:
    """Group planes by address: planes on the same ip:port share one server (MindIE rule)."""
    s = cfg.server
    wanted = [("business", s.ip_address, s.port),
              ("management", cfg.management_ip, s.management_port),
              ("metrics", cfg.management_ip, s.metrics_port)]
    groups: dict[tuple[str, int], Listener] = {}
    for plane, host, port in wanted:
        groups.setdefault((host, port), Listener(host, port, set())).planes.add(plane)
    return list(groups.values())


def bind(listener: Listener, listen: bool = True) -> socket.socket:
    family = socket.AF_INET6 if ":" in listener.host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets
    # whose protocol says TCP, and accepted sockets inherit it from this one.  With Nagle
    # on, the body of every response after a connection's first waited for the client's
    # delayed ACK of the headers: 40 ms more per keep-alive request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((listener.host, listener.port))
    except OSError as exc:
        sock.close()
        raise DaemonError(f"{'+'.join(sorted(listener.planes))} http server cannot listen on "
                          f"{listener.host}:{listener.port}: {exc.strerror or exc} "
                          "(port occupied or address not local)") from None
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def tls_contexts(cfg: Any, listeners: list[Listener]) -> list[ssl.SSLContext | None]:
    """Each listener's SSLContext (None without httpsEnabled): every file, password, CA and
    CRL is loaded now, before the checkpoint and before any port, so a wrong password is
    a clear start-up error naming the file (server/api/tls.py)."""
    try:
        return listener_contexts(cfg, listeners)
    except TlsError as exc:
        raise DaemonError(str(exc)) from None


def bind_all(listeners: list[Listener]) -> None:
    """Bind every listener's socket, then listen on all: all ports or none.  A port that
    cannot be bound closes the ones already bound before any of them accepted a client."""
    try:
        for lst in listeners:
            lst.sock = bind(lst, listen=False)
        for lst in listeners:
            lst.sock.listen(2048)
    except BaseException:
        for lst in listeners:
            if lst.sock is not None:
                lst.sock.close()
                lst.sock = None
        raise


class _Server(uvicorn.Server):
    """uvicorn server that leaves signals to the daemon (several servers share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def load_engine(cfg: Any, launch: Any = None) -> tuple[Any, Any]:
    """The tokenizer and the engine: the process ``launch`` started (front/engine_process.py),
    else an engine thread here ($MTP_SERVE_ENGINE_PROCESS=0)."""
    from server.text.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(cfg.model_weight_path)
    if launch is not None:
        return tokenizer, launch.wait()
    from server.engine.front.async_engine import AsyncEngine
    return tokenizer, AsyncEngine.from_config(cfg, tokenizer=tokenizer)


class Daemon:
    def __init__(self, cfg: Any, launch: Any = None) -> None:
        self.cfg = cfg
        self.launch = launch               # engine_process.EngineLaunch, or None: a thread
        self.stop = asyncio.Event()
        self.servers: list[_Server] = []
        self.fatal: str | None = None      # the worker group failed: exit non-zero
        self.force = asyncio.Event()       # a second SIGTERM/SIGINT: stop draining now

    def _on_fatal(self, error: str) -> None:
        """The engine's worker group is gone: in-flight requests have failed with ``error``
        and /health answers 503; stop after a grace period that lets probes see it."""
        self.fatal = error
        delay = self.cfg.fatal_exit_delay_s
        log.error("worker group failed (%s); stopping in %gs with exit code %d", error, delay, EXIT_FAIL)
        asyncio.get_running_loop().call_later(delay, self.request_stop)

    def request_stop(self) -> None:
        if not self.stop.is_set():
            log.info("stop requested: draining")
            self.stop.set()

    def _on_signal(self) -> None:
        """First SIGTERM/SIGINT: drain.  Second: stop now, exit EXIT_DRAIN_CUT (an operator
        who signals twice means it, and a stuck request must not keep the process)."""
        if self.stop.is_set():
            if not self.force.is_set():
                log.warning("second stop signal: not waiting for in-flight requests")
                self.force.set()
                for server in self.servers:
                    server.force_exit = True
            return
        self.request_stop()

    async def run(self) -> int:
        cfg = self.cfg
        listeners = plan_listeners(cfg)
        contexts = tls_contexts(cfg, listeners)
        pd_cfg = pd_settings(cfg)            # inferMode dmi: a KV port, its TLS checked now
        kv_tls = kv_link_contexts(cfg) if pd_cfg else (None, None)
        kv_lst = Listener(pd_cfg.host, pd_cfg.port, {"kv-transfer"}) if pd_cfg else None
        # The checkpoint first: a checkpoint that cannot be served (a quantized tensor
        # missing its scale, say) fails the start before any port is bound.
        tokenizer, engine = await asyncio.to_thread(load_engine, cfg, self.launch)
        try:
            bind_all(listeners + ([kv_lst] if kv_lst else []))
        except BaseException:
            with contextlib.suppress(Exception):
                await engine.shutdown(drain=False)
            raise
        loop = asyncio.get_running_loop()
        engine.on_fatal = lambda error: loop.call_soon_threadsafe(self._on_fatal, error)
        await engine.start()
        state = self._server_state(tokenizer, engine)
        kv_server = None
        if pd_cfg is not None:
            kv_server = await _start_pd(state, pd_cfg, kv_lst, kv_tls)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        protocol = header_timeout_protocol(state.settings.header_timeout_s)
        tasks = [self._serve(state, lst, context, protocol)
                 for lst, context in zip(listeners, contexts)]
        while not all(s.started for s in self.servers):
            done = [t for t in tasks if t.done()]
            if done:
                await self._close(tasks, engine, drain=False)
                raise DaemonError("an http server failed to start")
            await asyncio.sleep(0.01)
        for lst in listeners:
            log.info("%s plane(s) on %s://%s:%d", "+".join(sorted(lst.planes)),
                     "https" if any(contexts) else "http", lst.host, lst.port)
        print(READY_LINE, flush=True)
        stop_wait = asyncio.create_task(self.stop.wait())
        await asyncio.wait([stop_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
        state.admission.stop_accepting()
        drained = await self._drain(state, state.settings.e2e_timeout_s)
        if not drained:
            for server in self.servers:
                server.force_exit = True
        await self._close(tasks, engine, drain=drained)
        if kv_server is not None:
            await kv_server.close()
        if self.fatal:
            return EXIT_FAIL
        return EXIT_OK if drained else EXIT_DRAIN_CUT

    def _server_state(self, tokenizer: Any, engine: Any) -> ServerState:
        """What every route needs (server/api/state.py), once the engine runs."""
        cfg = self.cfg
        settings = settings_from_config(cfg, engine.runtime)
        chat_template = None
        if getattr(cfg, "chat_template_path", None):
            chat_template = Path(cfg.chat_template_path).read_text()
        return ServerState(
            settings=settings, tokenizer=tokenizer, engine=engine,
            metrics=make_metrics(settings.model_name, settings.num_speculative_tokens,
                                 bool(getattr(cfg, "metrics_enabled", True))),
            admission=Admission(settings.max_link_num),
            generation_defaults=dict(getattr(tokenizer, "generation_defaults", {}) or {}),
            chat_template=chat_template, request_stop=self.request_stop,
            api_keys=ApiKeys(tuple(getattr(cfg, "api_keys", ()))))

    def _serve(self, state: ServerState, lst: Listener, context: ssl.SSLContext | None,
               protocol: type) -> asyncio.Task:
        """One uvicorn server on a bound listener, carrying its planes; its serving task."""
        # limit_concurrency caps open connections per server (503 beyond it): far above
        # maxLinkNum, so slow clients cannot take every file descriptor.
        config = uvicorn.Config(build_app(state, lst.planes), log_level="warning",
                                access_log=False, lifespan="off", http=protocol,
                                limit_concurrency=max(256, 4 * state.settings.max_link_num),
                                timeout_keep_alive=5, timeout_graceful_shutdown=5)
        config.load()
        config.ssl = context               # built and checked before binding (server/api/tls.py)
        server = _Server(config)
        self.servers.append(server)
        return asyncio.create_task(server.serve(sockets=[lst.sock]))

    async def _drain(self, state: ServerState, limit_s: float) -> bool:
        """Wait for in-flight requests, at most ``limit_s`` (e2eTimeout: no request lives
        longer) or until a second signal; True when all finished.  The log says how it
        ended, so an operator watching a stop knows whether work was cut."""
        start, in_flight = time.monotonic(), state.admission.in_flight
        idle = asyncio.create_task(state.admission.wait_idle())
        forced = asyncio.create_task(self.force.wait())
        done, _ = await asyncio.wait([idle, forced], timeout=limit_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        for task in (idle, forced):
            task.cancel()
        if idle not in done:
            why = "a second stop signal" if forced in done else f"{limit_s:g}s (e2eTimeout)"
            log.warning("drain cut after %s: %d request(s) still in flight; exit code %d",
                        why, state.admission.in_flight, EXIT_DRAIN_CUT)
            return False
        log.info("drain finished: %d in-flight request(s) completed in %.2fs; shutting down",
                 in_flight, time.monotonic() - start)
        return True

    async def _close(self, tasks: list, engine: Any, drain: bool) -> None:
        # Let the last responses flush before closing the sockets.
        await asyncio.sleep(0.05)
        for server in self.servers:
            server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await engine.shutdown(drain=drain)


async def _start_pd(state: ServerState, pd_cfg: Any, kv_lst: Listener,
                    kv_tls: tuple) -> KVServer:
    """The PD instance on the engine (inferMode dmi) and its KV transfer server."""
    engine = state.engine
    registry = state.metrics.registry if state.metrics.enabled else None
    state.pd = PDInstance(pd_cfg, engine.runtime, registry, client_ssl=kv_tls[1])
    engine.kv_export_sink = state.pd.on_export
    # A pull sends its rows within D's kv_trans_timeout; a reader slower than twice that
    # (or 5 s) holds memory for nothing and is cut off.
    kv_server = KVServer(state.pd.exports, state.pd.on_sent, state.pd.on_failed,
                         write_timeout_s=max(5.0, 2 * pd_cfg.trans_timeout_s))
    await kv_server.start(kv_lst.sock, kv_tls[0])
    log.info("PD instance: KV transfer on %s:%d (%s), role %s", pd_cfg.host, pd_cfg.port,
             "TLS" if kv_tls[0] else "plain TCP", state.pd.roles.role or "unassigned")
    return kv_server


def run_daemon(cfg: Any) -> int:
    """Serve until stopped; returns the process exit code (0 after a clean drain)."""
    launch = None
    if getattr(cfg, "engine_process", False):
        # First thing: the engine process loads the checkpoint while this one binds,
        # builds TLS contexts and loads the tokenizer (engine_process.EngineLaunch).
        from server.engine.front.engine_process import EngineLaunch
        launch = EngineLaunch(cfg)
    try:
        return asyncio.run(Daemon(cfg, launch).run())
    except DaemonError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAIL
    except Exception as exc:       # e.g. CheckpointError while loading: say what, not only where
        log.debug("daemon failed", exc_info=True)
        print(f"error: daemon failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAIL
    finally:
        if launch is not None:
            launch.abandon()               # no-op once the daemon took the engine
