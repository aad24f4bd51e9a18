"""The in-process executor (executor/base.py): the worker in the engine's own process.

  * synchronous scheduling: the step runs on the caller's thread and the future is already
    done when ``execute_model`` returns (today's loop: schedule, execute, update);
  * asynchronous scheduling with a worker thread (the default on CUDA): steps run in order
    on one worker thread, so the engine thread schedules step n+1 and processes step n's
    outputs (detokenization, stop strings) while the device executes; the worker thread
    also absorbs the step's device-to-host wait.

On a CPU the interpreter lock defeats a thread, so asynchronous scheduling uses the
worker process of executor/process.py behind the same interface (executor/base.py).
"""
from __future__ import annotations

import concurrent.futures as cf

import torch

from server.engine.messages import ModelRunnerOutput, SchedulerOutput
from server.engine.worker.worker import Worker


class InProcessExecutor:
    def __init__(self, worker: Worker, *, async_scheduling: bool = False) -> None:
        self.worker = worker
        self.info = worker.info()
        self.async_scheduling = async_scheduling
        self._pool: cf.ThreadPoolExecutor | None = None
        if async_scheduling:
            self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker")
            # The worker thread computes with its creator's intra-op thread count.
            self._pool.submit(torch.set_num_threads, torch.get_num_threads()).result()

    def execute_model(self, so: SchedulerOutput) -> "cf.Future[ModelRunnerOutput]":
        if self._pool is not None:
            return self._pool.submit(self.worker.execute_model, so)
        fut: cf.Future[ModelRunnerOutput] = cf.Future()
        try:
            fut.set_result(self.worker.execute_model(so))
        except BaseException as exc:
            fut.set_exception(exc)
        return fut

    def finish_step(self) -> None:
        """The draft passes the last step left, once its outputs are out (worker/worker.py).  A
        worker thread (asynchronous scheduling) drafts inside its steps."""
        if self._pool is None:
            self.worker.finish_step()

    @property
    def num_held_requests(self) -> int:
        return self.worker.num_held_requests

    worker_pids: tuple[int, ...] = ()           # the worker is in this process
    fatal_error: str | None = None              # an inline worker fails steps, never for good

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

