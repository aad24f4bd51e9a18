"""Tensor/expert-parallel execution: one worker process per rank, rank 0 driving.

The engine (scheduler, output processing) stays in the daemon's process; it talks to
rank 0 exactly as to the single worker process (executor/process.py: two pipes, results in
step order).  Rank 0 broadcasts each step message to the group (worker/rank_group.py) and every
rank executes it on its shard; only rank 0 answers.  Each rank loads its own slices of
the checkpoint (loader.py with a ParallelPlan), so the daemon never holds the whole model.

This node's ranks are this executor's children; the ranks of other nodes are started by
``python -m server.node`` there (node.py) with the same ``rank_main``.  Faults: a local
rank that exits is seen by the executor at once; a remote or hung one by rank 0's next
collective (heartbeats keep them going while idle).  Either way the executor's
``fatal_error`` is set, every step in flight and after fails with it, and the engine
reports the daemon unhealthy (engine.py); there is no silent hang.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback
from typing import Any

import torch

from server.engine.child import child_context, init_child
from server.engine.config import EngineConfig, ParallelConfig
from server.engine.executor.process import ProcessExecutor, read_into_queue, serve_steps
from server.engine.worker.rank_group import PING, RankFailed, RankGroup, collective_error
from server.model.config import torch_dtype

log = logging.getLogger("server.engine")


def rank_device(cfg: EngineConfig, local_index: int) -> str:
    """This rank's device: the CPU, or the npuDeviceIds entry of its local index."""
    if torch.device(cfg.device).type != "cuda":
        return "cpu"
    ids = cfg.parallel.device_ids
    return f"cuda:{ids[local_index] if local_index < len(ids) else local_index}"


def rank_main(rank: int, cfg: EngineConfig, model_path: str, num_spec_tokens: int,
              threads: int, log_level: int, requests: Any = None, results: Any = None,
              environ: dict | None = None) -> None:
    """One rank: join the group, load the shard, then execute broadcast steps until told
    to stop.  Rank 0 reads the engine's messages from ``requests`` and answers on
    ``results``; a local follower uses ``results`` once, to report start-up."""
    init_child(log_level, threads, log_prefix=f"rank{rank} ", environ=environ)
    par = cfg.parallel
    device = rank_device(cfg, rank - par.local_ranks.start)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    group: RankGroup | None = None
    try:
        group = RankGroup.join(par, rank, "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo")
        from server.engine.worker.worker import Worker
        from server.model.loading import load_checkpoint
        from server.model.parallel.plan import ParallelPlan
        plan = ParallelPlan(par.world_size, par.moe_tp, par.moe_ep, par.sp, par.dp, par.cp,
                            rank=rank)
        model, _ = load_checkpoint(model_path, dtype=torch_dtype(cfg.dtype), device=device,
                                   plan=plan)
        if plan.cp > 1:                          # its sp and cp process groups
            from server.model.parallel.context import join_groups
            join_groups(model, plan.world_size, plan.tp, group.store, par.timeout_s)
        group.ready()
        # The static step compiles as on one process (tp/ep: its collectives are operators
        # in the graphs, model/collectives.py); layouts with striped caches run eager.
        # Int8 shards serve it uncompiled: their sliced int8 tensors' layouts differ from
        # the ones a compile child builds (a graph's stride check refuses them).
        from server.engine.worker.compile_child import int8_layers
        compile_mode = "off" if int8_layers(model) else cfg.compile
        worker = Worker(model, dataclasses.replace(cfg, device=device, compile=compile_mode),
                        num_spec_tokens, group=group)
    except BaseException as exc:                 # noqa: BLE001 - reported, then exit
        message = f"rank {rank}: {exc}" if not str(exc).startswith("rank") else str(exc)
        log.error("failed to start: %s", message)
        if group is not None:
            group.report_failure(message)
        if results is not None:
            results.send(("error", f"{message}\n{traceback.format_exc()}"))
        sys.exit(1)
    if results is not None:
        results.send(("ready", worker.info()))
    code = _drive(group, worker, requests, results) if rank == 0 else _follow(group, worker)
    group.close()
    logging.shutdown()
    # Not sys.exit: interpreter teardown may destroy the backend's threads mid-flight
    # ("terminate called without an active exception").
    os._exit(code)


