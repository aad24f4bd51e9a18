"""What every child process of the engine does first, and how it is started.

The engine process (front/engine_process.py), a worker process (executor/process.py) and each
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

Each child keeps the large blocks it frees for reuse (``keep_freed_pages``): glibc's malloc
hands a block over its mmap threshold (128 KB to 32 MB) fresh pages from the kernel and
returns them on free, so each large temporary of a step (a 16-bit weight converted to
float32 for a prompt's GEMM, int8 weights on the float backend, logits) faulted its pages
in again.  On the 2-core AVX2 EPYC converting a [8192, 1536] bf16 weight took 26 ms, 3.5 ms
with the pages kept; a 50-row prompt product through it 43.5 against 24 ms.  The child's
resident size stays at its peak instead, as under a caching allocator.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
from typing import Any, Iterator

# What a worker process or a rank imports anyway: loaded once, in the fork server.
# ``server`` first: its warning filter must be in place before torch imports.
FORKSERVER_PRELOAD = ["server", "torch", "server.engine.executor.parallel",
                      "server.engine.worker.worker", "server.model.loading"]
START_ENV = "MTP_SERVE_CHILD_START"      # "spawn" forces the old way (a fresh interpreter each)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3          # mallopt(3) parameters


def child_context() -> Any:
    """The multiprocessing context for worker processes and ranks: a fork server with the
    worker's modules preloaded where the platform has one, else spawn."""
    import torch.multiprocessing as mp
    if os.environ.get(START_ENV) == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)     # read when the server first starts
    return ctx


@contextlib.contextmanager
def tensors_shared_by_name() -> Iterator[None]:
    """Tensors pickled for a child while this lasts are shared as named shared-memory
    files, not as file descriptors.  Why: torch shares a storage with a child through one
    descriptor each, and the fork server sends all of a child's descriptors in one message
    of at most 256 (multiprocessing.forkserver.MAXFDS_TO_SEND): a worker process handed a
    model of more storages (the 0.5b bench model has 639, a full DeepSeek-V3 thousands)
    failed to start with "too many fds", so asynchronous scheduling could not serve a
    real model.  By name, a storage costs no descriptor; torch's shm manager unlinks the
    files once no process holds them."""
    import torch.multiprocessing as mp
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def keep_freed_pages() -> bool:
    """glibc's malloc keeps freed blocks of up to 1 GiB for reuse (module docstring); False
    where the C library has no mallopt (it keeps its defaults)."""
    try:
        libc = ctypes.CDLL(None)                       # the process's own symbols, libc's among them
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError, TypeError):
        return False


def init_child(log_level: int, threads: int | None = None, log_prefix: str = "",
               environ: dict[str, str] | None = None) -> None:
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s {log_prefix}%(name)s: %(message)s")
    keep_freed_pages()
    if threads is not None:
        import torch
        torch.set_num_threads(threads)
