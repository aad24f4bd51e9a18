"""The engine's async front (AsyncEngine) over the synchronous core (core.LLMEngine).

A dedicated thread owns the core (model, KV pool, scheduler) and runs ``EngineLoop``:
step() while there is work; the event loop talks to it only through an inbox (submit /
abort) and gets outputs back with ``loop.call_soon_threadsafe``.  Torch releases the GIL
in kernels, so the event loop stays responsive while a step runs, but the two still take
turns on the interpreter lock; the daemon therefore runs the same loop in a process of
its own by default (engine_process.py), and this thread front serves engines built
in-process (tests, scripts) and ``$MTP_SERVE_ENGINE_PROCESS=0``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import queue
import threading
from typing import Any, AsyncIterator

import torch

from server.engine.config import EngineConfig, engine_config_from_app
from server.engine.core import EngineError, LLMEngine
from server.engine.protocol import EngineOutput, EngineRequest
from server.engine.runtime import RuntimeInfo
from server.engine.stats import EngineStats
from server.engine.front.streams import OutputStreams
from server.model.config import torch_dtype

__all__ = ["AsyncEngine", "EngineError", "LLMEngine"]
log = logging.getLogger("server.engine")


def build_engine(app_config: Any, model: Any = None, tokenizer: Any = None, *,
                 engine_config: EngineConfig | None = None, device: str | None = None) -> LLMEngine:
    """The engine core for an AppConfig; loads the checkpoint and tokenizer unless given."""
    cfg = engine_config or engine_config_from_app(app_config)
    if device is None and engine_config is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device is not None:
        cfg = dataclasses.replace(cfg, device=device)
    if model is None and cfg.parallel.world_size > 1:
        # The ranks load their own shards; this process needs only the shapes.
        from server.model.loading import inspect_checkpoint
        model = inspect_checkpoint(app_config.model_weight_path)
    elif model is None:
        from server.model.loading import load_checkpoint
        model, _info = load_checkpoint(app_config.model_weight_path,
                                       dtype=torch_dtype(cfg.dtype),
                                       device=cfg.device)
    elif isinstance(model, tuple):
        model = model[0]
    if tokenizer is None:
        from server.text.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(app_config.model_weight_path)
    if isinstance(model, torch.nn.Module):
        model.eval()
    engine = LLMEngine(model, cfg, tokenizer)
    if engine.worker is None:
        # The weights went to worker processes, which keep their own: let this process's
        # copy go now.  A model is a graph of cycles (its static decoder refers back to it),
        # freed only by a full collection, which an idle engine loop may not run for hours:
        # with asynchronous scheduling the 0.5b model's 1.1 GB stayed mapped in the engine
        # process beside the worker's.  (A model the caller passed stays the caller's.)
        del model
        gc.collect()
    return engine


class EngineLoop:
    """The loop that owns an LLMEngine: takes requests and aborts from an inbox, steps
    while there is work, and hands each step's outputs to ``deliver``.  AsyncEngine runs
    it on a thread of the serving process; engine_process.py runs it as the main thread
    of the engine's own process."""

    def __init__(self, engine: LLMEngine, deliver: Any, deliver_error: Any,
                 on_fatal: Any) -> None:
        self.engine = engine
        self.deliver = deliver                  # (outputs) -> None, after every step
        self.deliver_error = deliver_error      # (request_id, exc): an "add" was refused
        self.on_fatal = on_fatal                # (error) -> None, once the workers are gone
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.stopping = False
        self._poll_idle = True                  # cleared if polling the idle worker raises
        self.stats = engine.stats()

    def put(self, kind: str, arg: Any) -> None:
        """``("add", EngineRequest)``, ``("abort", request_id)``, ``("abort_all", None)`` or
        ``("purge_peer", epoch)``, from any thread."""
        self.inbox.put((kind, arg))
        self.wake.set()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()

    def busy(self) -> bool:
        return self.engine.has_unfinished() or not self.inbox.empty()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self.inbox.get_nowait()
            except queue.Empty:
                return
            try:
                if kind == "add":
                    self.engine.add_request(arg)
                elif kind == "abort_all":
                    for rid in list(self.engine.scheduler.requests):
                        self.engine.abort(rid)
                elif kind == "purge_peer":
                    self.engine.blocks.purge_peer_blocks(arg)
                else:
                    self.engine.abort(arg)
            except Exception as exc:               # e.g. a duplicate id: tell that stream only
                if kind == "add":
                    self.deliver_error(arg.request_id, exc)

    def run(self) -> None:
        eng = self.engine
        while not self.stopping:
            self._drain_inbox()
            if not eng.has_unfinished():
                changed = False
                if self._poll_idle:
                    try:
                        changed = eng.poll_idle()
                    except Exception:              # a broken worker shows on the next step
                        log.exception("idle poll of the worker raised; not polling again")
                        self._poll_idle = False
                self.stats = eng.stats()
                if changed:                        # the new runtime reaches /v1/status
                    self.deliver([])
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            wait = eng.idle_wait_s()
            if wait:
                self.wake.wait(wait)
                self.wake.clear()
                self._drain_inbox()
            try:
                outputs = eng.step()
            except Exception:                      # a scheduler bug must not kill the thread
                fatal = eng.fatal_error
                if fatal is None:
                    log.exception("engine step raised; failing the requests in the engine")
                else:
                    log.error("the worker group failed: %s", fatal)
                outputs = eng.fail_all(fatal or "internal engine error")
            if eng.fatal_error is not None and self.on_fatal is not None:
                # Told before the failed outputs go out: their streams then see the engine
                # gone (a 503, not a 500: serving/engine_call.py).
                on_fatal, self.on_fatal = self.on_fatal, None
                on_fatal(eng.fatal_error)
            self.stats = eng.stats()
            self.deliver(outputs)
            try:
                eng.finish_step()                  # the drafts, once the tokens are out
            except Exception:                      # noqa: BLE001 - the next step runs them
                log.exception("finishing the engine step failed")


