"""A worker node of a multi-node group: this node's ranks, no HTTP planes.

Node 0 runs the daemon (engine, HTTP planes, its own ranks); every other node runs the
same start script with ``NODE_RANK`` >= 1 (and the same ``NNODES``, ``MASTER_ADDR``,
``MASTER_PORT`` and config file), which lands here: it starts ``worldSize / NNODES``
rank processes that join rank 0's group and execute the steps rank 0 broadcasts.  It
exits when they do: 0 after node 0 shut the group down, 1 when a rank failed (the rank
is named in the log).  SIGTERM or SIGINT stops this node's ranks at once; node 0 then
sees the group fail and reports it.
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Any

log = logging.getLogger("server.node")


def run_node(cfg: Any) -> int:
    from server.engine.config import engine_config_from_app
    from server.engine.executor.parallel import start_node_ranks
    from server.model.loading import inspect_checkpoint
    ecfg = engine_config_from_app(cfg)
    summary = inspect_checkpoint(cfg.model_weight_path)
    k = ecfg.num_speculative_tokens if summary.has_mtp else 0
    par = ecfg.parallel
    procs = start_node_ranks(ecfg, str(cfg.model_weight_path), k)
    log.info("node %d of %d: ranks %d..%d started, group at %s:%d", par.node_rank, par.nnodes,
             par.local_ranks.start, par.local_ranks.stop - 1, par.master_addr, par.master_port)
    stopping = False

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while any(p.is_alive() for p in procs) and not stopping:
        time.sleep(0.2)
        failed = [(r, p.exitcode) for r, p in zip(par.local_ranks, procs) if p.exitcode]
        if failed:
            break
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5.0)
    codes = {r: p.exitcode for r, p in zip(par.local_ranks, procs)}
    bad = {r: c for r, c in codes.items() if c}
    if stopping:
        log.info("node %d stopped by signal", par.node_rank)
        return 0
    if bad:
        log.error("node %d: rank(s) %s exited with %s", par.node_rank, sorted(bad), bad)
        return 1
    log.info("node %d: the group was shut down", par.node_rank)
    return 0
