"""The process group of a tensor/expert-parallel model: rendezvous, step broadcast, faults.

Every rank runs the same worker on its shard (model/parallel.py), so every rank must see
the same step messages in the same order: rank 0 receives them from the engine and
broadcasts each one to the group.  On one node the step messages and the model's
collectives go through shared memory (model/collectives.py: 40x less latency than gloo's
loopback TCP on a CPU); across nodes through ``torch.distributed``.  While the engine is idle rank 0 broadcasts a
heartbeat, so a follower blocked on the next message times out only when rank 0 is gone,
and rank 0 learns of a dead follower at the next collective (gloo reports a closed peer
at once; a hung one after ``timeout_s``).

Start-up is two store rendezvous with the long start timeout, then collectives with the
short one: every rank joins (a node started late is still waited for), every rank loads
its shard (a rank that fails says so under the store key ``failed``, named, so the others
stop waiting at once instead of timing out).
"""
from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from server.engine.config import ParallelConfig
from server.distributed import collectives

log = logging.getLogger("server.engine")

PING = "ping"                   # heartbeat message: nothing to execute


class RankFailed(RuntimeError):
    """Another rank failed (its message names it) or the group cannot be formed."""


def collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from the group (a peer died or hung), not from one request."""
    return (isinstance(exc, (dist.DistError, RankFailed, collectives.CollectiveFailed))
            or "gloo" in str(exc).lower())


class RankGroup:
    def __init__(self, par: ParallelConfig, rank: int, store: Any) -> None:
        self.par = par
        self.rank = rank
        self.world_size = par.world_size
        self.store = store

    @classmethod
    def join(cls, par: ParallelConfig, rank: int, backend: str) -> "RankGroup":
        """Rendezvous on the group's TCP store (rank 0's, or the executor's when it hosts
        it: ``store_hosted``), then form the group."""
        start = dt.timedelta(seconds=par.start_timeout_s)
        try:
            store = dist.TCPStore(par.master_addr, par.master_port, par.world_size,
                                  is_master=rank == 0 and not par.store_hosted,
                                  timeout=start, wait_for_workers=False)
        except Exception as exc:
            raise RankFailed(f"rank {rank}: cannot reach the rendezvous store at "
                             f"{par.master_addr}:{par.master_port}: {exc}") from exc
        group = cls(par, rank, store)
        store.set(f"joined/{rank}", "1")
        group._wait_all("joined", "join")
        dist.init_process_group(backend, store=store, rank=rank, world_size=par.world_size,
                                timeout=dt.timedelta(seconds=par.timeout_s))
        if backend == "gloo":                 # CPU tensors (CUDA ones go through NCCL)
            channel = collectives.open_channel(store, "world", list(range(par.world_size)), rank,
                                               par.timeout_s, par.start_timeout_s,
                                               want=collectives.supported())
            collectives.install(channel)
            log.info("rank %d: collectives through %s", rank,
                     "shared memory" if channel is not None else "gloo")
        return group

    def _wait_all(self, key: str, what: str) -> None:
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.par.start_timeout_s
        while not self.store.check(keys):
            if self.store.check(["failed"]):
                raise RankFailed(self.store.get("failed").decode(errors="replace"))
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if not self.store.check([keys[r]])]
                raise RankFailed(f"rank(s) {missing} did not {what} within "
                                 f"{self.par.start_timeout_s:g} s")
            time.sleep(0.05)

    def ready(self) -> None:
        """This rank has loaded its shard; wait until every rank has."""
        self.store.set(f"ready/{self.rank}", "1")
        self._wait_all("ready", "load its shard")

    def report_failure(self, message: str) -> None:
        """Tell the other ranks (they stop waiting) that this rank cannot start."""
        try:
            self.store.set("failed", message)
        except Exception:           # noqa: BLE001 - the store may be gone with rank 0
            pass

    # -- agreement ------------------------------------------------------------------------
    def agree_min(self, value: int) -> int:
        """The smallest ``value`` of all ranks (e.g. KV blocks: each rank's free memory)."""
        t = torch.tensor([value], dtype=torch.int64)
        return int(collectives.all_reduce(t, "min").item())

    def agree_max(self, value: float) -> float:
        """The largest ``value`` of all ranks (a step's time: the policy must see one)."""
        t = torch.tensor([value], dtype=torch.float64)
        return float(collectives.all_reduce(t, "max").item())

    # -- step messages ----------------------------------------------------------------------
    def broadcast(self, message: Any) -> Any:
        """Rank 0 sends ``message``; every rank returns it."""
        return collectives.broadcast_object(message if self.rank == 0 else None, src=0)

    def close(self) -> None:
        channel = collectives.world_channel()
        if channel is not None:
            collectives.install(None)
            channel.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:       # noqa: BLE001 - a broken group cannot be torn down cleanly
                pass