class AsyncEngine:
    """Async front: ``submit`` streams EngineOutputs; the engine runs on its own thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams = OutputStreams()
        self._loop = EngineLoop(engine, self._deliver, self._deliver_error, self._fatal)
        self._thread: threading.Thread | None = None
        self._accepting = True
        # Called (from the engine thread) once the worker group is gone for good.
        self.on_fatal: Any = None

    @classmethod
    def from_config(cls, app_config: Any, model: Any = None, tokenizer: Any = None, *,
                    engine_config: EngineConfig | None = None, device: str | None = None) -> "AsyncEngine":
        """Build from an AppConfig; loads the checkpoint and tokenizer unless given."""
        return cls(build_engine(app_config, model, tokenizer, engine_config=engine_config,
                                device=device))

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop.run, name="engine", daemon=True)
            self._thread.start()

    async def submit(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream the request's outputs; the last has finished=True.  Leaving early aborts."""
        if not self._accepting:
            raise RuntimeError("the engine is shutting down")
        async with contextlib.aclosing(self._streams.open(req, lambda _q: self._loop.put("add", req),
                                                          self.abort)) as outputs:
            async for out in outputs:
                yield out

    async def prepare_grammar(self, grammar: str) -> None:
        """Compile ``grammar`` on a thread before a request using it is submitted, so the
        engine thread only copies a compiled matcher (sample/grammar.py); raises GrammarError.
        A worker in another process (asynchronous scheduling on a CPU) compiles it there
        on first sight instead, once per grammar."""
        book = self.engine.grammars
        if book is not None:
            await asyncio.to_thread(book.compile, grammar)

    def abort(self, request_id: str) -> None:
        self._loop.put("abort", request_id)

    def purge_peer_blocks(self, epoch: int) -> None:
        self._loop.put("purge_peer", epoch)

    def stats(self) -> EngineStats:
        return self._loop.stats

    @property
    def fatal_error(self) -> str | None:
        return self.engine.fatal_error

    @property
    def runtime(self) -> RuntimeInfo:
        """What the engine runs with (effective k, async scheduling, KV blocks, EOS ids)."""
        return self.engine.runtime

    @property
    def kv_export_sink(self) -> Any:
        """PD: called (from the engine thread) with each prefill's exported KV rows."""
        return self.engine.kv_export_sink

    @kv_export_sink.setter
    def kv_export_sink(self, sink: Any) -> None:
        self.engine.kv_export_sink = sink

    async def shutdown(self, drain: bool = True) -> None:
        """Stop accepting; finish (drain) or abort what is in flight; stop the thread."""
        self._accepting = False
        if not drain:
            for rid in self._streams.ids():
                self.abort(rid)
        while drain and self._loop.busy() and self._thread is not None and self._thread.is_alive():
            await asyncio.sleep(0.01)
        self._loop.stop()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
            self._thread = None
        self.engine.shutdown()

    # ---- engine thread ----------------------------------------------------------------
    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            self._streams.put_threadsafe(out.request_id, out)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        self._streams.put_threadsafe(request_id, exc)

    def _fatal(self, error: str) -> None:
        if self.on_fatal is not None:
            on_fatal, self.on_fatal = self.on_fatal, None
            on_fatal(error)
