"""The executor: how the engine core reaches its worker(s), and which one it gets.

Three implementations answer the same calls: ``InProcessExecutor`` (the worker inline, or
on a worker thread), ``ProcessExecutor`` (one worker process: asynchronous scheduling on
a CPU) and ``ParallelExecutor`` (a tensor/expert-parallel rank group, rank 0 driving).
``LLMEngine`` hands one ``SchedulerOutput`` per step to ``execute_model`` and gets a
future of the ``ModelRunnerOutput``; results come in launch order.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Protocol

from server.config.parallel_layout import LayoutError
from server.engine.config import EngineConfig, EngineError
from server.engine.messages import ModelRunnerOutput, SchedulerOutput, WorkerInfo


class StepResult(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class Executor(Protocol):
    info: WorkerInfo                  # the worker's figures once it is built
    worker: Any                       # the in-process Worker, or None when it lives elsewhere
    worker_pids: tuple[int, ...]      # worker processes (empty: in this process)
    fatal_error: str | None           # why the workers are gone for good; None while they serve

    def execute_model(self, so: SchedulerOutput) -> StepResult | cf.Future[ModelRunnerOutput]: ...

    def finish_step(self) -> None:
        """Draft passes the last step left for after its outputs went out."""

    @property
    def num_held_requests(self) -> int: ...

    def shutdown(self) -> None: ...


def make_executor(model: Any, cfg: EngineConfig, k: int, policy: Any = None) -> Executor:
    """Inline worker (synchronous); a worker process or thread (asynchronous scheduling);
    a rank group (worldSize > 1)."""
    import torch

    check_layout(cfg)
    if cfg.parallel.world_size > 1:
        from server.engine.executor.parallel import ParallelExecutor
        if policy is not None:
            raise EngineError("a speculation policy object cannot be given to a parallel "
                                   "engine: each rank builds its own from the config")
        return ParallelExecutor(str(model.path), cfg, k)
    kind = cfg.async_executor
    if kind == "auto":
        kind = "thread" if torch.device(cfg.device).type == "cuda" else "process"
    if kind not in ("process", "thread"):
        raise EngineError(f"async_executor {cfg.async_executor!r}; allowed: auto, process, "
                               "thread")
    if cfg.async_scheduling and kind == "process":
        from server.engine.executor.process import ProcessExecutor
        return ProcessExecutor(model, cfg, k, policy)
    from server.engine.executor.in_process import InProcessExecutor
    from server.engine.worker.worker import Worker
    worker = Worker(model, cfg, k, policy,
                    draft_after_emit=cfg.draft_after_emit and not cfg.async_scheduling)
    return InProcessExecutor(worker, async_scheduling=cfg.async_scheduling)


def check_layout(cfg: EngineConfig) -> None:
    """Refuse a layout that breaks a rule or that this build does not serve (the layout's
    own check: server/config/parallel_layout.py), and what a striped KV pool (sp > 1,
    model/parallel/sequence.py, also under cp > 1; dp > 1, model/parallel/data.py) cannot
    do: its blocks live on different ranks, while the host/disk tiers move whole blocks of
    one device pool by global id.  (PD transfer, the other block mover, is served: it reads
    and writes rows over the stripes, kv/transfer/striped.py.)"""
    par = cfg.parallel
    try:
        par.check()
    except LayoutError as exc:
        raise EngineError(str(exc)) from None
    striping = par.kv_striping()
    if striping is None:
        return
    tiers = [name for name, on in (
        ("the host KV tier (kvPoolConfig.backend, or cpuMemSize with maxPreemptCount > 0)",
         cfg.host_cache_gb > 0 or bool(cfg.host_cache_blocks)),
        ("the disk KV tier (kvPoolConfig configPath's disk_path)", cfg.disk_cache_dir))
        if on]
    if tiers:
        verb = "move" if len(tiers) > 1 else "moves"
        raise EngineError(f"{striping}, and {' and '.join(tiers)} {verb} whole blocks of one "
                          f"pool: not served together; turn the tier off or serve with "
                          f"{striping.key} 1")
