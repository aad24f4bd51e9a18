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
import threading
import time
import traceback
from typing import Any, Callable

import torch

from server.engine.child import child_context, init_child, tensors_shared_by_name
from server.engine.config import START_TIMEOUT_S, EngineConfig
from server.engine.messages import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("server.engine")


def read_into_queue(conn: Any, name: str) -> queue.SimpleQueue:
    """A thread that moves every message of ``conn`` into the returned queue at once (so a
    sender never waits for the step in progress); None when the pipe closes."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                inbox.put(conn.recv())
            except (EOFError, OSError):
                inbox.put(None)
                return

    threading.Thread(target=read, name=name, daemon=True).start()
    return inbox


def serve_steps(inbox: queue.SimpleQueue, results: Any,
                step: Callable[[Any], ModelRunnerOutput | None], *, idle_s: float,
                heartbeat: Any = None, fatal: Callable[[BaseException], bool] = lambda e: False
                ) -> int:
    """A worker child's loop: run each message of ``inbox`` through ``step`` and send its
    answer, until ``None`` (the parent's stop) or the parent is gone.

    Results go back from this thread synchronously (a queue's feeder thread would wait for
    the interpreter lock while the next step runs, delaying every result).  While idle for
    ``idle_s`` the loop checks its parent and, with a ``heartbeat``, steps that instead (a
    rank group's keep-alive).  ``step`` returns None for messages without an answer.  An
    error is the step's ("error", the engine fails it); one ``fatal`` says ends the loop.
    Returns the process's exit code."""
    parent = os.getppid()
    while True:
        try:
            so = inbox.get(timeout=idle_s)
        except queue.Empty:
            alive = os.getppid() == parent
            if alive and heartbeat is None:
                continue
            so = heartbeat if alive else None
        try:
            out = step(so)
        except BaseException as exc:           # noqa: BLE001 - reported to the engine
            if fatal(exc):
                results.send(("fatal", f"the rank group failed: {exc}"))
                return 1
            results.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
            continue
        if so is None:
            return 0
        if out is not None:
            results.send(("ok", out))


def _serve(model: Any, cfg: EngineConfig, num_spec_tokens: int, policy: Any, threads: int,
           log_level: int, requests: Any, results: Any, environ: dict | None = None) -> None:
    """The child: build the worker, then execute every message until ``None``.

    A reader thread drains ``requests`` at once, so the engine's send of step n+1 never
    waits for step n to finish.  Signals are the parent's business (it drains, then sends
    ``None``); a child whose parent is gone exits by itself.
    """
    init_child(log_level, threads, environ=environ)
    from server.engine.worker.worker import Worker
    try:
        worker = Worker(model, cfg, num_spec_tokens, policy)
    except BaseException as exc:
        results.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
        return
    inbox = read_into_queue(requests, "worker-reader")
    results.send(("ready", worker.info()))
    serve_steps(inbox, results, lambda so: None if so is None else worker.execute_model(so),
                idle_s=1.0)


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
    """Drives worker process(es): rank 0 (or the only worker) answers every step through
    the results pipe; other local ranks (executor/parallel.py) are watched for exit."""

    def __init__(self, model: Any, cfg: EngineConfig, num_spec_tokens: int,
                 policy: Any = None) -> None:
        ctx = child_context()
        requests_rx, requests = ctx.Pipe(duplex=False)
        results, results_tx = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_serve, name="engine-worker", daemon=True,
                           args=(model, cfg, num_spec_tokens, policy,
                                 torch.get_num_threads(), logging.getLogger().level,
                                 requests_rx, results_tx), kwargs={"environ": dict(os.environ)})
        with tensors_shared_by_name():         # the model: a descriptor a storage otherwise
            proc.start()
        requests_rx.close()
        results_tx.close()
        self._attach(requests, results, [proc])
        self._await_ready("the worker process")

    def _attach(self, requests: Any, results: Any, procs: list) -> None:
        self._requests, self._results = requests, results
        self._procs = procs                       # [0] answers; all are watched
        self._pending: list[StepFuture] = []
        self._lock = threading.Lock()
        self._held = 0
        self.fatal_error: str | None = None       # set once a worker is gone: no recovery
        self.worker = None                        # no in-process worker to inspect

    def _await_ready(self, what: str) -> None:
        kind, payload = self._get(START_TIMEOUT_S)
        if kind != "ready":
            self.shutdown()
            raise RuntimeError(f"{what} failed to start: {payload}")
        self.info = payload

    def _dead(self) -> str | None:
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                who = "the worker process" if len(self._procs) == 1 else f"worker rank {rank}"
                return f"{who} exited with code {proc.exitcode}"
        return None

    def _get(self, timeout: float | None) -> tuple[str, Any]:
        while True:
            try:
                if self._results.poll(1.0 if timeout is None else min(timeout, 1.0)):
                    kind, payload = self._results.recv()
                    if kind == "fatal":
                        self.fatal_error = payload
                        return "error", payload
                    return kind, payload
            except (EOFError, OSError):
                pass
            dead = self._dead()
            if dead is not None:
                self.fatal_error = self.fatal_error or dead
                return "error", self.fatal_error
            if timeout is not None:
                timeout -= 1.0
                if timeout <= 0:
                    return "error", "timed out"

    def execute_model(self, so: SchedulerOutput) -> StepFuture:
        fut = StepFuture(self)
        if self.fatal_error is not None:
            fut._set("error", self.fatal_error)
            return fut
        with self._lock:
            self._pending.append(fut)
            try:
                self._requests.send(so)
            except OSError:
                pass                              # the next result read reports who died
        return fut

    def _receive_until(self, fut: StepFuture) -> None:
        with self._lock:
            while not fut._done:
                head = self._pending.pop(0)
                if self.fatal_error is not None:
                    head._set("error", self.fatal_error)
                    continue
                kind, payload = self._get(None)
                if kind == "ok":
                    self._held = payload.num_held_requests
                head._set(kind, payload)

    @property
    def num_held_requests(self) -> int:
        return self._held

    @property
    def worker_pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self._procs)

    def finish_step(self) -> None:
        """The worker process drafts inside its step (Worker ``draft_after_emit`` is off)."""

    def shutdown(self) -> None:
        if self._procs[0].is_alive():
            try:
                self._requests.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        for proc in self._procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
