"""What every child process of the engine does first, and how it is started.

The engine process (engine_process.py), a worker process (executor/process.py) and each
rank (executor/parallel.py) leave signals to their parent: the daemon drains, then tells
them to stop, and a child that got SIGINT from the terminal's process group would die
mid-step instead.  They log in the parent's format and level, and compute with the
thread count their parent gave them.

Worker processes and ranks start from a fork server that imported torch and the worker's
modules once (``child_context``): a spawned child re-imports them, about 2 s of CPU each,
so a 4-rank group spent some 8 s of a 2-core machine importing before it loaded a weight.
The fork server runs no torch op (no thread pool, no device), so forking from it is safe.
It was started with the environment of its first use; each child is handed its parent's
environment as it is now (``environ``), as a spawned child would have seen it.
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Any

# What a worker process or a rank imports anyway: loaded once, in the fork server.
# ``server`` first: its warning filter must be in place before torch imports.
FORKSERVER_PRELOAD = ["server", "torch", "server.engine.executor.parallel",
                      "server.engine.worker.worker", "server.model.loader"]
START_ENV = "MTP_SERVE_CHILD_START"      # "spawn" forces the old way (a fresh interpreter each)


def child_context() -> Any:
    """The multiprocessing context for worker processes and ranks: a fork server with the
    worker's modules preloaded where the platform has one, else spawn."""
    import torch.multiprocessing as mp
    if os.environ.get(START_ENV) == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)     # read when the server first starts
    return ctx


def init_child(log_level: int, threads: int | None = None, log_prefix: str = "",
               environ: dict[str, str] | None = None) -> None:
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s {log_prefix}%(name)s: %(message)s")
    if threads is not None:
        import torch
        torch.set_num_threads(threads)
