"""What every child process of the engine does first.

The engine process (engine_process.py), a worker process (executor/process.py) and each
rank (executor/parallel.py) leave signals to their parent: the daemon drains, then tells
them to stop, and a child that got SIGINT from the terminal's process group would die
mid-step instead.  They log in the parent's format and level, and compute with the
thread count their parent gave them.
"""
from __future__ import annotations

import logging
import signal


def init_child(log_level: int, threads: int | None = None, log_prefix: str = "") -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s {log_prefix}%(name)s: %(message)s")
    if threads is not None:
        import torch
        torch.set_num_threads(threads)
