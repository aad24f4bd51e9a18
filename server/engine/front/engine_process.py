"""The engine core in its own process: the daemon's default front to the engine.

Why a process: the engine loop (scheduling, the forward's Python-level calls, sampling,
detokenization) and the HTTP event loop (parsing, chat templates, tool and reasoning
parsers, SSE) are both Python, and in one process they take turns on the interpreter
lock: every time the engine thread comes back from a kernel it waits for the event
loop's current stretch of work, so the event loop's cost is added to every step.  Split
into two processes, the HTTP work of step n runs while step n+1 computes, as in vLLM's
engine-core process or SGLang's scheduler process.

Shape: ``EngineProcess`` has AsyncEngine's interface (submit, abort, prepare_grammar,
stats, runtime, fatal_error, kv_export_sink, on_fatal, shutdown).  The child builds the
engine from the AppConfig (checkpoint, tokenizer) and runs the same ``EngineLoop`` as
the in-process engine thread.  Requests and aborts go down one pipe; each step's outputs
come back in one message with the engine's stats (and its RuntimeInfo when it changed),
read by one thread here that hands them to the event loop in one call.  The child
ignores SIGINT/SIGTERM (the daemon drains, then asks it to stop) and exits when its pipe
closes, so it never outlives the daemon.

Switch: ``$MTP_SERVE_ENGINE_PROCESS`` = ``1`` (default) or ``0`` (the engine thread in
the serving process, as engines built in-process always are); ``AppConfig.engine_process``.

Faults.  An engine process that exits is seen at once (its pipe closes).  One that stops
(SIGSTOP, a debugger) or hangs inside a step sends nothing more: a watchdog here takes it
for hung when it holds requests and has sent nothing for ``step_timeout_s``
(``$MTP_SERVE_STEP_TIMEOUT``; a busy engine sends a message every step), kills it and
fails as for a dead rank: the streams end with the error, ``fatal_error`` is set
(``/health`` 503) and ``on_fatal`` tells the daemon, which exits 1.  Before, requests
waited ``tokenTimeout`` while ``/health`` said 200.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import pickle
import sys
import threading
import time
import traceback
from typing import Any, AsyncIterator

from server.engine.child import init_child
from server.engine.config import START_TIMEOUT_S
from server.engine.protocol import EngineOutput, EngineRequest, FinishReason
from server.engine.runtime import RuntimeInfo
from server.engine.stats import EngineStats
from server.engine.front.streams import OutputStreams

log = logging.getLogger("server.engine")


class EngineProcessError(RuntimeError):
    """The engine process ended before its engine was ready, without saying why."""


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if the daemon can unpickle it, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:                      # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _child(app_config: Any, log_level: int, requests: Any, results: Any,
           parent_ends: tuple = ()) -> None:
    """The engine process: build the engine, then run its loop until told to stop (or
    until the daemon's end of the pipe closes).  Torch is imported here, not in the
    daemon: the serving process never loads it (it would cost the daemon a second at
    start and another at exit, for nothing it uses), and the import runs while the
    daemon starts its planes."""
    for conn in parent_ends:
        conn.close()
    init_child(log_level)
    from server.engine.front.async_engine import EngineLoop, build_engine
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        with send_lock:
            try:
                results.send(msg)
            except (OSError, EOFError):     # the daemon is gone; the reader sees EOF too
                pass

    try:
        engine = build_engine(app_config)
    except BaseException as exc:           # noqa: BLE001 - raised again in the daemon
        send(("error", _portable(exc), traceback.format_exc()))
        return
    last_runtime: list[RuntimeInfo | None] = [None]

    def runtime_if_changed() -> RuntimeInfo | None:
        rt = engine.runtime                # frozen: an update replaces the object
        if rt is last_runtime[0]:
            return None
        last_runtime[0] = rt
        return rt

    def deliver(outputs: list[EngineOutput]) -> None:
        send(("out", outputs, loop.stats, runtime_if_changed()))

    loop = EngineLoop(engine, deliver, lambda rid, exc: send(("refused", rid, _portable(exc))),
                      lambda error: send(("fatal", error)))
    send(("ready", runtime_if_changed(), loop.stats))

    def pump() -> None:                    # pipe -> the loop's inbox, at once (never waits on a step)
        while True:
            try:
                msg = requests.recv()
            except (EOFError, OSError):    # the daemon is gone
                msg = None
            if msg is None or msg[0] == "stop":
                if msg is None or not msg[1]:
                    loop.put("abort_all", None)
                while loop.busy():         # the drain, then the loop ends
                    time.sleep(0.01)
                loop.stop()
                return
            if msg[0] == "export":
                engine.kv_export_sink = (lambda rid, n, rows: send(("export", rid, n, rows))) \
                    if msg[1] else None
                continue
            loop.put(msg[0], msg[1])

    threading.Thread(target=pump, name="engine-pump", daemon=True).start()
    loop.run()
    deliver([])                            # the last stats
    engine.shutdown()
    send(("closed",))


class EngineLaunch:
    """An engine process on its way up: ``wait()`` gives the EngineProcess once its engine
    is built, or raises what building it raised; ``abandon()`` if it will not be used.

    Forked where the platform can (Linux): the child starts with the modules the daemon
    has already imported and imports torch and loads the checkpoint while the daemon
    goes on with its own start-up.  The daemon launches it first thing, before any
    thread, socket or tokenizer exists in its process, which is what makes a fork safe;
    elsewhere it is spawned."""

    def __init__(self, app_config: Any, method: str | None = None) -> None:
        self.app_config = app_config
        if method is None:
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        ctx = mp.get_context(method)
        requests_rx, self.requests = ctx.Pipe(duplex=False)
        self.results, results_tx = ctx.Pipe(duplex=False)
        for stream in (sys.stdout, sys.stderr):   # or a fork repeats what is buffered
            stream.flush()
        # Not a daemonic process: the engine may start processes of its own (workers
        # for asynchronous scheduling or parallel ranks, which multiprocessing forbids
        # under a daemonic one); it exits by itself when its pipe closes.
        # A forked child holds this side's pipe ends too: it closes them first, or its
        # reader would never see the daemon go.
        ours = (self.requests, self.results) if method == "fork" else ()
        self.proc = ctx.Process(target=_child, name="engine", daemon=False,
                                args=(app_config, logging.getLogger().level,
                                      requests_rx, results_tx, ours))
        self.proc.start()
        requests_rx.close()
        results_tx.close()
        self._used = False

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> "EngineProcess":
        self._used = True
        deadline = time.monotonic() + timeout_s
        msg: tuple | None = None
        while time.monotonic() < deadline:
            try:
                if self.results.poll(0.5):
                    msg = self.results.recv()
                    break
            except (EOFError, OSError):
                break
            if not self.proc.is_alive():
                break
        if msg is None or msg[0] != "ready":
            self._stop()
            if msg is not None and msg[0] == "error":
                log.debug("engine process start failed:\n%s", msg[2])
                raise msg[1]
            code = self.proc.exitcode
            why = "timed out" if code is None else f"exited with code {code}"
            raise EngineProcessError(f"the engine process {why} before its engine was ready")
        return EngineProcess(self.app_config, self.proc, self.requests, self.results, msg[1], msg[2],
                             step_timeout_s=getattr(self.app_config, "step_timeout_s", None))

    def abandon(self) -> None:
        """The daemon stops before using the engine: end the process now."""
        if not self._used:
            self._used = True
            self._stop()

    def _stop(self) -> None:
        self.requests.close()                     # the child's reader sees EOF and stops
        self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)


class EngineProcess:
    """AsyncEngine's interface over an engine running in a child process (module doc)."""

    def __init__(self, app_config: Any, proc: Any, requests: Any, results: Any,
                 runtime: RuntimeInfo, stats: EngineStats,
                 step_timeout_s: float | None = None) -> None:
        """``step_timeout_s``: the watchdog's bound (module docstring); None: no watchdog."""
        self._app_config = app_config
        self._proc = proc
        self._requests = requests
        self._results = results
        self._runtime = runtime
        self._stats = stats
        self._send_lock = threading.Lock()
        self._streams = OutputStreams()
        self._accepting = True
        self._closing = False
        self._closed = threading.Event()
        self._fatal: str | None = None
        self._sink: Any = None
        self._grammars: Any = None
        self._reader: threading.Thread | None = None
        self._step_timeout_s = step_timeout_s
        self._heard = time.monotonic()         # the last message from the engine process
        self.on_fatal: Any = None

    @classmethod
    def from_config(cls, app_config: Any) -> "EngineProcess":
        """Start the engine process and wait until its engine is built (or failed)."""
        return EngineLaunch(app_config).wait()

    # ---- AsyncEngine's interface ---------------------------------------------------------
    async def start(self) -> None:
        if self._reader is None:
            loop = asyncio.get_running_loop()
            self._reader = threading.Thread(target=self._read, args=(loop,), name="engine-results",
                                            daemon=True)
            self._reader.start()
            if self._step_timeout_s is not None:
                threading.Thread(target=self._watch, args=(loop, self._step_timeout_s),
                                 name="engine-watchdog", daemon=True).start()

    async def submit(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream the request's outputs; the last has finished=True.  Leaving early aborts."""
        if not self._accepting:
            raise RuntimeError("the engine is shutting down")

        def start(q: asyncio.Queue) -> None:
            if self._fatal is not None:        # as the engine thread fails it after a fatal error
                q.put_nowait(self._failed(req.request_id))
                return
            if len(self._streams) == 1:        # idle until now: the watchdog counts from here
                self._heard = time.monotonic()
            self._send(("add", req))
        async with contextlib.aclosing(self._streams.open(req, start, self.abort)) as outputs:
            async for out in outputs:
                yield out

    async def prepare_grammar(self, grammar: str) -> None:
        """Validate and compile ``grammar`` here, on a thread, so a bad one is refused
        before submitting; the engine process compiles it again on first sight."""
        if self._grammars is None:
            from server.engine.config import engine_config_from_app
            from server.engine.sample.grammar import GrammarBook
            self._grammars = GrammarBook(engine_config_from_app(self._app_config).tokenizer_dir,
                                         self._runtime.vocab_size)
        await asyncio.to_thread(self._grammars.compile, grammar)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def purge_peer_blocks(self, epoch: int) -> None:
        self._send(("purge_peer", epoch))

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def fatal_error(self) -> str | None:
        return self._fatal

    @property
    def runtime(self) -> RuntimeInfo:
        return self._runtime

    @property
    def kv_export_sink(self) -> Any:
        return self._sink

    @kv_export_sink.setter
    def kv_export_sink(self, sink: Any) -> None:
        """PD: the engine process sends each prefill's exported rows; ``sink`` gets them
        on the reader thread (the same contract as the engine thread's call)."""
        self._sink = sink
        self._send(("export", sink is not None))

    @property
    def pid(self) -> int:
        return self._proc.pid

    async def shutdown(self, drain: bool = True) -> None:
        """Stop accepting; finish (drain) or abort what is in flight; end the process."""
        self._accepting = False
        self._closing = True
        self._send(("stop", drain))
        await asyncio.get_running_loop().run_in_executor(None, self._join, 15.0)

    # ---- here ------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            try:
                self._requests.send(msg)
            except (OSError, EOFError, BrokenPipeError):
                pass                             # the reader reports the process's end

    def _join(self, timeout: float) -> None:
        self._closed.wait(timeout)
        self._proc.join(max(0.1, timeout / 3))
        if self._proc.is_alive():
            log.warning("the engine process did not stop; killing it")
            self._proc.kill()
            self._proc.join(5.0)
        self._requests.close()

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        """The reader thread: every message of the engine process, in order."""
        while True:
            try:
                msg = self._results.recv()
            except (EOFError, OSError):
                break
            except Exception:                    # noqa: BLE001 - one message that does not load
                log.exception("a message from the engine process could not be read")
                continue
            self._heard = time.monotonic()
            if msg[0] == "closed":
                break
            try:
                self._handle(loop, msg)
            except Exception:                    # noqa: BLE001 - the reader must keep reading
                log.exception("handling a %r message from the engine process failed", msg[0])
        self._closed.set()
        if not self._closing:
            self._proc.join(1.0)
            code = self._proc.exitcode
            self._set_fatal("the engine process exited unexpectedly"
                            + (f" (exit code {code})" if code is not None else ""))
            self._call(loop, self._fail_streams)

    def _watch(self, loop: asyncio.AbstractEventLoop, bound_s: float) -> None:
        """The watchdog thread: an engine process that holds requests and has sent nothing
        for ``bound_s`` is hung (module docstring).  Idle, it sends nothing and owes nothing."""
        while not self._closed.wait(min(1.0, bound_s / 4)):
            if self._closing or self._fatal is not None:
                return
            silent = time.monotonic() - self._heard
            if silent <= bound_s or not len(self._streams):
                continue
            self._set_fatal(f"the engine process (pid {self._proc.pid}) finished no step in "
                            f"{silent:.0f} s with requests in flight (hung or stopped; "
                            f"$MTP_SERVE_STEP_TIMEOUT is {bound_s:g} s)")
            log.error("%s; killing it", self._fatal)
            self._call(loop, self._fail_streams)
            with contextlib.suppress(Exception):
                self._proc.kill()              # SIGKILL ends a stopped process too
            return

    def _handle(self, loop: asyncio.AbstractEventLoop, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            _kind, outputs, self._stats, runtime = msg
            if runtime is not None:
                self._runtime = runtime
            if outputs:
                self._call(loop, self._dispatch, outputs)
        elif kind == "refused":
            self._call(loop, self._streams.put, msg[1], msg[2])
        elif kind == "export":
            if self._sink is not None:
                self._sink(msg[1], msg[2], msg[3])
        elif kind == "fatal":
            self._set_fatal(msg[1])

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:                     # the event loop is closed: nobody to tell
            pass

    def _set_fatal(self, error: str) -> None:
        if self._fatal is not None:
            return
        self._fatal = error
        if self.on_fatal is not None:
            on_fatal, self.on_fatal = self.on_fatal, None
            on_fatal(error)

    # ---- event loop ------------------------------------------------------------------
    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            self._streams.put(out.request_id, out)

    def _fail_streams(self) -> None:
        """The process is gone: every open stream ends with its error."""
        for rid in self._streams.ids():
            self._streams.put(rid, self._failed(rid))

    def _failed(self, request_id: str) -> EngineOutput:
        return EngineOutput(request_id=request_id, token_ids=[], text="", finished=True,
                            finish_reason=FinishReason.ERROR, error=self._fatal)

