"""A worker in its own process: the executor for asynchronous scheduling on a CPU.

Why a process: the model's forward issues thousands of small Python-level operations per
step, and a worker *thread* competes with the engine thread (scheduling, detokenization)
and the HTTP event loop for the interpreter lock, so on a CPU a thread gives no overlap
(measured: 0.78-0.98x of synchronous tokens/s, docs/benchmarks.md).  A process runs its
Python beside the engine's, and the step messages already are plain, picklable values.

The model is handed over through ``torch.multiprocessing`` (its tensors move to shared
memory, not copied per process); the worker builds its KV pool, runner and proposer in
the child.  Requests and results travel through two pipes in step order, so the engine
can launch step n+1 before it reads step n's result.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from server.engine.config import EngineConfig
from server.engine.messages import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("server.engine")
START_TIMEOUT_S = 300.0


def _serve(model: Any, cfg: EngineConfig, num_spec_tokens: int, policy: Any, threads: int,
           log_level: int, requests: Any, results: Any) -> None:
    """The child: build the worker, then execute every message until ``None``.

    A reader thread drains ``requests`` at once, so the engine's send of step n+1 never
    waits for step n to finish; results go back from this thread synchronously (a queue's
    feeder thread would wait for the interpreter lock while the next step runs, delaying
    every result).  Signals are the parent's business (it drains, then sends ``None``); a
    child whose parent is gone exits by itself.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)
    parent = os.getppid()
    from server.engine.worker import Worker
    try:
        worker = Worker(model, cfg, num_spec_tokens, policy)
    except BaseException as exc:
        results.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
        return
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                inbox.put(requests.recv())
            except (EOFError, OSError):
                inbox.put(None)
                return

    threading.Thread(target=read, name="worker-reader", daemon=True).start()
    results.send(("ready", worker.info()))
    while True:
        try:
            so = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if so is None:
            return
        try:
            out = ("ok", worker.execute_model(so))
        except BaseException as exc:           # reported to the engine, which fails the step
            out = ("error", f"{exc!r}\n{traceback.format_exc()}")
        results.send(out)


class StepFuture:
    """The result of one launched step; results arrive in launch order."""

    def __init__(self, owner: "ProcessExecutor") -> None:
        self._owner = owner
        self._done = False
        self._value: ModelRunnerOutput | None = None
        self._error: BaseException | None = None

    def _set(self, kind: str, payload: Any) -> None:
        self._done = True
        if kind == "ok":
            self._value = payload
        else:
            self._error = RuntimeError(f"worker process: {payload}")

    def result(self) -> ModelRunnerOutput:
        self._owner._receive_until(self)
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self) -> BaseException | None:
        try:
            self.result()
        except BaseException as exc:
            return exc
        return None


class ProcessExecutor:
    def __init__(self, model: Any, cfg: EngineConfig, num_spec_tokens: int,
                 policy: Any = None) -> None:
        ctx = mp.get_context("spawn")
        requests_rx, self._requests = ctx.Pipe(duplex=False)
        self._results, results_tx = ctx.Pipe(duplex=False)
        self._pending: list[StepFuture] = []
        self._lock = threading.Lock()
        self._held = 0
        self._proc = ctx.Process(target=_serve, name="engine-worker", daemon=True,
                                 args=(model, cfg, num_spec_tokens, policy,
                                       torch.get_num_threads(), logging.getLogger().level,
                                       requests_rx, results_tx))
        self._proc.start()
        requests_rx.close()
        results_tx.close()
        kind, payload = self._get(START_TIMEOUT_S)
        if kind != "ready":
            self.shutdown()
            raise RuntimeError(f"the worker process failed to start: {payload}")
        self.info = payload
        self.worker = None                       # no in-process worker to inspect

    def _get(self, timeout: float | None) -> tuple[str, Any]:
        while True:
            try:
                if self._results.poll(1.0 if timeout is None else min(timeout, 1.0)):
                    return self._results.recv()
            except (EOFError, OSError):
                pass
            if not self._proc.is_alive():
                return "error", f"exited with code {self._proc.exitcode}"
            if timeout is not None:
                timeout -= 1.0
                if timeout <= 0:
                    return "error", "timed out"

    def execute_model(self, so: SchedulerOutput) -> StepFuture:
        fut = StepFuture(self)
        with self._lock:
            self._pending.append(fut)
            self._requests.send(so)
        return fut

    def _receive_until(self, fut: StepFuture) -> None:
        with self._lock:
            while not fut._done:
                head = self._pending.pop(0)
                kind, payload = self._get(None)
                if kind == "ok":
                    self._held = payload.num_held_requests
                head._set(kind, payload)

    @property
    def num_held_requests(self) -> int:
        return self._held

    def shutdown(self) -> None:
        if self._proc.is_alive():
            try:
                self._requests.send(None)
            except OSError:
                pass
            self._proc.join(10.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