def _drive(group: RankGroup, worker: Any, requests: Any, results: Any) -> int:
    """Rank 0: every engine message goes to the group, then to its own worker; while
    idle, a heartbeat keeps the group's collectives from timing out."""
    def step(so: Any) -> Any:
        group.broadcast(so)
        return None if so is None or so is PING else worker.execute_model(so)

    with torch.inference_mode():
        return serve_steps(read_into_queue(requests, "rank0-reader"), results, step,
                           idle_s=max(0.2, min(2.0, group.par.timeout_s / 4)), heartbeat=PING,
                           fatal=collective_error)


def _follow(group: RankGroup, worker: Any) -> int:
    """Other ranks: execute what rank 0 broadcasts; a broken group ends the process, and
    so does the end of its parent (checked at every message: heartbeats come while idle)."""
    parent = os.getppid()
    with torch.inference_mode():
        while True:
            try:
                so = group.broadcast(None)
                if so is None or os.getppid() != parent:
                    return 0
                if isinstance(so, str) and so == PING:
                    continue
                worker.execute_model(so)
            except BaseException as exc:         # noqa: BLE001
                log.error("rank %d leaves the group: %s", group.rank, exc)
                return 1


class ParallelExecutor(ProcessExecutor):
    """The engine's view of a rank group: ``execute_model`` / ``shutdown`` as for one worker."""

    def __init__(self, model_path: str, cfg: EngineConfig, num_spec_tokens: int) -> None:
        self._store = None
        if cfg.parallel.master_port == 0:
            self._store, par = host_store(cfg.parallel)
            cfg = dataclasses.replace(cfg, parallel=par)
        par = cfg.parallel
        ctx = child_context()
        threads = max(1, torch.get_num_threads() // max(1, par.ranks_per_node))
        requests_rx, requests = ctx.Pipe(duplex=False)
        results, results_tx = ctx.Pipe(duplex=False)
        procs, status = [], []
        for rank in par.local_ranks:
            if rank == 0:
                args = (requests_rx, results_tx)
            else:
                rx, tx = ctx.Pipe(duplex=False)
                status.append((rank, rx))
                args = (None, tx)
            proc = ctx.Process(target=rank_main, name=f"engine-rank{rank}", daemon=True,
                               args=(rank, cfg, model_path, num_spec_tokens, threads,
                                     logging.getLogger().level) + args,
                               kwargs={"environ": dict(os.environ)})
            proc.start()
            procs.append(proc)
        requests_rx.close()
        results_tx.close()
        self._attach(requests, results, procs)
        self._status = status
        self._await_ready(f"the rank group ({par.world_size} ranks)")

    def shutdown(self) -> None:
        super().shutdown()
        self._store = None                       # its server thread ends with the object

    def _dead(self) -> str | None:
        for rank, rx in self._status:            # a follower's own start-up report
            try:
                if rx.poll():
                    kind, payload = rx.recv()
                    if kind == "error":
                        return f"worker rank {rank} failed: {payload.splitlines()[0]}"
            except (EOFError, OSError):
                pass
        return super()._dead()


def host_store(par: ParallelConfig) -> tuple[Any, ParallelConfig]:
    """A one-node group's rendezvous store, opened here on a port the kernel picks while
    binding, so no other socket can take it before the ranks start; they all join as
    clients.  Returns the store (kept for the group's life) and the layout naming its port."""
    import datetime as dt

    import torch.distributed as dist
    store = dist.TCPStore(par.master_addr, 0, par.world_size, is_master=True,
                          timeout=dt.timedelta(seconds=par.start_timeout_s), wait_for_workers=False)
    return store, dataclasses.replace(par, master_port=store.port, store_hosted=True)


def start_node_ranks(cfg: EngineConfig, model_path: str, num_spec_tokens: int) -> list:
    """Start this node's ranks of a multi-node group (node_rank > 0): they take their steps
    from rank 0 over the group, so they need no pipe to this process."""
    ctx = child_context()
    threads = max(1, torch.get_num_threads() // max(1, cfg.parallel.ranks_per_node))
    procs = []
    for rank in cfg.parallel.local_ranks:
        proc = ctx.Process(target=rank_main, name=f"engine-rank{rank}",
                           args=(rank, cfg, model_path, num_spec_tokens, threads,
                                 logging.getLogger().level), kwargs={"environ": dict(os.environ)})
        proc.start()
        procs.append(proc)
    return procs


__all__ = ["ParallelExecutor", "RankFailed", "rank_main", "start_node_ranks"]
